"""`helexa bench report` on records made by hand: two endpoints, a sweep each, one knee."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

from helexa.loadgen.report import main
from helexa.loadgen.request import Record


def _run(path: Path, bound_ms: float) -> None:
    """Endpoint `fast` keeps TTFT flat; `slow`'s TTFT grows with concurrency past the bound
    at 4."""
    lines = [json.dumps({"run": {"ttft_bound_ms": bound_ms}})]
    t = 0.0
    for level in (1, 2, 4):
        for ep, ttft in (("fast", 0.02), ("slow", 0.05 * level * level)):
            for i in range(4):
                t += 0.01
                chunks = [(ttft + 0.01 * k, 1) for k in range(10)]
                rec = Record(endpoint=ep, scenario=f"chat:8,sweep:4@{level}", index=i, t_sent=t,
                             outcome="ok", status=200, ttft=ttft, e2e=ttft + 0.1, chunks=chunks,
                             prompt_tokens=8, completion_tokens=10, concurrency=level)
                lines.append(json.dumps(msgspec.to_builtins(rec)))
    path.write_text("\n".join(lines) + "\n")


def test_report_writes_pngs_and_one_self_contained_page(tmp_path, capsys):
    run = tmp_path / "run.jsonl"
    _run(run, bound_ms=500)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert [Path(p).name for p in written] == ["ttft.png", "itl.png", "concurrency.png",
                                               "index.html"]
    for p in written[:3]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(written[3]).read_text()
    assert len(re.findall(r'<img alt="[a-z]+" src="data:image/png;base64,', page)) == 3
    assert "chat:8,sweep:4 on slow: knee at concurrency 4" in page  # 0.05*16 = 800 ms > 500
    assert "chat:8,sweep:4 on fast: no knee up to concurrency 4" in page


def test_two_runs_are_overlaid_with_their_names(tmp_path, capsys):
    for name in ("before", "after"):
        _run(tmp_path / f"{name}.jsonl", bound_ms=500)
    assert main([str(tmp_path / "before.jsonl"), str(tmp_path / "after.jsonl")]) == 0
    page = (tmp_path / "before-report" / "index.html").read_text()
    assert "before:slow" in page and "after:fast" in page
