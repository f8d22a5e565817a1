"""Paged attention over a block-structured KV cache, with a plain-torch reference.

Cache layout, per layer: K and V tensors [num_blocks, block_size, kv_heads, head_dim].
Token ``t`` of a sequence lives in slot ``block_table[t // block_size] *
block_size + t % block_size`` of the flattened [num_slots, kv_heads, head_dim] view.

A step's batch is laid out decode rows first (one new token each), then
prefill chunks. Everything that depends only on the step (slot mappings,
gather indices, masks) is built once per step in :class:`AttentionMetadata`
by the model runner; the per-layer functions here only index and call SDPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk in the flat batch: tokens [start, end)."""

    start: int
    end: int
    # Slots of the whole context (cached + this chunk), or None when there is no
    # cached context: the chunk then attends to its own fresh K/V, causally.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [n, T] bool, True = may attend


@dataclass
class AttentionMetadata:
    """Per-step attention plan shared by all layers."""

    slot_mapping: torch.Tensor  # [N] int64: where each new token's K/V is written
    num_decode: int = 0
    decode_slots: torch.Tensor | None = None  # [B * T] int64, rows padded to T
    decode_len: int = 0  # T
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when no padding
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' k, v [N, kv_heads, head_dim] at their slots.

    k_slots / v_slots are a layer's caches viewed flat: [num_slots, kv_heads, head_dim].
    """
    if k.dtype != k_slots.dtype:
        k, v = k.to(k_slots.dtype), v.to(v_slots.dtype)
    k_slots.index_copy_(0, slot_mapping, k)
    v_slots.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor,
                    v_slots: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention for a step whose new K/V are already written to the cache.

    q [N, heads, d]; k, v [N, kv_heads, d] (this step's, used directly by
    prefill chunks with no cached context); k_slots / v_slots the layer's
    caches viewed flat [num_slots, kv_heads, d]. Returns [N, heads, d].
    """
    n_tok, heads, d = q.shape
    kvh = k_slots.shape[-2]
    if meta.num_decode == n_tok and not meta.prefills:
        return decode_attention(q, k_slots, v_slots, meta)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = decode_attention(q[: meta.num_decode], k_slots, v_slots, meta)
    flat_k, flat_v = k_slots, v_slots
    for chunk in meta.prefills:
        qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if chunk.context_slots is None:
            kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc.to(q.dtype), vc.to(q.dtype),
                                               is_causal=True, enable_gqa=heads != kvh)
        else:
            kc = flat_k.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
            vc = flat_v.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qc, kc.to(q.dtype), vc.to(q.dtype),
                                               attn_mask=chunk.mask, enable_gqa=heads != kvh)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
    """One query per row over its gathered context: q [B, heads, d] -> [B, heads, d].

    The GQA group is folded into the query-length axis ([B, kv_heads, group, d])
    so no K/V head is ever repeated.
    """
    b, heads, d = q.shape
    kvh = k_slots.shape[-2]
    t = meta.decode_len
    kc = k_slots.index_select(0, meta.decode_slots).view(b, t, kvh, d)
    vc = v_slots.index_select(0, meta.decode_slots).view(b, t, kvh, d)
    if kc.dtype != q.dtype:
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)
    o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), kc.transpose(1, 2),
                                       vc.transpose(1, 2), attn_mask=meta.decode_mask)
    return o.view(b, heads, d)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """Slow, obviously-correct attention, token by token, head by head.

    ``seqs`` lists (num_computed, num_new, block_table) in batch order; q holds
    the new tokens' queries [N, heads, d] in that order; the cache already holds
    every token of each sequence up to num_computed + num_new.
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
