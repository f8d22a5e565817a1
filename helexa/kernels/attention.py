"""Paged attention in plain torch and SDPA: the ``torch`` backend's kernels, which every
other backend is tested against, and a slower token-by-token reference they are all
checked with.

A step's batch is laid out decode rows first (one new token each), then prefill chunks
(helexa/kernels/backends/base.py StepPlan). A backend builds, once per step, what these
functions read: decode rows in groups of similar length (:class:`DecodeGroup`), never
padded to the batch's longest row, and a :class:`PrefillChunk` per sequence; the per-layer
functions here only index and call SDPA. Storage is helexa/kernels/paged_kv.py's.

Temporaries stay bounded whatever the batch: a group whose context exceeds
``DECODE_CHUNK_TOKENS`` row-tokens is read a chunk of blocks at a time (quantised KV
dequantised chunk by chunk), its softmax merged across chunks; so is a prefill chunk over
a long context.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helexa.kernels.paged_kv import PagedKV

# decode(q, k, v) of a step's decode rows -> their attention output [B, heads, d]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    min_len: int | None = None  # the shortest row's length on the host (None: read it)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
                    num_decode: int, decode: DecodeFn, prefills: list[PrefillChunk],
                    prefill: Callable[[torch.Tensor, PrefillChunk], torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """Attention for a step whose new K/V are already written to the pool ``kv``: the
    first ``num_decode`` rows through ``decode`` (a backend's decode path), then each
    prefill chunk causally over its cached context and itself (one over cached context
    through ``prefill`` where given: a backend's kernel, (q of the chunk, chunk) -> out).

    q [N, heads, d]; k, v [N, kv_heads, d] (this step's, used directly by
    prefill chunks with no cached context). Returns [N, heads, d].
    """
    n_tok, heads, _ = q.shape
    if num_decode == n_tok and not prefills:
        return decode(q, k, v)
    out = torch.empty_like(q)
    if num_decode:
        nd = num_decode
        out[:nd] = decode(q[:nd], k[:nd], v[:nd])
    kvh = k.shape[1]
    for chunk in prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if chunk.context_slots is None and chunk.context_start is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True,
                                               enable_gqa=heads != kvh)
        elif prefill is not None:
            out[chunk.start : chunk.end] = prefill(q[chunk.start : chunk.end], chunk)
            continue
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


def grouped_decode(q: torch.Tensor, kv: PagedKV, groups: list[DecodeGroup]) -> torch.Tensor:
    """One query per decode row over its context, a length group at a time:
    q [B, heads, d] -> [B, heads, d].

    The GQA group is folded into the query-length axis ([B, kv_heads, group, d])
    so no K/V head is ever repeated. Several rows gather head-major and run as SDPA's
    batch = kv head, heads = rows: each (kv head, row) reads one contiguous [T, d].
    """
    if len(groups) == 1 and groups[0].rows is None:
        return _decode_group(q, kv, groups[0])
    out = torch.empty_like(q)
    for grp in groups:
        assert grp.rows is not None  # several groups: each names its rows
        out.index_copy_(0, grp.rows, _decode_group(q.index_select(0, grp.rows), kv, grp))
    return out


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
        shortest = grp.min_len if grp.min_len is not None else int(grp.lengths.min())
        if b > 1 and shortest != t:  # the planner's host figure: no read of the device
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
