"""The ``torch`` attention backend: plain torch and SDPA on any device, no native code.

It is the reference the ``cpu`` and ``cuda`` backends are tested against, and
the path for whatever they do not cover. Its temporaries are bounded: decode
rows run in length groups (kernels.attention.DecodeGroup), long contexts a
chunk at a time, so one 32k-token row beside short ones costs a chunk, not
the batch padded to 32k.
"""

from __future__ import annotations

from typing import Any

import torch

from helexa.kernels.attention import (
    DECODE_CHUNK_TOKENS,
    AttentionMetadata,
    DecodeGroup,
    PagedKV,
    PrefillChunk,
    paged_attention,
)
from helexa.kernels.backends.base import AttentionBackend, StepPlan


class TorchBackend(AttentionBackend):
    name = "torch"

    def allocate_kv(self, layers: list[tuple[int, int]], num_blocks: int, block_size: int, *,
                    kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype
                    ) -> list[PagedKV]:
        self.pools = []  # free the old pools before allocating the new ones
        self.pools = [PagedKV(num_blocks, block_size, kvh, d, kv_dtype=kv_dtype, storage=storage,
                              compute=compute, device=self.device) for kvh, d in layers]
        return self.pools

    def plan(self, step: StepPlan) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=step.slot_mapping, backend=self,
                                 num_decode=step.num_decode)
        if step.num_decode:
            meta.decode_len = max(step.decode_positions) + 1
            meta.decode_groups = self.decode_groups(step)
        meta.prefills = [self.prefill_chunk(r.start, r.end, r.num_computed, r.block_table,
                                            step.block_size) for r in step.prefills]
        return meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        kv = self.pools[layer]
        kv.write(meta.slot_mapping, k, v)
        return paged_attention(q, k, v, kv, meta)

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
            tables = [_used_blocks(step.decode_tables[i], lens[i], bs, step.num_blocks)
                      for i in rows]
            grp = DecodeGroup(
                rows=None if len(groups) == 1 and rows == sorted(rows) else
                torch.tensor(rows, device=dev),
                lengths=torch.tensor([lens[i] for i in rows], device=dev), max_len=t)
            if len(rows) == 1 and tables[0] == list(range(tables[0][0], tables[0][0] + nblk)):
                grp.start = tables[0][0] * bs  # a reservation drawn in order: no gather
            else:
                table = torch.tensor([tab + [0] * (nblk - len(tab)) for tab in tables],
                                     dtype=torch.long)
                ar = torch.arange(t)
                grp.slots = (table[:, ar // bs] * bs + ar % bs).to(dev)
            out.append(grp)
        return out

    def prefill_chunk(self, start: int, end: int, num_computed: int, table: list[int],
                      block_size: int) -> PrefillChunk:
        """A chunk over cached context reads it as a view when its blocks are consecutive,
        else by gather indices; with a causal mask over context + chunk."""
        chunk = PrefillChunk(start=start, end=end)
        c, n, bs = num_computed, end - start, block_size
        if c == 0:
            return chunk
        blocks = table[: (c + n - 1) // bs + 1]
        chunk.context_len = c + n
        if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
            chunk.context_start = blocks[0] * bs
        else:
            chunk.context_slots = torch.tensor(token_slots(table, 0, c + n, bs),
                                               device=self.device)
        if c + n <= DECODE_CHUNK_TOKENS:  # else no [n, T] mask: keys a chunk at a time
            ctx = torch.arange(c + n, device=self.device)
            chunk.mask = ctx[None, :] <= ctx[c:, None]
        return chunk


def _used_blocks(table: list[int], length: int, block_size: int, num_blocks: int) -> list[int]:
    used = -(-length // block_size)
    if len(table) < used:
        raise ValueError(f"block table of {len(table)} blocks × {block_size} cannot hold "
                         f"{length} tokens")
    return table[:used]


def token_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence, a block run at a time."""
    out: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = table[block] * block_size + offset
        out.extend(range(base, base + take))
        pos += take
    return out
