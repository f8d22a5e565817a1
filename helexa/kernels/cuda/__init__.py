"""Kernels of the CUDA device written for helexa (Triton), each beside its plain-torch reference."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable
from typing import Any

import structlog
import torch

log = structlog.get_logger(component="kernels")
# every kernel's verdicts by its event, so that a tensor-parallel group can agree on them
# (refusals / adopt: what one rank's card refused, every rank refuses; docs/architecture.md)
_KERNELS: dict[str, Verdicts] = {}


def unavailable(switch: str, source: str) -> str:
    """"" where the Triton kernel of module ``source`` (in this package) can be built; else
    why not: its ``switch`` set to 0 (read at every call, so a load after setting it runs
    without the kernel: the GPU check's side-by-side runs), or a Triton that does not
    import here (tried once)."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    return _import_error(source)


class Verdicts:
    """What serves each kind of a kernel's calls (keys start with the device): "" the
    kernel, which proved itself on that card, else why its fallback does. ``event``_chosen
    is logged the first time a kind proves itself, ``event``_fallback each time one fails
    (a kind that failed stays failed: a later agreeing probe does not clear it), with the
    fields ``fields`` names the key by (made only when logged: calls ask on hot paths)."""

    def __init__(self, event: str, kernel: str, fallback: str,
                 fields: Callable[[tuple], dict[str, Any]]) -> None:
        self.event, self.kernel, self.fallback, self.fields = event, kernel, fallback, fields
        self._by_kind: dict[tuple, str] = {}
        self._lock = threading.Lock()
        _KERNELS[event] = self

    def get(self, key: tuple) -> str | None:
        """The kind's verdict, None before it has one."""
        return self._by_kind.get(key)

    def record(self, key: tuple, why: str, **more: Any) -> str:
        """A probe's or a failed call's outcome for ``key`` (``more``: log fields beside
        the key's)."""
        if why:
            self._by_kind[key] = why
            log.warning(f"{self.event}_fallback", reason=why, **self.fields(key), **more)
        elif key not in self._by_kind:
            self._by_kind[key] = ""
            log.info(f"{self.event}_chosen", **self.fields(key), **more)
        return self._by_kind[key]

    def decide(self, key: tuple, probe: Callable[[], str]) -> str:
        """The kind's verdict, ``probe``'s the first time it is asked (once, whatever the
        threads asking)."""
        if (why := self._by_kind.get(key)) is not None:
            return why
        with self._lock:
            if (why := self._by_kind.get(key)) is None:
                why = self.record(key, probe())
        return why

    def __len__(self) -> int:
        return len(self._by_kind)

    def describe(self, device: torch.device, unavailable: str) -> str:
        """The kernel's line in the executor's describe(): ``fallback (why)`` where it
        cannot be built, else one entry per verdict recorded for ``device``: ``kernel``
        where it proved itself, ``fallback (why)`` where not; "" before any."""
        if unavailable:
            return f"{self.fallback} ({unavailable})"
        said = sorted({why for key, why in self._by_kind.items() if _on(key, device)})
        return "; ".join(self.kernel if not why else f"{self.fallback} ({why})"
                         for why in said)


def _on(key: tuple, device: torch.device) -> bool:
    """A verdict's key is for ``device`` (a device without an index: any of its type)."""
    on = key[0]
    return bool(on.type == device.type and device.index in (None, on.index))


def refusals(device: torch.device) -> list[tuple[str, list[Any], str]]:
    """Every kind a kernel was refused for on ``device``, free of the device (another
    rank's card reads it as its own): (the kernel's event, the kind's other fields, why)."""
    return [(event, [str(f) if isinstance(f, torch.dtype) else f for f in key[1:]], why)
            for event, v in _KERNELS.items() for key, why in list(v._by_kind.items())
            if why and _on(key, device)]


def adopt(device: torch.device, event: str, kind: list[Any], why: str) -> bool:
    """Record a kind another rank refused (a refusals() entry) as refused on ``device`` too,
    logged as the kernel's fallback with ``why``; False where it is already refused here
    (or the kernel is unknown here). ``device``: the rank's card by its index, as a call's
    tensors name it (tensor parallelism needs each card named: helexa/config/neuron.py device_problem)."""
    verdicts = _KERNELS.get(event)
    if verdicts is None:
        return False
    key = (device, *(getattr(torch, f[6:]) if isinstance(f, str) and f.startswith("torch.")
                     and isinstance(getattr(torch, f[6:], None), torch.dtype) else f
                     for f in kind))
    if verdicts.get(key):
        return False
    verdicts.record(key, why)
    return True


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
