"""Paged attention over a block-structured KV cache, with a plain-torch reference.

Cache layout, per layer: K and V tensors seen as [num_blocks, block_size, kv_heads, head_dim],
stored head-major (each kv head's slots contiguous: a head's run of slots is one
contiguous [T, head_dim] matrix, what SDPA reads fastest). Token ``t`` of a
sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``
of the flattened [num_slots, kv_heads, head_dim] view.

A step's batch is laid out decode rows first (one new token each), then
prefill chunks. Everything that depends only on the step (slot mappings,
gather indices, masks) is built once per step in :class:`AttentionMetadata`
by an attention backend (helexa/kernels/backends/); the per-layer functions here only
index and call SDPA.

Temporaries stay bounded whatever the batch: decode rows run in groups of
similar length (:class:`DecodeGroup`), never padded to the batch's longest
row, and a group whose context exceeds ``DECODE_CHUNK_TOKENS`` row-tokens is
read a chunk of blocks at a time (quantised KV dequantised chunk by chunk),
its softmax merged across chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from helexa.kernels import kv_quant


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk in the flat batch: tokens [start, end)."""

    start: int
    end: int
    # Slots of the whole context (cached + this chunk), or None when there is no
    # cached context: the chunk then attends to its own fresh K/V, causally.
    context_slots: torch.Tensor | None = None
    # Or, when the context's blocks are consecutive, its slots [context_start, +context_len).
    context_start: int | None = None
    context_len: int = 0  # T: cached tokens + this chunk's
    # [n, T] bool, True = may attend; None over a long context (> DECODE_CHUNK_TOKENS): then
    # the context is read a chunk of keys at a time, the causal mask made per chunk.
    mask: torch.Tensor | None = None


@dataclass
class DecodeMirror:
    """CPU batched decode: each layer keeps its decode rows' context as [kv_heads, B, cap, d]
    K and V (PagedKV.mirror) from step to step while the rows stay the same, so a step
    appends its new token instead of gathering every row's whole context again."""

    fill: bool  # the rows changed: gather decode_slots (B * cap, rows padded) into the mirror
    write_index: torch.Tensor  # [B] row * cap + position: where each row's new K/V go


