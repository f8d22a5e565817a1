"""The paged-attention fast path agrees with the token-by-token reference."""

from __future__ import annotations

import pytest
import torch
from helexa.kernels.attention import (
    AttentionMetadata,
    PrefillChunk,
    paged_attention,
    paged_attention_reference,
    write_kv,
)

BLOCK = 4


def _slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def build_step(seqs: list[tuple[int, int, list[int]]], heads: int, kvh: int, d: int,
               dtype: torch.dtype = torch.float32):
    """Random cache and queries for seqs (num_computed, num_new, table), decode rows first."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(64, BLOCK, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(64, BLOCK, kvh, d, generator=g).to(dtype)
    n = sum(s[1] for s in seqs)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(n, kvh, d, generator=g).to(dtype)
    v = torch.randn(n, kvh, d, generator=g).to(dtype)
    slot_mapping: list[int] = []
    decode = [s for s in seqs if s[1] == 1]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode=len(decode))
    if decode:
        t = max(c for c, _, _ in decode) + 1
        rows = [_slots(tab, range(c + 1)) + [0] * (t - c - 1) for c, _, tab in decode]
        meta.decode_slots = torch.tensor(rows).view(-1)
        meta.decode_len = t
        meta.decode_mask = torch.tensor(
            [[p <= c for p in range(t)] for c, _, _ in decode]).view(len(decode), 1, 1, t)
    start = 0
    for c, m, tab in seqs:
        slot_mapping += _slots(tab, range(c, c + m))
        if m > 1:
            chunk = PrefillChunk(start, start + m)
            if c:
                chunk.context_slots = torch.tensor(_slots(tab, range(c + m)))
                chunk.mask = torch.tensor([[j <= c + i for j in range(c + m)] for i in range(m)])
            meta.prefills.append(chunk)
        start += m
    meta.slot_mapping = torch.tensor(slot_mapping)
    write_kv(k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d), meta.slot_mapping, k, v)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (8, 2), (4, 1)])
def test_mixed_step_matches_reference(heads, kvh):
    seqs = [(9, 1, [3, 7, 1]), (2, 1, [12]), (0, 6, [20, 21]), (5, 7, [30, 31, 32])]
    q, k, v, kc, vc, meta = build_step(seqs, heads, kvh, 16)
    fast = paged_attention(q, k, v, kc.flatten(0, 1), vc.flatten(0, 1), meta)
    ref = paged_attention_reference(q, kc, vc, seqs)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_pure_decode_batch_matches_reference():
    seqs = [(c, 1, [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]) for i, c in enumerate([0, 4, 11, 7])]
    q, k, v, kc, vc, meta = build_step(seqs, 8, 2, 32)
    torch.testing.assert_close(paged_attention(q, k, v, kc.flatten(0, 1), vc.flatten(0, 1), meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)


def test_bf16_cache_matches_reference():
    seqs = [(6, 1, [1, 2]), (3, 5, [5, 6])]
    q, k, v, kc, vc, meta = build_step(seqs, 4, 2, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(paged_attention(q, k, v, kc.flatten(0, 1), vc.flatten(0, 1), meta).float(),
                               paged_attention_reference(q, kc, vc, seqs).float(),
                               atol=2e-2, rtol=2e-2)
