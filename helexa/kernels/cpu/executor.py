"""The cpu device's step executor: the weights' matmul kernels and the native decode step.

- Matmuls: per weight shape the kernel that measured fastest at load on this CPU
  (helexa/kernels/cpu/matmul.py), so no CPU runs slower than plain torch; grouped int8
  layers measure theirs at load too (helexa/kernels/cpu/int8g.py).
- Pure-decode steps of a dense decoder, fp32 weights and plain fp32 KV, one rank:
  helexa/kernels/cpu/native.c between the matmuls (helexa/kernels/cpu/decode.py), as a
  whole step. It tells its attention backend (helexa/kernels/backends/cpu.py) whether it
  can, so that backend plans such steps as a NativeStep; every other step runs the
  model's forward.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import torch

from helexa.kernels.backends.cpu import CpuAttention, NativeStep
from helexa.kernels.backends.executor import (
    LinearSite,
    StepExecutor,
    measured_at_load,
    model_forward,
)
from helexa.kernels.cpu import decode as cpu_decode
from helexa.kernels.cpu import matmul as cpu_matmul
from helexa.kernels.cpu import native as cpu_native
from helexa.kernels.paged_kv import PagedKV

log = structlog.get_logger(component="kernels")


class CpuExecutor(StepExecutor):
    def __init__(self, attention: CpuAttention) -> None:
        self.attention = attention
        self.lib: Any = None
        self.model: torch.nn.Module | None = None
        self.choices: list[cpu_matmul.Choice] = []
        self.native: cpu_decode.NativeDecode | None = None  # set while the pool allows it

    def describe(self) -> str:
        kinds = sorted({"/".join(c.kinds) for c in self.choices})
        return (f"native decode {'on' if self.native is not None else 'off'}; "
                f"matmul 1 row/2-16/more: {', '.join(kinds) or 'torch'}")

    def prepare(self, model: torch.nn.Module, linears: list[LinearSite], *, max_num_seqs: int,
                max_batched_tokens: int, tp_size: int) -> None:
        self.model = model
        for kernel in measured_at_load(model, linears):  # grouped int8: measured at load
            kernel.prepare(max_num_seqs)
        if next(model.parameters()).dtype != torch.float32:
            return  # the native kernels and oneDNN packing are fp32-only
        self.lib = cpu_native.load() if tp_size == 1 else None
        self.choices = cpu_matmul.install(  # quantised: helexa/kernels/quant.py's op stays
            [(s.module, not s.tied) for s in linears if not s.quantised], self.lib,
            max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
            max_copy_mb=float(os.environ.get("HELEXA_CPU_PACK_MAX_MB", "2048")))
        log.info("kernels.cpu_matmul_chosen", threads=torch.get_num_threads(),
                 shapes={f"{c.shape[0]}x{c.shape[1]}": "/".join(c.kinds) for c in self.choices},
                 times_us={f"{c.shape[0]}x{c.shape[1]}": {k: [round(t) for t in v]
                                                          for k, v in c.times_us.items()}
                           for c in self.choices if c.times_us})

    def kv_allocated(self, pools: list[PagedKV]) -> None:
        self.native = None
        plain_fp32 = bool(pools) and not pools[0].quantized and pools[0].k_heads.dtype == torch.float32
        if (self.lib is not None and plain_fp32 and self.model is not None
                and cpu_decode.supports(self.model)):
            self.native = cpu_decode.NativeDecode(self.model, pools, self.lib)
        self.attention.native_decode = self.native is not None

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None, state: Any = None,
            graph: str | None = None) -> torch.Tensor:
        if isinstance(meta, NativeStep):
            assert self.native is not None  # planned only while native decode is on
            return self.native(input_ids, positions, meta.tables, meta.decode_len, logits_rows)
        return model_forward(model, input_ids, positions, meta, logits_rows, state)