# Row-tokens (rows x context) of K and V a decode group reads at once: 2 * this * kv_heads *
# head_dim elements of temporaries at most, however long the rows.
DECODE_CHUNK_TOKENS = 8192
# A prefill chunk over a long context: fp32 scores (queries x heads x keys) per key chunk.
PREFILL_SCORE_ELEMS = 4 * 2**20


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended together (padded to the group's
    longest row only)."""

    rows: torch.Tensor | None  # indices among the step's decode rows; None = all, in order
    lengths: torch.Tensor  # [b] int64: context length of each row (its new token included)
    max_len: int
    slots: torch.Tensor | None = None  # [b, max_len] int64, padded with slot 0 (masked)
    start: int | None = None  # one row over consecutive slots [start, start + max_len): views


@dataclass
class AttentionMetadata:
    """Per-step attention plan shared by all layers."""

    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    backend: Any = None  # the AttentionBackend that built this (helexa/kernels/backends/base.py)
    # Decode rows by length group (the torch backend); None: the single padded group below.
    decode_groups: list[DecodeGroup] | None = None
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [B * T] int64, rows padded to T
    decode_len: int = 0  # T
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when no padding
    # One decode row whose blocks are consecutive: its context is slots
    # [decode_start, decode_start + T), read as a view instead of gathered.
    decode_start: int | None = None
    # CPU: preallocated K and V buffers of B * T * kv_heads * head_dim elements (any shape) the
    # gather fills, shared by every layer (a fresh 1-2 MB tensor per layer page-faults: ~6x the
    # gather itself).
    decode_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_mirror: DecodeMirror | None = None
    # Native CPU decode (helexa/kernels/cpu/native.c): the rows' block tables [B, blocks] int64,
    # zero-padded; set only for pure-decode steps the native kernels run.
    decode_tables: torch.Tensor | None = None
    # CPU: the mirror state to keep once this step has run (helexa/kernels/backends/cpu.py).
    next_mirror: Any = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class PagedKV:
    """One layer's K and V pool, addressed by flat slot.

    Plain kv dtypes keep K and V head-major ([kv_heads, num_slots, head_dim] storage),
    seen as [num_blocks, block_size, kv_heads, head_dim] (``k_cache`` / ``v_cache``),
    flat [num_slots, kv_heads, head_dim] (``k_slots`` / ``v_slots``) and
    [1, kv_heads, num_slots, head_dim] (``k_heads`` / ``v_heads``) views. Quantised ones (fp8_e4m3, int8, int4) keep
    kernels.kv_quant's data + per-token-head scales, quantised on write and
    dequantised to the compute dtype on gather.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype,
                 device: torch.device | str) -> None:
        self.kv_dtype, self.head_dim, self.compute = kv_dtype, head_dim, compute
        self.num_kv_heads = kv_heads
        self.quantized = kv_quant.is_quantized(kv_dtype)
        if self.quantized:
            spec = kv_quant.quant_spec(kv_dtype, head_dim)
            self.k_data, self.k_scale = kv_quant.allocate(spec, num_blocks, block_size, kv_heads,
                                                          device)
            self.v_data, self.v_scale = kv_quant.allocate(spec, num_blocks, block_size, kv_heads,
                                                          device)
            self.k_cache, self.v_cache = self.k_data, self.v_data
            self.nbytes = 2 * (self.k_data.nbytes + self.k_scale.nbytes)
        else:
            shape = (1, kv_heads, num_blocks * block_size, head_dim)
            # Zeroed, so padded gather rows (masked out) never hold NaN/inf.
            # [1, kv_heads, num_slots, head_dim]: a run of slots is one narrow away from the
            # layout SDPA takes, contiguous per head.
            self.k_heads = torch.zeros(shape, dtype=storage, device=device)
            self.v_heads = torch.zeros(shape, dtype=storage, device=device)
            self.k_slots = self.k_heads[0].transpose(0, 1)  # [num_slots, kv_heads, head_dim]
            self.v_slots = self.v_heads[0].transpose(0, 1)
            self.k_cache = self.k_slots.unflatten(0, (num_blocks, block_size))
            self.v_cache = self.v_slots.unflatten(0, (num_blocks, block_size))
            self.nbytes = 2 * self.k_heads.nbytes
        self.mirror: tuple[torch.Tensor, torch.Tensor] | None = None  # see DecodeMirror

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' k, v [N, kv_heads, head_dim] at their slots."""
        if self.quantized:
            kv_quant.write_quantized(self.k_data, self.k_scale, slot_mapping, k, self.kv_dtype)
            kv_quant.write_quantized(self.v_data, self.v_scale, slot_mapping, v, self.kv_dtype)
        else:
            write_kv(self.k_slots, self.v_slots, slot_mapping, k, v)

    def span(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [start, start + length): views when plain (no copy)."""
        if self.quantized:
            return self.gather(torch.arange(start, start + length, device=self.k_data.device))
        k = self.k_slots.narrow(0, start, length)
        v = self.v_slots.narrow(0, start, length)
        if k.dtype != self.compute:
            k, v = k.to(self.compute), v.to(self.compute)
        return k, v

    def span_heads(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As span, shaped [1, kv_heads, length, head_dim] for SDPA."""
        if self.quantized or self.k_cache.dtype != self.compute:
            k, v = self.span(start, length)
            return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        return self.k_heads.narrow(2, start, length), self.v_heads.narrow(2, start, length)

    def gather_heads(self, slots: torch.Tensor,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given slots head-major: [kv_heads, len(slots), head_dim] in the compute
        dtype, into ``out`` (buffers of at least that many elements) when given."""
        if self.quantized or self.k_heads.dtype != self.compute:
            k, v = self.gather(slots)
            return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        if out is None:
            return self.k_heads[0].index_select(1, slots), self.v_heads[0].index_select(1, slots)
        n = self.k_heads.shape[1] * slots.numel() * self.head_dim
        k = out[0].view(-1)[:n].view(self.k_heads.shape[1], slots.numel(), self.head_dim)
        v = out[1].view(-1)[:n].view(k.shape)
        torch.index_select(self.k_heads[0], 1, slots, out=k)
        torch.index_select(self.v_heads[0], 1, slots, out=v)
        return k, v

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given slots: [len(slots), kv_heads, head_dim] in the compute dtype."""
        if self.quantized:
            return (kv_quant.gather_dequantized(self.k_data, self.k_scale, slots, self.kv_dtype,
                                                self.head_dim, self.compute),
                    kv_quant.gather_dequantized(self.v_data, self.v_scale, slots, self.kv_dtype,
                                                self.head_dim, self.compute))
        k, v = self.k_slots.index_select(0, slots), self.v_slots.index_select(0, slots)
        if k.dtype != self.compute:
            k, v = k.to(self.compute), v.to(self.compute)
        return k, v


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' k, v [N, kv_heads, head_dim] at their slots.

    k_slots / v_slots are a layer's caches viewed flat: [num_slots, kv_heads, head_dim].
    """
    if k.dtype != k_slots.dtype:
        k, v = k.to(k_slots.dtype), v.to(v_slots.dtype)
    k_slots.index_copy_(0, slot_mapping, k)
    v_slots.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Attention for a step whose new K/V are already written to the pool ``kv``.

    q [N, heads, d]; k, v [N, kv_heads, d] (this step's, used directly by
    prefill chunks with no cached context). Returns [N, heads, d].
    """
    n_tok, heads, d = q.shape
    kvh = k.shape[1]
    if meta.num_decode == n_tok and not meta.prefills:
        return decode_attention(q, kv, meta, k, v)
    out = torch.empty_like(q)
    if meta.num_decode:
        nd = meta.num_decode
        out[:nd] = decode_attention(q[:nd], kv, meta, k[:nd], v[:nd])
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if chunk.context_slots is None and chunk.context_start is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True,
                                               enable_gqa=heads != kvh)
        elif chunk.mask is None:  # a long context: a chunk of keys at a time
            out[chunk.start : chunk.end] = _prefill_long(q[chunk.start : chunk.end], kv, chunk)
            continue
        else:
            kc, vc = (kv.gather(chunk.context_slots) if chunk.context_start is None
                      else kv.span(chunk.context_start, chunk.context_len))  # [T, kvh, d]
            o = F.scaled_dot_product_attention(qc, kc.transpose(0, 1).unsqueeze(0),
                                               vc.transpose(0, 1).unsqueeze(0),
                                               attn_mask=chunk.mask, enable_gqa=heads != kvh)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, kv: PagedKV, meta: AttentionMetadata,
                     k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """One query per row over its gathered context: q [B, heads, d] -> [B, heads, d].

    The GQA group is folded into the query-length axis ([B, kv_heads, group, d])
    so no K/V head is ever repeated. Several rows gather head-major and run as SDPA's
    batch = kv head, heads = rows: each (kv head, row) reads one contiguous [T, d].
    With a DecodeMirror the rows' context is kept per layer across steps: this step's
    k, v [B, kv_heads, d] are appended to it instead.
    """
    if meta.decode_groups is not None:
        if len(meta.decode_groups) == 1 and meta.decode_groups[0].rows is None:
            return _decode_group(q, kv, meta.decode_groups[0])
        out = torch.empty_like(q)
        for grp in meta.decode_groups:
            out.index_copy_(0, grp.rows, _decode_group(q.index_select(0, grp.rows), kv, grp))
        return out
    b, heads, d = q.shape
    t = meta.decode_len
    if meta.decode_start is not None:  # one row, consecutive blocks: views, no copy
        kc, vc = kv.span_heads(meta.decode_start, t)  # [1, kvh, T, d]
        kvh = kc.shape[1]
        o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), kc, vc,
                                           attn_mask=meta.decode_mask)
        return o.view(b, heads, d)
    mirror = meta.decode_mirror
    if mirror is not None and kv.mirror is not None:
        mk, mv = kv.mirror  # [kvh, B, cap, d]
        kvh = mk.shape[0]
        flat_k, flat_v = mk.view(kvh, -1, d), mv.view(kvh, -1, d)
        if mirror.fill:
            torch.index_select(kv.k_heads[0], 1, meta.decode_slots, out=flat_k)
            torch.index_select(kv.v_heads[0], 1, meta.decode_slots, out=flat_v)
        else:
            flat_k.index_copy_(1, mirror.write_index, k.transpose(0, 1))
            flat_v.index_copy_(1, mirror.write_index, v.transpose(0, 1))
        kc, vc = mk.narrow(2, 0, t), mv.narrow(2, 0, t)
    else:
        kc, vc = kv.gather_heads(meta.decode_slots, meta.decode_buffers)  # [kvh, B*T, d]
        kvh = kc.shape[0]
        kc, vc = kc.view(kvh, b, t, d), vc.view(kvh, b, t, d)
    mask = meta.decode_mask
    if mask is not None:  # [B, 1, 1, T] -> rows on the heads axis
        mask = mask.view(1, b, 1, t)
    o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d).transpose(0, 1),
                                       kc, vc, attn_mask=mask)  # [kvh, B, group, d]
    return o.transpose(0, 1).reshape(b, heads, d)


