"""A built wheel holds the whole source tree: every module and every package-data file.

A wheel is what a GPU host, a container image or `pip install .` gets; the editable install
the tests run under would hide a package missing from it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA_SUFFIXES = (".c", ".html", ".txt")


def source_files() -> set[str]:
    tracked = subprocess.run(["git", "ls-files", "helexa"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    return {f for f in tracked if f.endswith((".py", *DATA_SUFFIXES))}


def tracked_copy(dest: Path) -> Path:
    """The tracked files as they are in the working tree (setuptools' build/ folder of an
    earlier build would otherwise add what the tree no longer has)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for f in tracked:
        if (ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dest / f)
    return dest


def test_the_wheel_holds_every_module_and_data_file(tmp_path: Path) -> None:
    src = tracked_copy(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("helexa-*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("helexa/")}
    expected = source_files()
    assert expected, "git lists no source files under helexa/"
    assert expected - held == set(), "the wheel lacks these source files"
    # nothing the tree does not have either (a stale build/ folder, a generated file)
    assert {n for n in held if n.endswith((".py", *DATA_SUFFIXES))} - expected == set()
    for package in ("helexa/kernels/backends/", "helexa/neuron/engine/speculative/"):
        assert any(n.startswith(package) for n in held), package  # the two that once went missing
