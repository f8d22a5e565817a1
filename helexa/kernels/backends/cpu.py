"""The ``cpu`` attention backend: the torch reference, composed, plus what makes CPU decode fast.

- Pure-decode steps that the cpu executor can run whole (helexa/kernels/cpu/executor.py:
  a dense decoder, fp32 weights and plain fp32 KV, one rank) are planned as a
  :class:`NativeStep`: the rows' block tables for helexa/kernels/cpu/native.c.
- Otherwise several decode rows keep their context per layer from step to step (the
  decode mirror, helexa/kernels/cpu/mirror.py) when it fits ``MIRROR_MAX_BYTES``: a
  :class:`CpuMetadata`, whose prefill chunks are the reference's.
- Anything else is the torch backend's own plan (``reference``): its metadata names it,
  so the model's attention op reaches it directly.

The matmul kernels and the native whole-step decode are the executor's, not this class's
(weights and steps are a separate hook from attention: executor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels.attention import PrefillChunk, paged_attention
from helexa.kernels.backends.base import AttentionBackend, StepMeta, StepPlan, used_blocks
from helexa.kernels.backends.torch_ref import TorchBackend, TorchMetadata
from helexa.kernels.cpu.mirror import DecodeMirrors, PaddedDecode, padded_decode
from helexa.kernels.cpu.prefill import available as prefill_available
from helexa.kernels.cpu.prefill import context_prefill
from helexa.kernels.paged_kv import PagedKV


@dataclass
class CpuMetadata(StepMeta):
    """A step whose decode rows are read through the layers' decode mirrors."""

    backend: CpuAttention
    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    num_decode: int
    decode: PaddedDecode
    prefills: list[PrefillChunk] = field(default_factory=list)  # the reference's


@dataclass
class NativeStep(StepMeta):
    """A pure-decode step the cpu executor runs whole in native code (no layer forward)."""

    backend: CpuAttention
    slot_mapping: torch.Tensor  # [B] int64
    tables: torch.Tensor  # [B, blocks] int64: each row's block table, zero-padded
    decode_len: int  # the longest row's context, its new token included


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.reference = TorchBackend(device)
        # prefill chunks over cached context: kernels/cpu/prefill.py (set per pool dtype)
        self.context_prefill: Callable[..., torch.Tensor] | None = None
        self.mirrors = DecodeMirrors()
        # Set by the cpu executor (kv_allocated) while it can run a pure-decode step whole.
        self.native_decode = False

    def allocate_kv(self, layers: list[AttentionSpec], num_blocks: int, block_size: int, *,
                    storage: torch.dtype | None, compute: torch.dtype) -> list[PagedKV]:
        self.native_decode = False
        self.pools = self.reference.allocate_kv(layers, num_blocks, block_size, storage=storage,
                                                compute=compute)
        self.context_prefill = context_prefill if prefill_available(compute) else None
        self.reference.context_prefill = self.context_prefill
        self.mirrors.reset(len(self.pools))
        return self.pools

    # ---- per step ------------------------------------------------------------------------

    def plan(self, step: StepPlan) -> CpuMetadata | NativeStep | TorchMetadata:
        if step.num_decode and not step.prefills and self.native_decode:
            self.mirrors.forget()  # the native step writes the pool, not the mirrors
            return self._native(step)
        decode = self.mirrors.plan(step, self.pools) if step.num_decode > 1 else None
        if decode is None:
            self.mirrors.forget()
            return self.reference.plan(step)
        return CpuMetadata(backend=self, slot_mapping=step.slot_mapping,
                           num_decode=step.num_decode, decode=decode,
                           prefills=[self.reference.prefill_chunk(r.start, r.end, r.num_computed,
                                                                  r.block_table, step.block_size)
                                     for r in step.prefills])

    def plan_side(self, step: StepPlan) -> TorchMetadata:
        # the plain plan: no native decode, no mirrors (they hold the target's layers' rows)
        return self.reference.plan(step)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: CpuMetadata) -> torch.Tensor:
        kv = self.pools[layer]
        kv.write(meta.slot_mapping, k, v)
        mirror = self.mirrors.layers[layer]
        ahead = self.context_prefill
        return paged_attention(q, k, v, kv, meta.num_decode,
                               lambda q, k, v: padded_decode(q, kv, meta.decode, k, v, mirror),
                               meta.prefills,
                               None if ahead is None else lambda q, chunk: ahead(q, kv, chunk))

    def step_failed(self) -> None:
        self.mirrors.forget()

    def _native(self, step: StepPlan) -> NativeStep:
        bs, t = step.block_size, max(step.decode_positions) + 1
        nblk = -(-t // bs)
        tables = [used_blocks(tab, p + 1, bs, step.num_blocks)
                  for tab, p in zip(step.decode_tables, step.decode_positions, strict=True)]
        # C indexes the pool with these ids unchecked: a bad one must not get there
        if any(not 0 <= blk < step.num_blocks for tab in tables for blk in tab):
            raise ValueError(f"block table holds a block outside the pool of "
                             f"{step.num_blocks} blocks: {tables}")
        return NativeStep(backend=self, slot_mapping=step.slot_mapping, decode_len=t,
                          tables=torch.tensor([tab + [0] * (nblk - len(tab)) for tab in tables],
                                              dtype=torch.long))
