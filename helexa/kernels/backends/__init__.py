"""Device backends and how one is chosen: an attention backend (base.py) and the step
executor beside it (executor.py), built together as one :class:`Device`.

``select(name, device)``: ``auto`` picks ``cuda`` on a CUDA device when FlashInfer
imports (``pip install -e '.[cuda]'``), else ``torch`` there, and ``cpu`` on CPU;
naming one asks for exactly that (``cuda`` without FlashInfer is an error). Each name
is one entry of ``REGISTRY``: a function building that device's pair.

Given the model's attention ``shape``, ``cuda`` (asked for or picked by ``auto``) is not
used for a model FlashInfer cannot serve (fp32, head_dim outside 64/128/256:
cuda.unsupported): the torch backend runs instead, and the log line and ``describe()``
(the load log, Watch, ``ctl status``) say so and why. Falling back rather than refusing
keeps one config valid across a fleet's checkpoints; the reason is never silent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from helexa.kernels.backends.base import AttentionBackend, AttentionShape, StepPlan, attention
from helexa.kernels.backends.executor import LinearSite, StepExecutor

NAMES = ("auto", "torch", "cpu", "cuda")

log = structlog.get_logger(component="kernels")

__all__ = ["NAMES", "REGISTRY", "AttentionBackend", "AttentionShape", "Device", "LinearSite", "StepExecutor",
           "StepPlan", "attention", "select"]


@dataclass
class Device:
    """One model runner's device: the attention backend (KV pools, per-step attention
    metadata, the attention op) and the step executor (weight kernels, whole steps)."""

    attention: AttentionBackend
    executor: StepExecutor
    note: str = ""  # why this backend runs rather than the one asked for ("" when as asked)

    @property
    def name(self) -> str:
        return self.attention.name

    def describe(self) -> str:
        """One line for the load log and status: the backend and what it chose."""
        parts = [p for p in (self.note, self.attention.describe(), self.executor.describe())
                 if p]
        return f"{self.name} ({'; '.join(parts)})" if parts else self.name


@dataclass(frozen=True)
class DeviceOptions:
    cuda_graphs: bool = True
    max_num_seqs: int = 8
    tp_size: int = 1
    shape: AttentionShape | None = None  # this rank's attention (per_rank), where known


def _torch(device: torch.device, opts: DeviceOptions) -> Device:
    from helexa.kernels.backends.torch_ref import TorchBackend

    return Device(TorchBackend(device), StepExecutor())


def _cpu(device: torch.device, opts: DeviceOptions) -> Device:
    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on CPU, not {device}")
    from helexa.kernels.backends.cpu import CpuAttention
    from helexa.kernels.cpu.executor import CpuExecutor

    attention = CpuAttention(device)
    return Device(attention, CpuExecutor(attention))


def _cuda(device: torch.device, opts: DeviceOptions) -> Device:
    from helexa.kernels.backends import cuda

    if device.type != "cuda":
        raise ValueError(f"attention backend 'cuda' runs on a CUDA device, not {device}")
    if not cuda.available():
        raise ValueError("attention backend 'cuda' needs FlashInfer: pip install -e '.[cuda]' "
                         f"({cuda.import_error()})")
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor

    rows = opts.max_num_seqs if opts.cuda_graphs else 0
    attention = cuda.CudaAttention(
        device, graph_rows=rows, workspace_bytes=cuda.workspace_bytes(opts.shape, device),
        graph_workspace_bytes=cuda.workspace_bytes(opts.shape, device, rows))
    # a wider profile's graphs (CudaGraphExecutor.set_graph_rows): their scratch for n rows
    return Device(attention, CudaGraphExecutor(
        attention, graph_workspace=lambda n: cuda.workspace_bytes(opts.shape, device, n)))


REGISTRY: dict[str, Callable[[torch.device, DeviceOptions], Device]] = {
    "torch": _torch, "cpu": _cpu, "cuda": _cuda}


def select(name: str, device: torch.device, *, cuda_graphs: bool = True, max_num_seqs: int = 8,
           tp_size: int = 1, shape: AttentionShape | None = None) -> Device:
    """The device backend ``name`` (one of NAMES) for ``device``; ValueError naming what is
    wrong. ``cuda_graphs`` lets the cuda one capture decode steps of up to
    ``max_num_seqs`` rows. ``shape``: the whole model's attention (each of ``tp_size`` ranks
    sizes its own share), for the cuda fallback and FlashInfer's scratch (see the module
    docstring)."""
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
    if device.type == "cuda" and device.index is not None and torch.cuda.is_available():
        # one model per engine process: its device becomes the current one, which
        # FlashInfer's CuTe kernels, torch's graph capture and a bare Event().record() use
        # (a model on cuda:1 would otherwise launch on, capture from, or wait for cuda:0);
        # a bare "cuda" is the current device already (set_device refuses it)
        torch.cuda.set_device(device)
    opts = DeviceOptions(cuda_graphs, max_num_seqs, tp_size,
                         shape.per_rank(tp_size) if shape is not None else None)
    if name == "cuda" and shape is not None:
        from helexa.kernels.backends import cuda

        reason = cuda.unsupported(shape)
        if reason:
            log.warning("kernels.backend_fallback", asked="cuda", runs="torch", reason=reason)
            chosen = _torch(device, opts)
            chosen.note = f"not cuda: {reason}"
            return chosen
    return REGISTRY[name](device, opts)
