"""Attention backends (see base.py for the interface) and how one is chosen.

``select(name, device)``: ``auto`` picks ``cuda`` on a CUDA device when FlashInfer
imports (``pip install -e '.[cuda]'``), else ``torch`` there, and ``cpu`` on CPU;
naming one asks for exactly that (``cuda`` without FlashInfer is an error).
"""

from __future__ import annotations

from typing import Any

import torch

from helexa.kernels.backends.base import AttentionBackend, StepPlan, attention

NAMES = ("auto", "torch", "cpu", "cuda")

__all__ = ["NAMES", "AttentionBackend", "StepPlan", "attention", "select"]


def select(name: str, device: torch.device, **cuda_kw: Any) -> AttentionBackend:
    """The backend ``name`` (one of NAMES) for ``device``; ValueError naming what is wrong."""
    if name not in NAMES:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(NAMES)}")
    if name == "auto":
        if device.type == "cpu":
            name = "cpu"
        elif device.type == "cuda":
            from helexa.kernels.backends import cuda

            name = "cuda" if cuda.available() else "torch"
        else:
            name = "torch"
    if name == "torch":
        from helexa.kernels.backends.torch_ref import TorchBackend

        return TorchBackend(device)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU, not {device}")
        from helexa.kernels.backends.cpu import CpuBackend

        return CpuBackend(device)
    from helexa.kernels.backends import cuda

    if device.type != "cuda":
        raise ValueError(f"attention backend 'cuda' runs on a CUDA device, not {device}")
    if not cuda.available():
        raise ValueError("attention backend 'cuda' needs FlashInfer: pip install -e '.[cuda]' "
                         f"({cuda.import_error()})")
    return cuda.CudaBackend(device, **cuda_kw)
