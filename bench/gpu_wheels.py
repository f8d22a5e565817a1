"""Install what the GPU check needs from a folder of wheels, with no network and without
touching the machine's own PyTorch (bench/gpu_check.sh runs it).

    python bench/gpu_wheels.py WHEEL_FOLDER

What it wants: the project's dependencies and its `cuda` extra (pyproject.toml), and
transformers as its `dev` extra pins it (the parity reference), torch excepted. A requirement the machine already
satisfies stays as it is; for one it does not, the folder's wheel goes in with --no-deps, and
that wheel's own requirements are followed the same way. So a folder filled by a full
`pip download` (torch and NVIDIA's CUDA libraries among its files) and a folder holding only
what the machine lacks both work, and nothing the machine has is replaced unless a
requirement asks for a newer one. A requirement with no wheel in the folder is listed and
left: the check's `env` stage reports what then fails to import.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from collections import deque
from importlib import metadata
from pathlib import Path

try:  # packaging comes with what this installs, not with PyTorch: pip's own copy before it
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import (  # type: ignore[no-redef]
        canonicalize_name,
        parse_wheel_filename,
    )
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

NEVER = {"torch"}  # the machine's build, whatever the folder holds


def wanted(root: Path) -> list[Requirement]:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # transformers as the tests pin it: the parity reference's Qwen3.5 classes came in 5.2
    reference = next(r for r in extras["dev"] if r.startswith("transformers"))
    reqs = [*project["dependencies"], *extras["cuda"], reference]
    return [Requirement(r) for r in reqs]


def folder_wheels(folder: Path) -> dict[str, tuple[Version, Path]]:
    """The newest wheel of each project that this interpreter and platform can install."""
    supported = set(sys_tags())
    best: dict[str, tuple[Version, Path]] = {}
    for f in folder.glob("*.whl"):
        name, version, _, tags = parse_wheel_filename(f.name)
        if supported.isdisjoint(tags):
            continue
        if name not in best or version > best[name][0]:
            best[name] = (version, f)
    return best


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines
            if line.startswith("Requires-Dist:")]


def installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def plan(root: Path, folder: Path) -> tuple[list[Path], list[str], list[str]]:
    """(wheels to install, requirements already met, requirements with no wheel)."""
    wheels = folder_wheels(folder)
    todo: deque[Requirement] = deque(wanted(root))
    chosen: dict[str, Path] = {}
    met: dict[str, str] = {}
    missing: list[str] = []
    seen: set[tuple[str, str]] = set()  # each (name, specifier): a later one may be stricter
    while todo:
        req = todo.popleft()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in NEVER or (name, str(req.specifier)) in seen:
            continue
        seen.add((name, str(req.specifier)))
        found = wheels.get(name)
        if name in chosen:  # its folder wheel is taken: it must meet this one too
            if found is None or not req.specifier.contains(found[0], prereleases=True):
                missing.append(f"{req} (the folder's: {found[0] if found else 'none'})")
            continue
        have = installed(name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            met[name] = f"{name} {have}"
            continue
        if found is None or not req.specifier.contains(found[0], prereleases=True):
            missing.append(f"{req} (installed: {have or 'none'})")
            continue
        chosen[name] = found[1]  # an installed one an earlier requirement met gives way
        met.pop(name, None)
        todo.extend(wheel_requires(found[1]))
    return list(chosen.values()), list(met.values()), missing


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, folder = Path(__file__).resolve().parents[1], Path(argv[0])
    if not folder.is_dir():
        print(f'gpu_wheels: no wheel folder {folder} (docs/operating.md, "The GPU check")',
              file=sys.stderr)
        return 1
    install, met, missing = plan(root, folder)
    print(f"gpu_wheels: already met: {', '.join(met) or 'none'}")
    if missing:
        print(f"gpu_wheels: no wheel in {folder} for: {'; '.join(missing)}")
    if install:
        print(f"gpu_wheels: installing {', '.join(p.name for p in install)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                        "--no-deps", "--no-cache-dir", *map(str, install)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
