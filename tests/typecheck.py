"""`make typecheck`: mypy over router/ and neuron/engine/, under the names they install as.

pyproject maps `router/` to `helexa.router` and `neuron/` to `helexa.neuron`
(setuptools package-dir), and the editable install resolves those names with
an import hook mypy cannot follow. So this builds a tree of symbolic links
laid out as the installed package (`build/typecheck/helexa/...`) and runs
mypy there with the settings of pyproject's [tool.mypy]. Exit status is
mypy's.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"
CHECKED = ["helexa.router", "helexa.neuron.engine"]


def link_tree() -> Path:
    """build/typecheck/helexa: helexa/'s entries, with router, neuron and kernels beside them."""
    pkg = TREE / "helexa"
    if TREE.exists():
        shutil.rmtree(TREE)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "helexa").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for folder in ("router", "neuron", "kernels"):
        (pkg / folder).symlink_to(ROOT / folder)
    return TREE


def main() -> int:
    from mypy import api

    tree = link_tree()
    args = ["--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(ROOT / "build" / "mypy-cache")]
    for name in CHECKED:
        args += ["-p", name]
    os.chdir(tree)  # mypy finds helexa/ in the working directory
    out, err, status = api.run(args)
    for package, folder in (("helexa/router/", "router/"), ("helexa/neuron/", "neuron/"),
                            ("helexa/kernels/", "kernels/")):
        out = out.replace(package, folder)  # name the files as they are in the repository
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
