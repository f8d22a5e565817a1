"""The ``torch`` attention backend: plain torch and SDPA on any device, no native code.

It is the reference the ``cpu`` and ``cuda`` backends are tested against, and the path
for whatever they do not cover (they compose it: base.py). Its temporaries are bounded:
decode rows run in length groups (kernels.attention.DecodeGroup), long contexts a chunk
at a time, so one 32k-token row beside short ones costs a chunk, not the batch padded to
32k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels.attention import (
    DECODE_CHUNK_TOKENS,
    DecodeGroup,
    PrefillChunk,
    grouped_decode,
    paged_attention,
)
from helexa.kernels.backends.base import (
    AttentionBackend,
    StepMeta,
    StepPlan,
    host_to_device,
    to_device,
    token_slots,
    used_blocks,
)
from helexa.kernels.paged_kv import PagedKV


@dataclass
class TorchMetadata(StepMeta):
    """The torch backend's plan of a step: decode rows by length group, a chunk per prefill."""

    backend: TorchBackend
    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    num_decode: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # with a quantised-KV decode kernel (TorchBackend.quant_decode): every decode row's
    # pages [B, blocks] and context [B], int32 on the device; the longest; the block size
    decode_rows: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchBackend(AttentionBackend):
    name = "torch"
    # A kernel for quantised pools' decode rows, (q, kv, table, lens, longest, block_size)
    # -> out, set by the backend that composes this one (cuda: kernels/cuda/quant_decode.py)
    quant_decode: Callable[..., torch.Tensor] | None = None
    # and one writing their new K and V, (kv, slot_mapping, k, v) (kernels/cuda/quant_write.py)
    quant_write: Callable[..., None] | None = None
    # and one for a prefill chunk over cached context, (q, kv, chunk) -> out
    quant_prefill: Callable[..., torch.Tensor] | None = None

    def allocate_kv(self, layers: list[AttentionSpec], num_blocks: int, block_size: int, *,
                    storage: torch.dtype | None, compute: torch.dtype) -> list[PagedKV]:
        self.pools = []  # free the old pools before allocating the new ones
        self.pools = [PagedKV(num_blocks, block_size, s.kv_heads, s.head_dim,
                              kv_dtype=s.kv_dtype, storage=storage, compute=compute,
                              device=self.device) for s in layers]
        return self.pools

    def plan(self, step: StepPlan) -> TorchMetadata:
        meta = TorchMetadata(backend=self, slot_mapping=step.slot_mapping,
                             num_decode=step.num_decode)
        if step.num_decode and self.quant_decode is not None and self.pools[0].quantized:
            meta.decode_rows = self.decode_rows(step)
        elif step.num_decode:
            meta.decode_groups = self.decode_groups(step)
        meta.prefills = [self.prefill_chunk(r.start, r.end, r.num_computed, r.block_table,
                                            step.block_size) for r in step.prefills]
        return meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchMetadata) -> torch.Tensor:
        kv = self.pools[layer]
        if self.quant_write is not None and kv.quantized:
            self.quant_write(kv, meta.slot_mapping, k, v)
        else:
            kv.write(meta.slot_mapping, k, v)
        groups, rows, kernel = meta.decode_groups, meta.decode_rows, self.quant_decode
        ahead = self.quant_prefill
        prefill = (None if ahead is None or not kv.quantized else
                   lambda q, chunk: ahead(q, kv, chunk))
        if rows is not None and kernel is not None:
            return paged_attention(q, k, v, kv, meta.num_decode,
                                   lambda q, k, v: kernel(q, kv, *rows), meta.prefills, prefill)
        return paged_attention(q, k, v, kv, meta.num_decode,
                               lambda q, k, v: grouped_decode(q, kv, groups), meta.prefills,
                               prefill)

    # ---- step plans ----------------------------------------------------------------------

    def decode_groups(self, step: StepPlan) -> list[DecodeGroup]:
        """Decode rows grouped so that no row is padded past twice its own length: longest
        first, a group takes rows while they are at least half its longest."""
        bs, dev = step.block_size, self.device
        lens = [p + 1 for p in step.decode_positions]
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and 2 * lens[i] >= lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        out = []
        for rows in groups:
            t = lens[rows[0]]
            nblk = -(-t // bs)
            tables = [used_blocks(step.decode_tables[i], lens[i], bs, step.num_blocks)
                      for i in rows]
            # lists reach a GPU from pinned memory, not waiting (a copy from pageable
            # memory waits for the device: one a layer a step on the quantised-KV path)
            grp = DecodeGroup(
                rows=None if len(groups) == 1 and rows == sorted(rows) else
                to_device(rows, torch.long, dev),
                lengths=to_device([lens[i] for i in rows], torch.long, dev), max_len=t,
                min_len=min(lens[i] for i in rows))
            if len(rows) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + nblk)):
                grp.start = tables[0][0] * bs  # a reservation drawn in order: no gather
            else:
                table = torch.tensor([tab + [0] * (nblk - len(tab)) for tab in tables],
                                     dtype=torch.long)
                ar = torch.arange(t)
                grp.slots = host_to_device(table[:, ar // bs] * bs + ar % bs, dev)
            out.append(grp)
        return out

    def decode_rows(self, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Every decode row's used pages (padded with page 0) and context length, int32 on
        the device in one copy, for the quantised-KV decode kernel; the longest; block size."""
        bs = step.block_size
        lens = [p + 1 for p in step.decode_positions]
        tables = [used_blocks(t, n, bs, step.num_blocks)
                  for t, n in zip(step.decode_tables, lens, strict=True)]
        width = max(len(t) for t in tables)
        flat = [page for t in tables for page in t + [0] * (width - len(t))]
        got = to_device(flat + lens, torch.int32, self.device)
        return got[:len(flat)].view(len(lens), width), got[len(flat):], max(lens), bs

    def prefill_chunk(self, start: int, end: int, num_computed: int, table: list[int],
                      block_size: int) -> PrefillChunk:
        """A chunk over cached context reads it as a view when its blocks are consecutive,
        else by gather indices; with a causal mask over context + chunk where SDPA reads it."""
        chunk = PrefillChunk(start=start, end=end)
        c, n, bs = num_computed, end - start, block_size
        if c == 0:
            return chunk
        blocks = table[: (c + n - 1) // bs + 1]
        chunk.context_len = c + n
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            chunk.context_start = blocks[0] * bs
        else:
            chunk.context_slots = to_device(token_slots(table, 0, c + n, bs), torch.long,
                                            self.device)
        # no [n, T] mask over a long context (keys a chunk at a time) or for the quantised
        # prefill kernel (it masks each row as it goes)
        kernel = self.quant_prefill is not None and self.pools[0].quantized
        if c + n <= DECODE_CHUNK_TOKENS and not kernel:
            ctx = torch.arange(c + n, device=self.device)
            chunk.mask = ctx[None, :] <= ctx[c:, None]
        return chunk

