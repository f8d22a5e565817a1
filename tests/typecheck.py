"""`make typecheck`: mypy over helexa.router and helexa.neuron.engine (and the fake runner).

The folders are the import paths, so mypy reads the tree as it is, with the
settings of pyproject's [tool.mypy]. Exit status is mypy's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["helexa.router", "helexa.neuron.engine"]
# The fake runner states that it is a Runner (helexa/neuron/engine/runner.py): mypy checks it.
CHECKED_TEST_MODULES = ["support.fake_runner"]


def main() -> int:
    from mypy import api

    args = ["--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(ROOT / "build" / "mypy-cache")]
    for name in CHECKED:
        args += ["-p", name]
    for name in CHECKED_TEST_MODULES:
        args += ["-m", name]
    os.environ["MYPYPATH"] = str(ROOT / "tests")  # where `support` is found, as pytest finds it
    os.chdir(ROOT)  # mypy finds helexa/ in the working directory
    out, err, status = api.run(args)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
