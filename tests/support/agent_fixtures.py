"""The agents' captured requests (tests/fixtures/agents/, README.md there says how they were
captured), read by name: `fixture("codex-3")` is that file's JSON."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agents"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())