def _prefill_long(q: torch.Tensor, kv: PagedKV, chunk: PrefillChunk) -> torch.Tensor:
    """A prefill chunk's queries q [n, heads, d] over its whole context (cached + its own,
    already in the pool), causally, reading PREFILL_SCORE_ELEMS worth of keys at a time
    (dequantised per key chunk) with the softmax merged across chunks: [n, heads, d]."""
    n, heads, d = q.shape
    kvh, t = kv.num_kv_heads, chunk.context_len
    g = heads // kvh
    qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).float() * (1.0 / math.sqrt(d))  # [kvh,g,n,d]
    qpos = torch.arange(t - n, t, device=q.device)
    step = max(1, PREFILL_SCORE_ELEMS // (heads * n))
    m = torch.full((kvh, g, n, 1), -math.inf, device=q.device)
    den = torch.zeros_like(m)
    acc = torch.zeros(kvh, g, n, d, device=q.device)
    for k0 in range(0, t, step):
        k1 = min(t, k0 + step)
        kc, vc = (kv.gather(chunk.context_slots[k0:k1]) if chunk.context_slots is not None
                  else kv.span(chunk.context_start + k0, k1 - k0))  # [L, kvh, d]
        kc = kc.permute(1, 0, 2).unsqueeze(1).float()  # [kvh, 1, L, d]
        vc = vc.permute(1, 0, 2).unsqueeze(1).float()
        s = qf @ kc.transpose(-1, -2)  # [kvh, g, n, L]
        s.masked_fill_(torch.arange(k0, k1, device=q.device)[None, :] > qpos[:, None],
                       -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = (s - m_new).exp_()
        corr = (m - m_new).exp_()
        den.mul_(corr).add_(p.sum(-1, keepdim=True))
        acc.mul_(corr).add_(p @ vc)
        m = m_new
    return (acc / den).to(q.dtype).permute(2, 0, 1, 3).reshape(n, heads, d)


def _decode_group(q: torch.Tensor, kv: PagedKV, grp: DecodeGroup) -> torch.Tensor:
    """One length group's decode rows: q [b, heads, d] -> [b, heads, d]. Rows on SDPA's
    heads axis and kv heads on its batch axis, as decode_attention; a long group in chunks."""
    b, heads, d = q.shape
    t = grp.max_len
    if grp.start is not None and not kv.quantized and kv.k_heads.dtype == kv.compute:
        kc, vc = kv.span_heads(grp.start, t)  # [1, kvh, T, d]: views, no copy
        kvh = kc.shape[1]
        o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), kc, vc)
        return o.view(b, heads, d)
    slots = grp.slots
    if slots is None:  # one row over consecutive slots, read through gathers
        slots = torch.arange(grp.start, grp.start + t, device=q.device).view(1, t)
    kvh = kv.num_kv_heads
    qh = q.view(b, kvh, heads // kvh, d).transpose(0, 1)  # [kvh, b, group, d]
    chunk = max(1, DECODE_CHUNK_TOKENS // b)
    if t <= chunk:
        kc, vc = kv.gather_heads(slots.reshape(-1))  # [kvh, b * T, d]
        mask = None
        if b > 1 and int(grp.lengths.min()) != t:
            ar = torch.arange(t, device=q.device)
            mask = (ar[None, :] < grp.lengths[:, None]).view(1, b, 1, t)
        o = F.scaled_dot_product_attention(qh, kc.view(kvh, b, t, d), vc.view(kvh, b, t, d),
                                           attn_mask=mask)
        return o.transpose(0, 1).reshape(b, heads, d)
    # Flash-decoding in torch: a chunk of every row's context at a time, softmax merged.
    qf = qh.float() * (1.0 / math.sqrt(d))
    m = torch.full((kvh, b, heads // kvh, 1), -math.inf, device=q.device)
    den = torch.zeros_like(m)
    acc = torch.zeros(kvh, b, heads // kvh, d, device=q.device)
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        kc, vc = kv.gather_heads(slots[:, c0:c1].reshape(-1))
        kc, vc = kc.view(kvh, b, c1 - c0, d).float(), vc.view(kvh, b, c1 - c0, d).float()
        s = qf @ kc.transpose(-1, -2)  # [kvh, b, group, c]
        valid = torch.arange(c0, c1, device=q.device)[None, :] < grp.lengths[:, None]
        s.masked_fill_(~valid.view(1, b, 1, c1 - c0), -math.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = (s - m_new).exp_()
        corr = (m - m_new).exp_()
        den.mul_(corr).add_(p.sum(-1, keepdim=True))
        acc.mul_(corr).add_(p @ vc)
        m = m_new
    return (acc / den).to(q.dtype).transpose(0, 1).reshape(b, heads, d)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """Slow, obviously-correct attention, token by token, head by head.

    ``seqs`` lists (num_computed, num_new, block_table) in batch order; q holds
    the new tokens' queries [N, heads, d] in that order; the caches
    [num_blocks, block_size, kv_heads, d] already hold every token of each
    sequence up to num_computed + num_new.
    """
    heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[-2]
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q, dtype=torch.float32)
    row = 0
    for num_computed, num_new, table in seqs:
        for i in range(num_new):
            pos = num_computed + i
            slots = [table[t // block_size] * block_size + t % block_size for t in range(pos + 1)]
            keys = k_cache.view(-1, kvh, d)[slots].float()  # [T, kvh, d]
            vals = v_cache.view(-1, kvh, d)[slots].float()
            for h in range(heads):
                kv = h // (heads // kvh)
                scores = keys[:, kv, :] @ q[row, h].float() / math.sqrt(d)
                out[row, h] = torch.softmax(scores, dim=0) @ vals[:, kv, :]
            row += 1
    return out.to(q.dtype)
