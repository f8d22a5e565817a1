"""Decode attention over a quantised KV pool in two Triton launches
(helexa/kernels/cuda/quant_decode.py), run on CPU tensors by Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET), against the torch path it replaces on CUDA; its
splits, its probe, and a whole model's greedy decode through the torch backend with it."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from helexa.kernels.backends.base import StepPlan
from helexa.kernels.backends.torch_ref import TorchBackend
from helexa.kernels.cuda import quant_decode as qd
from helexa.kernels.paged_kv import PagedKV

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))

CPU = torch.device("cpu")


def _pool(kv_dtype: str, kvh: int, d: int, blocks: int, bs: int, dtype: torch.dtype,
          seed: int) -> PagedKV:
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(blocks, bs, kvh, d, kv_dtype=kv_dtype, storage=None, compute=dtype, device=CPU)
    n = blocks * bs
    kv.write(torch.arange(n), torch.randn(n, kvh, d, generator=gen).to(dtype) * 3,
             torch.randn(n, kvh, d, generator=gen).to(dtype))
    return kv


# Interpreted, a case takes 0.4-4 s on a 2-core CPU: the default run takes each KV dtype at
# two shapes, in fp16 and in bf16, once eager and once as a graph runs it (per_row), every
# shape twice; `-m slow` runs every KV dtype at every shape in both
_DECODE_DEFAULT = {("int8", 7, torch.bfloat16), ("fp8_e4m3", 12, torch.float16),
                   ("int4", 4, torch.bfloat16)}


@pytest.mark.parametrize(("kv_dtype", "heads", "kvh", "d", "dtype", "per_row"), [
    pytest.param(kv, *shape, dtype, False, marks=[pytest.mark.slow] * (
        (kv, shape[0], dtype) not in _DECODE_DEFAULT))
    for kv in ("int8", "fp8_e4m3", "int4")
    for shape in ((12, 2, 64), (4, 4, 40), (7, 1, 80))
    for dtype in (torch.float16, torch.bfloat16)] + [  # a graph's splits: each shape once
    ("int8", 12, 2, 64, torch.float16, True), ("fp8_e4m3", 4, 4, 40, torch.bfloat16, True),
    ("int4", 7, 1, 80, torch.float16, True)])
def test_the_kernel_is_the_torch_path(kv_dtype, heads, kvh, d, dtype, per_row, monkeypatch):
    """Rows of 1, 17, 40 and 130 tokens over scattered pages (GQA groups of 6, 1 and 7;
    head sizes off the powers of two; int4's last scale group partial), the longest row cut
    into splits of 32 tokens and the shorter rows' later splits empty; or, as a captured
    graph runs it (per_row), the split count of a 2,048-token most, each row's own context
    cut into that many spans: within the dtype's rounding of the torch path's gather,
    dequantise and SDPA."""
    monkeypatch.setattr(qd, "MIN_SPLIT", 16)  # many splits at these short contexts
    bs, lens = 8, [17, 1, 130, 40]
    kv = _pool(kv_dtype, kvh, d, 40, bs, dtype, seed=heads + d)
    pages = torch.randperm(40, generator=torch.Generator().manual_seed(d)).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(pages[at:at + -(-n // bs)])
        at += -(-n // bs)
    q = torch.randn(len(lens), heads, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    table, lens_t, want = qd.reference_inputs(tables, lens, bs, q, kv)
    most = 2048 if per_row else max(lens)
    assert qd.splits(len(lens), kvh, most)[0] > 1
    got = qd.decode(q, kv, table, lens_t, most, bs, per_row=per_row, interpret=True)
    assert got.dtype == dtype and got.shape == q.shape
    # the kernel rounds the softmax weights to the queries' dtype before they meet V (as
    # flash attention does): a few units in the last place of bf16 where SDPA keeps fp32
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < tol / 3


# the default run: each KV dtype, each GQA group and both ways a context's slots lie, in
# 4 of the 18 cases (the model test below adds int4's prefill over a cached chunk);
# `-m slow` runs them all
_PREFILL_DEFAULT = {("int8", 12, False), ("fp8_e4m3", 7, True), ("int4", 24, False),
                    ("int8", 24, True)}


@pytest.mark.parametrize(("consecutive", "heads", "kvh", "d", "kv_dtype"), [
    pytest.param(consecutive, *shape, kv, marks=[pytest.mark.slow] * (
        (kv, shape[0], consecutive) not in _PREFILL_DEFAULT))
    for consecutive in (False, True)
    for shape in ((12, 2, 64), (7, 7, 40), (24, 1, 80))
    for kv in ("int8", "fp8_e4m3", "int4")])
def test_the_prefill_kernel_is_the_torch_path(kv_dtype, heads, kvh, d, consecutive):
    """A chunk of 37 queries ending a 150-token context (GQA groups of 6, 1 and 24: 10, 64
    and 2 queries a program; the causal edge inside the key tiles), its context's slots
    scattered or one consecutive run, against the torch path both ways it reads a
    context: masked SDPA over the whole of it, and a chunk of keys at a time (what a
    context past DECODE_CHUNK_TOKENS takes, mask None)."""
    from helexa.kernels.attention import PrefillChunk, paged_attention

    bs, n, context = 8, 37, 150
    kv = _pool(kv_dtype, kvh, d, 24, bs, torch.float16, seed=heads * d)
    pages = (list(range(3, 22)) if consecutive else
             torch.randperm(24, generator=torch.Generator().manual_seed(2)).tolist()[:19])
    slots = [pages[i // bs] * bs + i % bs for i in range(context)]
    chunk = PrefillChunk(start=0, end=n, context_len=context,
                         context_start=slots[0] if consecutive else None,
                         context_slots=None if consecutive else torch.tensor(slots))
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(4)).half()
    got = qd.prefill(q, kv, chunk, interpret=True)
    ctx = torch.arange(context)
    for mask in (ctx[None, :] <= ctx[context - n:, None], None):
        ref = PrefillChunk(start=0, end=n, context_len=context,
                           context_slots=torch.tensor(slots), mask=mask)
        want = paged_attention(q, q[:, :kvh], q[:, :kvh], kv, 0, qd._no_decode, [ref])
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-3, atol=4e-3)


def test_splits_fill_the_card_at_batch_1_and_never_cut_a_short_row():
    # one row, 4 kv heads, 32k of context: 66 programs' worth, in whole tiles of 32 tokens
    # 64 splits of 512; a row of 300 tokens stays whole; 32 rows of 8 kv heads fill the
    # card already (2 splits); 1,000 tokens cut at most into 3 of 256 or more
    assert qd.splits(1, 4, 32768) == (64, 512)
    assert qd.splits(1, 4, 300) == (1, 320)
    assert qd.splits(32, 8, 32768) == (2, 16384)
    assert qd.splits(1, 8, 1000) == (3, 352)


def test_every_step_launches_the_one_merge_build_the_probe_compiled(monkeypatch):
    """Eager steps of short and long contexts and a graph's step all launch the merge at
    GRAPH_SPLITS' tile (one build a layer shape, compiled by the load's probe, not a new one
    at each power of two a growing context reaches), and no step cuts a row into more
    splits than that (at one row of one KV head a long context wanted 264)."""
    from helexa.kernels.cuda import _quant_decode_triton as src

    launched: list[tuple[str, int]] = []

    class Kernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((self.name, kw["SP"] if "SP" in kw else grid[2]))
            return launch

    monkeypatch.setattr(src, "build", lambda interpret: (Kernel("split"), Kernel("merge"),
                                                         Kernel("prefill")))
    kv = _pool("int8", 1, 64, 2, 16, torch.bfloat16, seed=0)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    for max_len, per_row in ((300, False), (2048, False), (1 << 20, False), (1 << 20, True)):
        qd.decode(q, kv, table, lens, max_len, 16, per_row=per_row)
    assert {sp for name, sp in launched if name == "merge"} == {qd.GRAPH_SPLITS}
    assert [n for name, n in launched if name == "split"] == [1, 8, 64, 64]


def test_the_probe_passes_the_kernel_and_catches_a_wrong_or_failing_one(monkeypatch):
    # a graph's most splits cut to 8 here (interpreted, 64 take seconds a probe); the
    # merge's 64-split build is compiled for sm90 by test_triton_compile.py
    monkeypatch.setattr(qd, "GRAPH_SPLITS", 8)
    assert qd.probe(CPU, "int4", 8, 2, 64, torch.bfloat16, interpret=True) == ""
    assert qd.probe_prefill(CPU, "int4", 8, 2, 64, torch.bfloat16, interpret=True) == ""
    real_prefill = qd.prefill

    def off(q, kv, chunk, interpret=False):  # a wrong answer
        return real_prefill(q, kv, chunk, interpret) * 0.9

    monkeypatch.setattr(qd, "prefill", off)
    assert qd.probe_prefill(CPU, "int8", 8, 2, 64, torch.bfloat16, interpret=True).startswith(
        "the Triton quantised-KV prefill is off by")
    real = qd.decode
    monkeypatch.setattr(qd, "decode", lambda *a, **kw: real(*a, **kw) * 1.05)
    assert qd.probe(CPU, "int8", 8, 2, 64, torch.bfloat16, interpret=True).startswith(
        "the Triton quantised-KV decode is off by")

    monkeypatch.setattr(qd, "decode", lambda *a, per_row=False, **kw:
                        real(*a, per_row=per_row, **kw) * (1.05 if per_row else 1))
    assert qd.probe(CPU, "int8", 8, 2, 64, torch.bfloat16, interpret=True).startswith(
        "the Triton quantised-KV decode (a graph's splits) is off by")

    def broken(*a, **kw):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(qd, "decode", broken)
    assert qd.probe(CPU, "int8", 8, 2, 64, torch.bfloat16, interpret=True) == (
        "the Triton quantised-KV decode failed (RuntimeError: out of resources: shared memory)")


def test_it_is_chosen_only_on_cuda_for_16_bit_queries_unless_switched_off(monkeypatch):
    from helexa.kernels.cuda import quant_write as qw

    cuda = torch.device("cuda")
    assert qd.chosen(CPU, "int8", 8, 2, 64, torch.bfloat16) == (False, "")
    assert qd.chosen(cuda, "int8", 8, 2, 64, torch.float32) == (False, "")
    assert qd.chosen(cuda, "bf16", 8, 2, 64, torch.bfloat16) == (False, "")
    monkeypatch.setattr(qd, "probe", lambda *a: "")
    monkeypatch.setattr(qw, "probe", lambda *a: "")
    assert qd.chosen(cuda, "int8", 8, 2, 64, torch.bfloat16) == (True, "")
    assert qw.chosen(cuda, "int8", 2, 64, torch.bfloat16) == (True, "")
    monkeypatch.setenv("HELEXA_TRITON_QUANT_DECODE", "0")  # read at each load
    monkeypatch.setenv("HELEXA_TRITON_QUANT_WRITE", "0")
    assert qd.chosen(cuda, "int8", 8, 2, 64, torch.bfloat16) == (False, "")
    assert qw.chosen(cuda, "int8", 2, 64, torch.bfloat16) == (False, "")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_the_torch_backend_decodes_a_step_on_the_kernel(kv_dtype):
    """The torch backend with the kernel set (as the cuda backend sets it where its probe
    agreed) plans a decode step's rows as one table and writes and attends as before:
    the step's output is the plain torch backend's, a prefill riding along unchanged."""
    bs, kvh, heads, d = 4, 2, 6, 32
    from helexa.checkpoint.layer_memory import AttentionSpec
    from helexa.kernels.backends.base import PrefillRow

    spec = [AttentionSpec(kv_heads=kvh, head_dim=d, kv_dtype=kv_dtype)]
    outs = []
    for kernel in (None, functools.partial(qd.decode, interpret=True)):
        backend = TorchBackend(CPU)
        backend.quant_decode = kernel
        backend.allocate_kv(spec, 16, bs, storage=None, compute=torch.float16)
        gen = torch.Generator().manual_seed(3)
        # rows of 9 and 3 tokens decoding (pages out of order), then a prefill of 5
        fill = torch.arange(16 * bs)
        backend.pools[0].write(fill, torch.randn(16 * bs, kvh, d, generator=gen).half(),
                               torch.randn(16 * bs, kvh, d, generator=gen).half())
        slots = torch.tensor([5 * bs + 0, 2 * bs + 2, 9 * bs, 9 * bs + 1, 9 * bs + 2,
                              9 * bs + 3, 10 * bs])
        step = StepPlan(slot_mapping=slots, decode_positions=[8, 2],
                        decode_tables=[[7, 3, 5], [2]], block_size=bs, num_blocks=16,
                        prefills=[PrefillRow(2, 7, 0, [9, 10])])
        meta = backend.plan(step)
        assert (meta.decode_rows is not None) == (kernel is not None)
        q, k, v = (torch.randn(7, h, d, generator=gen).half() for h in (heads, kvh, kvh))
        outs.append(backend.forward(0, q, k, v, meta))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("kv_dtype", ["int4"])  # the kernels' tests above take the others
def test_a_model_serves_the_same_with_the_three_kernels(tiny_checkpoint, kv_dtype):
    """A whole model (qwen3, fp16) over a quantised pool: a prompt in two chunks (the
    second over the first's cached KV, on the prefill kernel) beside another, then six
    decode steps of both whose rows are read by the decode kernel, every new K and V
    written by the write kernel (all interpreted), against the torch path, the same
    tokens fed to both: the pools byte-equal after and the logits equal to fp16's
    rounding."""
    from helexa.kernels.cuda import quant_write as qw
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

    path = tiny_checkpoint("qwen3", dtype="float16")
    runs, pools = [], []
    for kernels in (False, True):
        r = ModelRunner(path, num_blocks=16, block_size=8, max_num_seqs=2,
                        max_batched_tokens=64, kv_dtype=kv_dtype, backend="torch")
        attn = r.backend.attention
        calls: list[str] = []
        if kernels:
            def written(*a, _calls=calls):
                _calls.append("write")
                qw.write(*a, interpret=True)

            def read(*a, _calls=calls):
                _calls.append("decode")
                return qd.decode(*a, interpret=True)

            def ahead(*a, _calls=calls):
                _calls.append("prefill")
                return qd.prefill(*a, interpret=True)

            attn.quant_write, attn.quant_decode, attn.quant_prefill = written, read, ahead
        a, b = list(range(1, 10)), list(range(20, 25))
        # a's prompt in two chunks, the second over the first's cached KV beside b's prompt
        out = [r.execute([SeqInput(a[:4], 0, [0, 1], True)]),
               r.execute([SeqInput(a[4:], 4, [0, 1], True), SeqInput(b, 0, [2, 3], True)])]
        for i in range(6):
            out.append(r.execute([SeqInput([30 + i], 9 + i, [0, 1], True),
                                  SeqInput([40 + i], 5 + i, [2, 3], True)]))
        runs.append(out)
        pools.append([(p.k_data.clone(), p.v_data.clone()) for p in attn.pools])
        layers = len(attn.pools)
        r.close()
        if kernels:  # every layer writes each step; decode rows in the six decode steps;
            # the one chunk over cached context (b's prompt has none: SDPA on its own K/V)
            assert calls.count("write") == 8 * layers and calls.count("decode") == 6 * layers
            assert calls.count("prefill") == layers
    assert all(torch.equal(x, y) for p, q in zip(*pools, strict=True)
               for x, y in zip(p, q, strict=True))
    for plain, fused in zip(*runs, strict=True):
        assert (fused.float() - plain.float()).abs().max() <= 0.02 * plain.float().abs().max()


def test_a_model_on_a_quantised_pool_replays_its_captured_decode_graphs(
        tiny_checkpoint, monkeypatch):
    """The cuda backend over an int8 pool, its three kernels interpreted and CUDA graphs
    stood in (tests/support/graphs.py): decode steps of 4, 3, 2 and 1 rows are captured at
    load; then steps of rows at other lengths, pages and positions (a row crossing into a
    new page) replay them, and a step with a prefill runs eagerly: every step's logits are
    the plain torch path's, the same tokens fed to both."""
    import types

    from support.graphs import StandInRuntime

    from helexa.kernels.backends import Device
    from helexa.kernels.backends import cuda as cuda_backend
    from helexa.kernels.backends.cuda import CudaAttention
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor
    from helexa.kernels.cuda import quant_write as qw
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

    def interpreted(backend, spec, heads, compute):  # as quant_decode.choose where agreed
        on = spec is not None
        backend.quant_write = functools.partial(qw.write, interpret=True) if on else None
        backend.quant_decode = functools.partial(qd.decode, interpret=True) if on else None
        backend.quant_prefill = functools.partial(qd.prefill, interpret=True) if on else None

    monkeypatch.setattr(qd, "choose", interpreted)
    monkeypatch.setattr(cuda_backend, "flashinfer", types.SimpleNamespace(
        __version__="standin", BatchPrefillWithPagedKVCacheWrapper=lambda *a, **kw: None))
    monkeypatch.setenv("HELEXA_CUDA_FUSED", "0")  # FlashInfer's norms: not this test's
    path = tiny_checkpoint("qwen3", dtype="float16")
    a, b, c = list(range(1, 10)), list(range(20, 25)), list(range(40, 50))
    ta, tb, tc = [1, 2, 4], [3, 6], [5, 7]
    steps = [[SeqInput(a, 0, ta, True, 0), SeqInput(b, 0, tb, True, 1)],
             [SeqInput([60], 9, ta, True, 0), SeqInput([61], 5, tb, True, 1)],
             [SeqInput([62], 10, ta, True, 0), SeqInput(c, 0, tc, True, 2)]]
    for i in range(5):  # three rows; a's 16th token opens its second page
        steps.append([SeqInput([63 + i], 11 + i, ta, True, 0),
                      SeqInput([70 + i], 6 + i, tb, True, 1),
                      SeqInput([80 + i], 10 + i, tc, True, 2)])
    steps.append([SeqInput([90], 15, tc, True, 2)])
    runs, runtime, at_load = [], StandInRuntime(), 0
    for graphs in (False, True):
        r = ModelRunner(path, num_blocks=8, block_size=8, max_num_seqs=4,
                        max_batched_tokens=64, kv_dtype="int8", backend="torch")
        if graphs:
            att = CudaAttention(CPU, graph_rows=4, workspace_bytes=1024)
            ex = CudaGraphExecutor(att, runtime)
            r.backend = Device(att, ex)
            ex.prepare(r.model, [], max_num_seqs=4, max_batched_tokens=64, tp_size=1)
            r._reset_own_kv(8, "int8")
            r._capture_graphs()
            assert len(runtime.captured) == 4
            at_load = runtime.replays  # each capture step replays its new graph once
            assert ("graphs for 1..4 rows, captured at load (the torch path's Triton "
                    "kernels)") in r.attention_backend
        runs.append([r.execute(s) for s in steps])
        r.close()
    assert runtime.replays - at_load == 7  # every pure-decode step: one of 2 rows, five of 3, one of 1
    for plain, replayed in zip(*runs, strict=True):
        assert (replayed.float() - plain.float()).abs().max() <= 0.02 * plain.float().abs().max()
