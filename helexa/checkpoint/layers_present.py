"""How many decoder layers a checkpoint's tensors hold, read from the file headers alone.

config.json's num_hidden_layers decides what the planner counts and the loader builds: a
corrupt or hostile figure (1e9) cost minutes and gigabytes before anything failed. The
plan compares it with the layer indices the tensors carry (`…layers.N.…` in safetensors,
`blk.N.…` in GGUF), which costs one header read per file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
# A safetensors header is a JSON index of names and offsets: far under this for any model.
_MAX_HEADER_BYTES = 256 * 1024 * 1024


def layer_count(names: list[str]) -> int | None:
    """1 + the highest layer index among tensor names; None when none is numbered."""
    found = [int(m.group(1)) for n in names if (m := _LAYER.search(n))]
    return max(found) + 1 if found else None


def safetensors_names(folder: Path) -> list[str]:
    """Every tensor name in the folder's *.safetensors files; ValueError for a header that
    cannot be one (its length past the file's end)."""
    names: list[str] = []
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"{path.name}: corrupt safetensors header (length {n:,} in a "
                                 f"file of {size:,} bytes)")
            names += [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    return names


def missing_layers(layers: int, gguf: Path | None, folder: Path) -> str | None:
    """Why a config's `num_hidden_layers` cannot be served from these files (more layers
    than the tensors hold), or None; GgufError, ValueError or OSError for a header that
    cannot be read."""
    from helexa.checkpoint.gguf import reader

    names = [t.name for t in reader(gguf).tensors] if gguf is not None \
        else safetensors_names(folder)
    held = layer_count(names)
    if held is not None and layers > held:
        return f"config num_hidden_layers is {layers:,}, but the checkpoint's tensors hold " \
               f"{held} layers"
    return None
