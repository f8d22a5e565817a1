"""Kernels of the CUDA device written for helexa (Triton), each beside its plain-torch reference."""

from __future__ import annotations

import functools
import importlib
import os

import torch


def unavailable(switch: str, source: str) -> str:
    """"" where the Triton kernel of module ``source`` (in this package) can be built; else
    why not: its ``switch`` set to 0 (read at every call, so a load after setting it runs
    without the kernel: the GPU check's side-by-side runs), or a Triton that does not
    import here (tried once)."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    return _import_error(source)


def described(verdicts: dict[tuple, str], device: torch.device, unavailable: str,
              kernel: str, fallback: str) -> str:
    """A kernel's line in the executor's describe(): ``fallback (why)`` where it cannot be
    built, else one entry per verdict recorded for ``device`` (keys start with the device):
    ``kernel`` where it proved itself, ``fallback (why)`` where not; "" before any."""
    if unavailable:
        return f"{fallback} ({unavailable})"
    said = sorted({why for (on, *_), why in verdicts.items()
                   if on.type == device.type and device.index in (None, on.index)})
    return "; ".join(kernel if not why else f"{fallback} ({why})" for why in said)


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two at least ``n`` and ``least``: a Triton tile's size (a
    block's dims must be powers of two; tl.dot takes no fewer than 16 rows)."""
    return max(least, 1 << (n - 1).bit_length())


def settled(device: torch.device) -> None:
    """Wait for the kernels queued on a CUDA device: a load probe's, so that a fault of
    theirs (an illegal address) raises inside the probe, not at some later step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _import_error(source: str) -> str:
    try:
        importlib.import_module(f"{__name__}.{source}")
    except Exception as e:  # noqa: BLE001 - no Triton, or one that does not import here
        return f"triton does not import ({type(e).__name__}: {e})"
    return ""
