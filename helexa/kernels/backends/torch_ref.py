"""The ``torch`` attention backend: plain torch and SDPA on any device, no native code.

It is the reference the ``cpu`` and ``cuda`` backends are tested against, and the path
for whatever they do not cover (they compose it: base.py). Its temporaries are bounded:
decode rows run in length groups (kernels.attention.DecodeGroup), long contexts a chunk
at a time, so one 32k-token row beside short ones costs a chunk, not the batch padded to
32k.

A quantised pool whose writes and decode rows run kernels (set by the cuda backend:
kernels/cuda/quant_decode.py) plans a pure-decode step of b rows into fixed buffers
(``static_meta``: the new tokens' slots, every row's pages and context, and a split count
for the most a row can hold), so that a CUDA graph captured over them replays any such step
(backends/cuda_graphs.py); every other step is planned afresh and runs eagerly.
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
    # pages [B, blocks] and context [B], int32 on the device; the longest (a graph's: the
    # most a row can hold); the block size; whether each row is split on the device
    decode_rows: tuple[torch.Tensor, torch.Tensor, int, int, bool] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    graph_rows: int = 0  # b: planned into the fixed buffers a b-row graph reads


class TorchBackend(AttentionBackend):
    name = "torch"
    # A kernel for quantised pools' decode rows, (q, kv, table, lens, longest, block_size)
    # -> out, set by the backend that composes this one (cuda: kernels/cuda/quant_decode.py)
    quant_decode: Callable[..., torch.Tensor] | None = None
    # and one writing their new K and V, (kv, slot_mapping, k, v) (kernels/cuda/quant_write.py)
    quant_write: Callable[..., None] | None = None
    # and one for a prefill chunk over cached context, (q, kv, chunk) -> out
    quant_prefill: Callable[..., torch.Tensor] | None = None
    # A kernel for every prefill chunk over cached context, whatever the pool, (q, kv,
    # chunk) -> out, set by the backend that composes this one (cpu: kernels/cpu/prefill.py)
    context_prefill: Callable[..., torch.Tensor] | None = None
    reach = 0  # the positions a row can hold where graphs are captured (0: the pool's)

    def __init__(self, device: torch.device, graph_rows: int = 0) -> None:
        super().__init__(device)
        # pure-decode steps of up to this many rows are planned for CUDA graphs, where a
        # quantised pool's kernels serve (graph_ready; the cuda backend composes this one)
        self.graph_rows = graph_rows
        self._static: dict[int, TorchMetadata] = {}
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def allocate_kv(self, layers: list[AttentionSpec], num_blocks: int, block_size: int, *,
                    storage: torch.dtype | None, compute: torch.dtype) -> list[PagedKV]:
        self.pools = []  # free the old pools before allocating the new ones
        self._geometry = (num_blocks, block_size)
        self._static, self._buffers = {}, None  # sized for the old pool
        self.pools = [PagedKV(num_blocks, block_size, s.kv_heads, s.head_dim,
                              kv_dtype=s.kv_dtype, storage=storage, compute=compute,
                              device=self.device) for s in layers]
        return self.pools

    def graph_ready(self) -> bool:
        """A pure-decode step reads no figure of its own on the host: a quantised pool
        whose writes and decode rows run kernels (a captured graph can replay it)."""
        return (bool(self.pools) and self.pools[0].quantized and self.quant_write is not None
                and self.quant_decode is not None)

    def plan(self, step: StepPlan) -> TorchMetadata:
        """The step's metadata; a pure-decode step of up to ``graph_rows`` rows into the
        fixed buffers of its size (static_meta) where graph_ready."""
        if 0 < step.num_decode <= self.graph_rows and not step.prefills and self.graph_ready():
            meta = self.static_meta(step.num_decode)
            assert meta.decode_rows is not None
            table, lens = meta.decode_rows[:2]
            rows, got, _, _, _ = self.decode_rows(step)
            if rows.shape[1] > table.shape[1]:  # the rotary table stops a row before this
                raise ValueError(f"a decode row spans {rows.shape[1]} pages, past the "
                                 f"{table.shape[1]} a captured graph's table holds")
            table[:, :rows.shape[1]].copy_(rows)  # a row's pages past its context: unread
            lens.copy_(got)
            meta.slot_mapping.copy_(step.slot_mapping)
            return meta
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
        ahead = self.quant_prefill if kv.quantized else None
        ahead = ahead or self.context_prefill
        prefill = None if ahead is None else lambda q, chunk: ahead(q, kv, chunk)
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

    def static_meta(self, b: int) -> TorchMetadata:
        """The fixed buffers a captured b-row decode step reads, which ``plan`` fills for
        each such step: the new tokens' slots, each row's pages (as many as the most a row
        can hold: ``reach``, or the pool's tokens) and context, and that most, from which
        the decode kernel's split count follows (each row split on the device). Every size
        reads the first b rows of one set of graph_rows rows (a step fills them on the
        stream, after the replays before it read them)."""
        meta = self._static.get(b)
        if meta is None:
            (blocks, bs), dev, n = self._geometry, self.device, max(b, self.graph_rows)
            most = min(blocks * bs, self.reach or blocks * bs)
            if self._buffers is None:
                self._buffers = (torch.zeros(n, -(-most // bs), dtype=torch.int32, device=dev),
                                 torch.ones(n, dtype=torch.int32, device=dev),
                                 torch.zeros(n, dtype=torch.long, device=dev))
            table, lens, slots = self._buffers
            meta = self._static[b] = TorchMetadata(
                backend=self, slot_mapping=slots[:b], num_decode=b,
                decode_rows=(table[:b], lens[:b], most, bs, True), graph_rows=b)
        return meta

    def decode_rows(self, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
        """Every decode row's used pages (padded with page 0) and context length, int32 on
        the device in one copy, for the quantised-KV decode kernel; the longest; block size;
        False (the split from the longest row, a host figure)."""
        bs = step.block_size
        lens = [p + 1 for p in step.decode_positions]
        tables = [used_blocks(t, n, bs, step.num_blocks)
                  for t, n in zip(step.decode_tables, lens, strict=True)]
        width = max(len(t) for t in tables)
        flat = [page for t in tables for page in t + [0] * (width - len(t))]
        if any(not 0 <= p < step.num_blocks for p in flat):  # a kernel would read past it
            raise ValueError(f"block table holds a block outside the pool of "
                             f"{step.num_blocks} blocks")
        got = to_device(flat + lens, torch.int32, self.device)
        return got[:len(flat)].view(len(lens), width), got[len(flat):], max(lens), bs, False

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
        # no [n, T] mask over a long context (keys a chunk at a time) or for a prefill
        # kernel (the quantised one masks each row as it goes; context_prefill needs none)
        kernel = ((self.quant_prefill is not None and self.pools[0].quantized)
                  or self.context_prefill is not None)
        if c + n <= DECODE_CHUNK_TOKENS and not kernel:
            ctx = torch.arange(c + n, device=self.device)
            chunk.mask = ctx[None, :] <= ctx[c:, None]
        return chunk

