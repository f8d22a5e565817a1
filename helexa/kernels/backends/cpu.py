"""The ``cpu`` attention backend: the torch reference plus what makes CPU decode fast.

- Matmuls: per weight shape the kernel that measured fastest at load on this CPU
  (helexa/kernels/cpu/matmul.py), so no CPU runs slower than plain torch; grouped
  int8 layers measure theirs at load too (helexa/kernels/cpu/int8g.py).
- Pure-decode steps of a dense decoder, fp32 weights and plain fp32 KV, one rank:
  helexa/kernels/cpu/native.c between the matmuls (helexa/kernels/cpu/decode.py).
- Otherwise several decode rows keep their context per layer from step to step
  (the decode mirror, kernels.attention.DecodeMirror) when it fits
  ``MIRROR_MAX_BYTES``, else the torch backend's length groups.
Prefill is the torch backend's.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import torch

from helexa.kernels.attention import AttentionMetadata, DecodeMirror, PagedKV
from helexa.kernels.backends.base import StepPlan
from helexa.kernels.backends.torch_ref import TorchBackend, _used_blocks
from helexa.kernels.cpu import decode as cpu_decode
from helexa.kernels.cpu import kquant as cpu_kquant
from helexa.kernels.cpu import matmul as cpu_matmul
from helexa.kernels.cpu import native as cpu_native

MIRROR_MAX_BYTES = 256 * 2**20  # all layers' decode mirrors together, else gather
MIRROR_STEP = 128  # mirror capacity grows in steps of this many positions
log = structlog.get_logger(component="kernels")


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.lib: Any = None
        self.model: torch.nn.Module | None = None
        self.choices: list[cpu_matmul.Choice] = []
        self.native: cpu_decode.NativeDecode | None = None  # set while the pool allows it
        # The decode rows the layers' mirrors hold: (block table objects, positions, cap).
        self._mirror: tuple[list[list[int]], list[int], int] | None = None

    def describe(self) -> str:
        kinds = sorted({"/".join(c.kinds) for c in self.choices})
        return (f"cpu (native decode {'on' if self.native is not None else 'off'}; "
                f"matmul 1 row/2-16/more: {', '.join(kinds) or 'torch'})")

    def prepare_model(self, model: torch.nn.Module, *, max_num_seqs: int,
                      max_batched_tokens: int, tp_size: int) -> None:
        from helexa.neuron.models.layers import ParallelLinearBase, ParallelLMHead
        from helexa.neuron.models.quant import Int8gLinear

        self.model = model
        for m in model.modules():  # grouped int8, kquant: their decode kernels measured at load
            if isinstance(getattr(m, "kernel", None), Int8gLinear | cpu_kquant.KQuantLinear):
                m.kernel.prepare(max_num_seqs)
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            return  # the native kernels and oneDNN packing are fp32-only
        self.lib = cpu_native.load() if tp_size == 1 else None
        tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
        linears = [(m, not (tied and isinstance(m, ParallelLMHead))) for m in model.modules()
                   if isinstance(m, ParallelLinearBase | ParallelLMHead)
                   and getattr(m, "quant", None) is None]  # quantised: helexa/kernels/quant.py's op
        self.choices = cpu_matmul.install(
            linears, self.lib, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
            max_copy_mb=float(os.environ.get("HELEXA_CPU_PACK_MAX_MB", "2048")))
        log.info("kernels.cpu_matmul_chosen", threads=torch.get_num_threads(),
                 shapes={f"{c.shape[0]}x{c.shape[1]}": "/".join(c.kinds) for c in self.choices},
                 times_us={f"{c.shape[0]}x{c.shape[1]}": {k: [round(t) for t in v]
                                                          for k, v in c.times_us.items()}
                           for c in self.choices if c.times_us})

    def allocate_kv(self, layers: list[tuple[int, int]], num_blocks: int, block_size: int, *,
                    kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype
                    ) -> list[PagedKV]:
        self._mirror, self.native = None, None
        pools = super().allocate_kv(layers, num_blocks, block_size, kv_dtype=kv_dtype,
                                    storage=storage, compute=compute)
        if (self.lib is not None and storage == torch.float32 and self.model is not None
                and cpu_decode.supports(self.model)):
            self.native = cpu_decode.NativeDecode(self.model, pools, self.lib)
        return pools

    # ---- per step ------------------------------------------------------------------------

    def plan(self, step: StepPlan) -> AttentionMetadata:
        if step.num_decode and not step.prefills and self.native is not None:
            meta = AttentionMetadata(slot_mapping=step.slot_mapping, backend=self,
                                     num_decode=step.num_decode)
            bs, t = step.block_size, max(step.decode_positions) + 1
            nblk = -(-t // bs)
            tables = [_used_blocks(tab, p + 1, bs, step.num_blocks)
                      for tab, p in zip(step.decode_tables, step.decode_positions, strict=True)]
            # C indexes the pool with these ids unchecked: a bad one must not get there
            if any(not 0 <= blk < step.num_blocks for tab in tables for blk in tab):
                raise ValueError(f"block table holds a block outside the pool of "
                                 f"{step.num_blocks} blocks: {tables}")
            meta.decode_len = t
            meta.decode_tables = torch.tensor([tab + [0] * (nblk - len(tab)) for tab in tables],
                                              dtype=torch.long)
            return meta
        meta = super().plan(step)
        if step.num_decode > 1 and self._plan_mirror(meta, step):
            meta.decode_groups = None  # one padded group, kept across steps
        return meta

    def plan_side(self, step: StepPlan) -> AttentionMetadata:
        # the plain plan: no native decode, no mirrors (they hold the target's layers' rows)
        return TorchBackend.plan(self, step)

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None) -> torch.Tensor:
        nxt, self._mirror = meta.next_mirror, None  # a step that fails leaves mirrors stale
        if meta.decode_tables is not None:
            assert self.native is not None  # plan sets decode_tables only with native decode on
            out = self.native(input_ids, positions, meta.decode_tables, meta.decode_len,
                              logits_rows)
        else:
            out = model(input_ids, positions, meta, logits_rows)
        self._mirror = nxt
        return out

    def step_failed(self) -> None:
        self._mirror = None

    def _plan_mirror(self, meta: AttentionMetadata, step: StepPlan) -> bool:
        """Plain KV, several rows: keep each layer's rows' context across steps
        (DecodeMirror). Reused while the rows are the same requests (the same block table
        objects, which the engine keeps per request, held here so none is recycled) in the
        same order, each one token further, within capacity; else refilled from the pool."""
        kv0 = self.pools[0]
        if kv0.quantized or kv0.k_heads.dtype != kv0.compute:
            return False
        pos_list, bs = step.decode_positions, step.block_size
        b, t = len(pos_list), max(pos_list) + 1
        keys = step.decode_tables
        m = self._mirror
        same = m is not None and (len(m[0]) == b and t <= m[2]
                                  and all(x is y for x, y in zip(keys, m[0], strict=True))
                                  and all(p == q + 1 for p, q in zip(pos_list, m[1], strict=True)))
        cap = m[2] if m is not None and same else (t // MIRROR_STEP + 2) * MIRROR_STEP
        per_layer = 2 * kv0.num_kv_heads * b * cap * kv0.head_dim * kv0.k_heads.element_size()
        if per_layer * len(self.pools) > MIRROR_MAX_BYTES:
            return False
        if not same:
            shape = (kv0.num_kv_heads, b, cap, kv0.head_dim)
            for kv in self.pools:
                if kv.mirror is None or kv.mirror[0].shape != shape:
                    kv.mirror = (torch.empty(shape, dtype=kv0.compute),
                                 torch.empty(shape, dtype=kv0.compute))
            tables = [_used_blocks(tab, p + 1, bs, step.num_blocks) for tab, p in
                      zip(keys, pos_list, strict=True)]
            span = torch.arange(cap)
            table = torch.tensor([tab + [0] * (-(-cap // bs) - len(tab)) for tab in tables],
                                 dtype=torch.long)
            meta.decode_slots = (table[:, span // bs] * bs + span % bs).view(-1)
        index = torch.tensor([i * cap + p for i, p in enumerate(pos_list)], dtype=torch.long)
        meta.decode_mirror = DecodeMirror(fill=not same, write_index=index)
        meta.decode_len = t
        if min(pos_list) != t - 1:  # rows shorter than the longest are masked
            ar = torch.arange(t)
            pos = torch.tensor(pos_list, dtype=torch.long)
            meta.decode_mask = (ar[None, :] <= pos[:, None]).view(b, 1, 1, t)
        meta.next_mirror = (keys, list(pos_list), cap)
        return True
