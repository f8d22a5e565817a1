"""The paged-attention fast paths agree with the token-by-token reference: decode rows
padded to the longest (the cpu backend's path) or by length group (the torch backend's),
beside prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from helexa.kernels import kv_quant
from helexa.kernels.attention import (
    DecodeGroup,
    PrefillChunk,
    grouped_decode,
    paged_attention,
    paged_attention_reference,
)
from helexa.kernels.cpu.mirror import PaddedDecode, padded_decode
from helexa.kernels.paged_kv import PagedKV

BLOCK = 4


@dataclass
class Step:
    """A step's attention plan as a backend builds it: decode rows padded (``decode``), or
    by length group when ``decode_groups`` is set, then the prefill chunks."""

    slot_mapping: torch.Tensor
    num_decode: int
    decode: PaddedDecode = field(default_factory=lambda: PaddedDecode(length=0))
    decode_groups: list[DecodeGroup] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV,
           step: Step) -> torch.Tensor:
    groups = step.decode_groups
    if groups is not None:
        def decode(qd, kd, vd):
            return grouped_decode(qd, kv, groups)
    else:
        def decode(qd, kd, vd):
            return padded_decode(qd, kv, step.decode, kd, vd)
    return paged_attention(q, k, v, kv, step.num_decode, decode, step.prefills)


def _slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def build_step(seqs: list[tuple[int, int, list[int]]], heads: int, kvh: int, d: int,
               dtype: torch.dtype = torch.float32, kv_dtype: str | None = None):
    """A pool holding random context, and queries for seqs (num_computed, num_new, table),
    decode rows first; the step's new K/V are written into the pool."""
    g = torch.Generator().manual_seed(0)
    kv_dtype = kv_dtype or {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    kv = PagedKV(64, BLOCK, kvh, d, kv_dtype=kv_dtype, compute=dtype, device="cpu",
                 storage=None if kv_quant.is_quantized(kv_dtype) else dtype)
    all_slots = torch.arange(64 * BLOCK)
    kv.write(all_slots, torch.randn(64 * BLOCK, kvh, d, generator=g).to(dtype),
             torch.randn(64 * BLOCK, kvh, d, generator=g).to(dtype))
    n = sum(s[1] for s in seqs)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = torch.randn(n, kvh, d, generator=g).to(dtype)
    v = torch.randn(n, kvh, d, generator=g).to(dtype)
    slot_mapping: list[int] = []
    decode = [s for s in seqs if s[1] == 1]
    meta = Step(slot_mapping=torch.empty(0), num_decode=len(decode))
    if decode:
        t = max(c for c, _, _ in decode) + 1
        rows = [_slots(tab, range(c + 1)) + [0] * (t - c - 1) for c, _, tab in decode]
        meta.decode.slots = torch.tensor(rows).view(-1)
        meta.decode.length = t
        meta.decode.mask = torch.tensor(
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
    kv.write(meta.slot_mapping, k, v)
    # What the pool holds, as plain [num_blocks, block_size, kvh, d] tensors, for the reference.
    k_all, v_all = kv.gather(all_slots)
    return q, k, v, kv, k_all.view(64, BLOCK, kvh, d), v_all.view(64, BLOCK, kvh, d), meta


@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (8, 2), (4, 1)])
def test_mixed_step_matches_reference(heads, kvh):
    seqs = [(9, 1, [3, 7, 1]), (2, 1, [12]), (0, 6, [20, 21]), (5, 7, [30, 31, 32])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, heads, kvh, 16)
    fast = attend(q, k, v, kv, meta)
    ref = paged_attention_reference(q, kc, vc, seqs)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_pure_decode_batch_matches_reference():
    seqs = [(c, 1, [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]) for i, c in enumerate([0, 4, 11, 7])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32)
    torch.testing.assert_close(attend(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)


def test_bf16_cache_matches_reference():
    seqs = [(6, 1, [1, 2]), (3, 5, [5, 6])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 4, 2, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(attend(q, k, v, kv, meta).float(),
                               paged_attention_reference(q, kc, vc, seqs).float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "int4"])
def test_quantised_pool_matches_reference_over_what_it_stores(kv_dtype):
    # Decode and chunked-prefill-with-context rows read the pool (dequantised); a first
    # chunk attends to its own fresh K/V, so it is left out here.
    seqs = [(9, 1, [3, 7, 1]), (2, 1, [12]), (5, 7, [30, 31, 32])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32, kv_dtype=kv_dtype)
    torch.testing.assert_close(attend(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)
    assert kv.nbytes < 2 * 64 * BLOCK * 2 * 32 * 4 / 2  # well under an fp32 pool


def test_single_row_over_consecutive_blocks_reads_a_view():
    seqs = [(10, 1, [4, 5, 6])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32)
    meta.decode.slots, meta.decode.mask, meta.decode.start = None, None, 4 * BLOCK
    torch.testing.assert_close(attend(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)


def test_decode_gather_into_preallocated_buffers():
    seqs = [(c, 1, [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]) for i, c in enumerate([0, 4, 11, 7])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32)
    n = meta.decode.slots.numel() * 2 * 32 + 5  # at least [B * T, kvh, d] elements
    meta.decode.buffers = (torch.full((n,), float("nan")), torch.full((n,), float("nan")))
    torch.testing.assert_close(attend(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)
    assert meta.decode.buffers[0][:-5].isfinite().all()  # the gather landed in them


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_long_contexts_read_a_chunk_at_a_time_agree_with_the_reference(monkeypatch, kv_dtype):
    """Decode groups and prefill chunks past the chunk sizes (made tiny here) merge their
    softmax across chunks of keys: the same result as reading everything at once."""
    from helexa.kernels import attention

    monkeypatch.setattr(attention, "DECODE_CHUNK_TOKENS", 6)  # 2 rows: 3 keys a chunk
    monkeypatch.setattr(attention, "PREFILL_SCORE_ELEMS", 8 * 7 * 5)  # 5 keys a chunk
    seqs = [(9, 1, [3, 7, 1]), (5, 1, [12, 4]), (5, 7, [30, 31, 32])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32, kv_dtype=kv_dtype)
    lens = [c + 1 for c, m, _ in seqs if m == 1]
    meta.decode_groups = [DecodeGroup(rows=None, lengths=torch.tensor(lens), max_len=max(lens),
                                      slots=meta.decode.slots.view(len(lens), -1))]
    chunk = meta.prefills[0]
    chunk.mask, chunk.context_len = None, 5 + 7  # no mask: the long-context path
    torch.testing.assert_close(attend(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)
