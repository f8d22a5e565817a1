"""The layout's rules, read from the source: who may import whom, and how big a file may grow.

docs/architecture.md ("Code map") states them: kernels/ never imports the neuron, the router
never imports the neuron, checkpoint/ and the plan are torch-free (so `helexa plan` runs on a
machine without torch's import cost), and no product file grows past MAX_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "helexa"
MAX_LINES = 400
GENERATED = {PKG / "proto"}


def modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py")
                  if not any(g in p.parents for g in GENERATED))


def imported(path: Path) -> set[str]:
    """Every module name the file imports, at any depth (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("kernels", "helexa.neuron"),
    ("router", "helexa.neuron"),
    ("checkpoint", "helexa.neuron"),
    ("config", "helexa.neuron"),
    ("checkpoint", "torch"),
    ("config", "torch"),
])
def test_a_layer_never_imports_what_sits_above_it(folder: str, forbidden: str) -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(n for n in imported(p)
                                                  if n == forbidden or n.startswith(forbidden + "."))
                 for p in modules(PKG / folder)}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_the_plan_is_torch_free() -> None:
    for path in (PKG / "plan.py", PKG / "cli" / "plan.py", PKG / "budget.py"):
        assert not {n for n in imported(path) if n.split(".")[0] == "torch"}, path


def test_no_product_file_is_over_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules(PKG)}
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}


def test_every_folder_is_a_package() -> None:
    """Path = import: a folder of modules without __init__.py would be left out of the wheel."""
    folders = {p.parent for p in modules(PKG)}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
