"""Weights built where they will live, or on the meta device until a format says which.

A quantised checkpoint (GPTQ, compressed-tensors, GGUF: helexa/neuron/formats/) replaces
most linear and expert weights of the model it loads into by its own packed tensors
(``attach``). Built on a GPU first, those float weights would hold the card's memory at
the float model's size until replaced (CUDA allocates on ``torch.empty``, where CPU pages
stay uncommitted): a 4-bit 32B model would need ~64 GB to load and ~18 GB to serve. Inside
:func:`deferred_weights` the layers put those weights on the meta device (no memory) and
remember where they belong (``weight_home``); after the format's attach the loader makes
what is left real there (:func:`materialise`), before any weight is read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

_DEFERRED: ContextVar[bool] = ContextVar("helexa_deferred_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Build the model's linear and expert weights on the meta device (see the module
    docstring)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def place(device: Any) -> Any:
    """Where a linear or expert weight is built: ``device``, or meta inside deferred_weights."""
    return torch.device("meta") if _DEFERRED.get() else device


def home(module: nn.Module, t: torch.Tensor) -> torch.device:
    """The device ``t`` (one of ``module``'s weights) belongs on: its own, or where its
    layer was built for where it was deferred."""
    return getattr(module, "weight_home", t.device) if t.is_meta else t.device


def materialise(model: nn.Module, device: Any) -> int:
    """Every parameter and buffer still on the meta device made real (uninitialised) on
    ``device``, attributes kept (weight loaders) and shared ones still shared (a tied
    head); returns the bytes made."""
    made: dict[int, torch.Tensor] = {}
    total = 0
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                new = made.get(id(t))
                if new is None:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=False)
                        new.__dict__.update(t.__dict__)
                    made[id(t)] = new
                    total += new.numel() * new.element_size()
                table[name] = new
    return total
