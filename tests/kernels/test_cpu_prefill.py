"""The cpu backend's prefill chunks over cached context (kernels/cpu/prefill.py: the cached
prefix and the chunk's own keys attended apart, merged by log-sum-exp) agree with the
token-by-token reference, whatever the GQA group, the pool's dtype and its block layout;
and the cpu backend runs them, with no dense mask, through the model's attention op."""

from __future__ import annotations

import pytest
import torch
from test_attention import BLOCK, build_step  # tests/kernels/ is on sys.path (pytest)

from helexa.kernels.attention import paged_attention, paged_attention_reference
from helexa.kernels.cpu import prefill as cpu_prefill


def _prefill(q, k, v, kv, meta):
    return paged_attention(q, k, v, kv, meta.num_decode, lambda *a: None, meta.prefills,
                           lambda qc, chunk: cpu_prefill.context_prefill(qc, kv, chunk))


@pytest.mark.parametrize(("heads", "kvh"), [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_chunks_over_cached_context_match_the_reference(heads, kvh, consecutive):
    # two chunks after cached context (one ending mid-block), and a first chunk beside them
    seqs = [(9, 6, [3, 7, 1, 9]), (0, 5, [12, 13]), (16, 11, [20, 21, 22, 23, 24, 25, 26])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, heads, kvh, 16)
    if consecutive:  # the third one's blocks are consecutive: read as a view of the pool
        chunk = meta.prefills[2]
        chunk.context_slots, chunk.context_start, chunk.context_len = None, 20 * BLOCK, 27
    for chunk in meta.prefills:
        chunk.mask = None  # the kernel reads none
        if chunk.context_slots is not None:
            chunk.context_len = chunk.context_slots.numel()
    torch.testing.assert_close(_prefill(q, k, v, kv, meta),
                               paged_attention_reference(q, kc, vc, seqs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "kv_dtype", "tol"), [
    (torch.bfloat16, None, 2e-2), (torch.float32, "int8", 1e-5)])
def test_bf16_and_quantised_pools_match_the_reference(dtype, kv_dtype, tol):
    seqs = [(7, 9, [2, 3, 4, 5]), (13, 4, [30, 31, 32, 33, 34])]
    q, k, v, kv, kc, vc, meta = build_step(seqs, 8, 2, 32, dtype=dtype, kv_dtype=kv_dtype)
    for chunk in meta.prefills:
        chunk.mask, chunk.context_len = None, chunk.context_slots.numel()
    torch.testing.assert_close(_prefill(q, k, v, kv, meta).float(),
                               paged_attention_reference(q, kc, vc, seqs).float(),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("decode_rows", [0, 2])
def test_the_cpu_backend_runs_its_chunks_over_context_through_the_kernel(monkeypatch,
                                                                         decode_rows):
    """A step holding a prefill chunk over cached context (beside no decode row: the torch
    plan the cpu backend hands on; beside two: its own, decode rows on the mirrors) reads
    the chunk through kernels/cpu/prefill.py with no [n, T] mask built, and attends as the
    torch backend does."""
    from helexa.checkpoint.layer_memory import AttentionSpec
    from helexa.kernels.backends import base, cpu
    from helexa.kernels.backends.torch_ref import TorchBackend

    calls = []

    def spy(q, kv, chunk):
        calls.append(chunk.context_len)
        return cpu_prefill.context_prefill(q, kv, chunk)

    monkeypatch.setattr(cpu, "context_prefill", spy)
    heads, kvh, d, bs, blocks = 8, 2, 16, 4, 32
    g = torch.Generator().manual_seed(3)
    backends = [cpu.CpuAttention(torch.device("cpu")), TorchBackend(torch.device("cpu"))]
    spec = AttentionSpec(kv_heads=kvh, head_dim=d, kv_dtype="fp32")
    fill = (torch.randn(blocks * bs, kvh, d, generator=g), torch.randn(blocks * bs, kvh, d,
                                                                         generator=g))
    for b in backends:
        b.allocate_kv([spec], blocks, bs, storage=torch.float32, compute=torch.float32)
        b.pools[0].write(torch.arange(blocks * bs), *fill)
    table, c, n = [9, 2, 17, 5, 11, 3, 20, 8], 19, 10  # cached 19, the chunk's 10 after
    tables = [[1, 4, 6], [7, 10]][:decode_rows]
    positions = [9, 6][:decode_rows]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
    step = base.StepPlan(slot_mapping=torch.tensor(slots), decode_positions=positions,
                         decode_tables=tables, block_size=bs, num_blocks=blocks,
                         prefills=[base.PrefillRow(decode_rows, decode_rows + n, c, table)])
    rows = decode_rows + n
    q = torch.randn(rows, heads, d, generator=g)
    k, v = torch.randn(rows, kvh, d, generator=g), torch.randn(rows, kvh, d, generator=g)
    got = []
    for b in backends:
        meta = b.plan(step)
        assert all(chunk.mask is None for chunk in meta.prefills) or b is backends[1]
        got.append(base.attention(q, k, v, 0, meta))
    assert calls == [c + n]
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kv_dtype", "consecutive"), [("int8", False), ("int8", True),
                                                        (None, False)])
def test_a_long_prefix_that_is_copied_is_read_a_key_chunk_at_a_time(monkeypatch, kv_dtype,
                                                                    consecutive):
    """A prefix gathered from across the pool, or dequantised, is copied as it is read: it
    is read DECODE_CHUNK_TOKENS keys at a time, as the torch reference reads it, and
    attends as the reference does. Read whole, 65,536 cached tokens of an int8 pool grew
    one layer's chunk by 897 MiB."""
    from helexa.kernels.attention import DECODE_CHUNK_TOKENS, PrefillChunk, _prefill_long
    from helexa.kernels.paged_kv import PagedKV

    torch.manual_seed(0)
    bs, kvh, heads, d, n = 16, 2, 4, 8, 24
    t = 2 * DECODE_CHUNK_TOKENS + 2 * bs + 5  # three key chunks of prefix, a part block
    nb = t // bs + 2
    kv = PagedKV(nb, bs, kvh, d, kv_dtype=kv_dtype, compute=torch.float32, device="cpu",
                 storage=None)
    blocks = torch.arange(nb - 1) if consecutive else torch.randperm(nb)[: nb - 1]
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:t]
    kv.write(slots, torch.randn(t, kvh, d), torch.randn(t, kvh, d))
    chunk = PrefillChunk(start=0, end=n, context_len=t)
    if consecutive:
        chunk.context_start = 0
    else:
        chunk.context_slots = slots
    read: list[int] = []  # keys per read of the pool
    gather, span = PagedKV.gather_heads, PagedKV.span_heads

    def gathered(self, s, out=None):
        read.append(s.numel())
        return gather(self, s, out)

    def spanned(self, start, length):
        read.append(length)
        return span(self, start, length)

    monkeypatch.setattr(PagedKV, "gather_heads", gathered)
    monkeypatch.setattr(PagedKV, "span_heads", spanned)
    q = torch.randn(n, heads, d)
    out = cpu_prefill.context_prefill(q, kv, chunk)
    assert max(read) <= DECODE_CHUNK_TOKENS, read
    assert sum(read) == t, read  # every key read once
    torch.testing.assert_close(out, _prefill_long(q, kv, chunk), atol=1e-5, rtol=1e-5)
