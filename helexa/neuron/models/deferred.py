"""Weights built where they will live, or on the meta device until a format says which.

A quantised checkpoint (GPTQ, compressed-tensors, GGUF: helexa/neuron/formats/) replaces
most linear and expert weights of the model it loads into by its own packed tensors
(``attach``). Built on a GPU first, those float weights would hold the card's memory at
the float model's size until replaced (CUDA allocates on ``torch.empty``, where CPU pages
stay uncommitted): a 4-bit 32B model would need ~64 GB to load and ~18 GB to serve. Inside
:func:`deferred_weights` the layers put those weights on the meta device (no memory) and
remember where they belong (``weight_home``); after the format's attach the loader makes
what is left real there (:func:`materialise`), before any weight is read. Quantize-at-load
(which reads the float weights) stages them in host memory instead and packs each onto
the device as its layer is done; :func:`settle` moves the rest (biases, float layers).
A format's own staging tensors (GGUF's unpacked parts, 1.25 bytes a value) stay on meta
past materialise (:func:`until_loaded`) and are made real one layer at a time as the
file's tensors arrive (:func:`real`), so they never pile up for the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

_DEFERRED: ContextVar[str | None] = ContextVar("helexa_deferred_weights", default=None)


@contextmanager
def deferred_weights(to: str = "meta") -> Iterator[None]:
    """Build the model's linear and expert weights on ``to`` (see the module docstring):
    "meta" for a packed checkpoint; "cpu" to stage a float checkpoint's weights in host
    memory where quantize-at-load packs them onto the device layer by layer."""
    token = _DEFERRED.set(to)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def place(device: Any) -> Any:
    """Where a linear or expert weight is built: ``device``, or deferred_weights' target."""
    to = _DEFERRED.get()
    return device if to is None else torch.device(to)


def home(module: nn.Module, t: torch.Tensor) -> torch.device:
    """The device ``t`` (one of ``module``'s weights) belongs on: where its layer was built
    for (``weight_home``), else its own."""
    at = getattr(module, "weight_home", None)
    return t.device if at is None else torch.device(at)


def away(module: nn.Module, t: torch.Tensor) -> bool:
    """``t`` is not on its home device (built deferred, on meta or staged on the host)."""
    at = home(module, t)
    return t.device.type != at.type or (at.index is not None and t.device.index != at.index)


def settle(model: nn.Module) -> int:
    """After loading: every staged weight (built on the host by deferred_weights("cpu"))
    moved to its home device, attributes and sharing kept; returns the bytes moved."""
    return _replace(model, lambda mod, t: getattr(mod, "weight_home", None) is not None
                    and not t.is_meta and away(mod, t),
                    lambda mod, t: t.detach().to(home(mod, t)))


def materialise(model: nn.Module, device: Any) -> int:
    """Every parameter and buffer still on the meta device made real (uninitialised) on
    ``device``, attributes kept (weight loaders) and shared ones still shared (a tied
    head), except those left for their first load (:func:`until_loaded`); returns the
    bytes made."""
    return _replace(model, lambda mod, t: t.is_meta and getattr(t, "load_home", None) is None,
                    lambda mod, t: torch.empty_like(t, device=device))


def until_loaded(shape: tuple[int, ...], dtype: torch.dtype, at: Any) -> nn.Parameter:
    """A parameter of ``shape`` that belongs on ``at`` but holds no memory until the first
    piece loads into it (:func:`real`): materialise leaves it on meta."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    p.load_home = torch.device(at)  # type: ignore[attr-defined]
    return p


def real(module: nn.Module, name: str) -> nn.Parameter:
    """``module``'s parameter ``name``, made real (zeros) on its home first if it is still
    waiting for its first load (:func:`until_loaded`); attributes kept."""
    p = module._parameters[name]
    assert p is not None
    if not p.is_meta or getattr(p, "load_home", None) is None:
        return p
    new = _as_before(p, torch.zeros_like(p, device=p.load_home))
    module._parameters[name] = new
    return new


def _replace(model: nn.Module, pick: Callable[[nn.Module, torch.Tensor], bool],
             make: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> int:
    """Each parameter and buffer ``pick`` chooses replaced by ``make``'s tensor (a parameter
    stays one, its attributes kept; one tensor shared by two modules stays shared)."""
    made: dict[int, torch.Tensor] = {}
    total = 0
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or not pick(mod, t):
                    continue
                new = made.get(id(t))
                if new is None:
                    new = made[id(t)] = _as_before(t, make(mod, t))
                    total += new.numel() * new.element_size()
                table[name] = new
    return total


def _as_before(old: torch.Tensor, new: torch.Tensor) -> Any:
    """``new`` in ``old``'s place: a parameter if it was one, its attributes (weight
    loaders, load_home) kept."""
    if not isinstance(old, nn.Parameter):
        return new
    p = nn.Parameter(new, requires_grad=False)
    p.__dict__.update(old.__dict__)
    return p
