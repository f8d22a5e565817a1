"""helexa/kernels/cpu/native.c against plain torch: the few-row matmul, and whole decode steps of
each architecture run by the cpu backend's native kernels vs the torch backend, on the
same inputs."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.cpu import native as cpu_native
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

lib = cpu_native.load()
needs_lib = pytest.mark.skipif(lib is None, reason="no C compiler: the native kernels are off")


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@needs_lib
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("n,k,bias", [(1024, 512, False), (40, 33, True), (13, 9, True),
                                      (1, 5, False), (16, 64, True)])
def test_gemm_matches_linear(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    packed, packed_bias = cpu_native.pack_weight(w.t().contiguous().t(), b)  # column-major in
    y = cpu_native.gemm(lib, x, packed, n, packed_bias)
    assert y.shape == (m, n)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _runner(model_dir, backend: str, monkeypatch, threads: int = 1,
            matmul: str = "measure", **kw) -> ModelRunner:
    with monkeypatch.context() as mp:
        mp.setenv("HELEXA_CPU_MATMUL", matmul)
        with torch_threads(threads):  # the matmul kernels are measured at this thread count
            return ModelRunner(model_dir, num_blocks=96, block_size=16, max_num_seqs=8,
                               max_batched_tokens=512, backend=backend, **kw)


def _drive(runner: ModelRunner, prompts, tables, steps: int) -> list[torch.Tensor]:
    """Prefill every prompt, then `steps` greedy decode steps of all rows; after the first
    decode step the middle row leaves, so later steps have other shapes (and one row)."""
    out = [runner.execute([SeqInput(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])]
    last = out[0].argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    rows = list(range(len(prompts)))
    for step in range(steps):
        logits = runner.execute([SeqInput([last[i]], lens[i], tables[i], True) for i in rows])
        out.append(logits)
        for r, i in enumerate(rows):
            lens[i] += 1
            last[i] = int(logits[r].argmax())
        if step == 0:
            rows = [rows[0], rows[-1]]
        if step == 2:
            rows = [rows[0]]
    return out


def _same_steps(a: ModelRunner, b: ModelRunner, prompts, tables, steps: int, *,
                logits_tol: float, kv_tol: float) -> None:
    """Both runners driven alike (one thread) give each step's logits and write the same
    KV, within the tolerances."""
    with torch_threads(1):
        got, want = _drive(a, prompts, tables, steps), _drive(b, prompts, tables, steps)
    for step, (x, y) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(x, y, rtol=logits_tol, atol=logits_tol, msg=f"step {step}")
    for kv_a, kv_b in zip(a.kv_pools, b.kv_pools, strict=True):
        torch.testing.assert_close(kv_a.k_heads, kv_b.k_heads, rtol=kv_tol, atol=kv_tol)
        torch.testing.assert_close(kv_a.v_heads, kv_b.v_heads, rtol=kv_tol, atol=kv_tol)


@needs_lib
@pytest.mark.parametrize("arch,kw", [
    ("qwen3", {}),  # q/k norm
    ("qwen2", {"head_dim": 64, "hidden_size": 128, "num_heads": 4}),  # QKV bias, 64-dim heads
    ("llama", {"tie_word_embeddings": True}),  # tied head: the final norm is not folded
])
# native: every matmul hx_gemm, all layers in one call; onednn: matmuls in torch between
# the native calls; measure: whatever this CPU measured fastest.
@pytest.mark.parametrize(("threads", "matmul"), [(1, "native"), (2, "torch,onednn,onednn"),
                                                 (1, "measure")])
def test_native_decode_steps_match_the_eager_path(tiny_checkpoint, monkeypatch, arch, kw,
                                                  threads, matmul):
    model_dir = tiny_checkpoint(arch, **kw)
    native = _runner(model_dir, "cpu", monkeypatch, threads, matmul)
    eager = _runner(model_dir, "torch", monkeypatch)
    assert native.backend.executor.native is not None and eager.backend.name == "torch"
    if matmul != "measure":  # one row, three rows, and the 2-16 bucket: fused iff all native
        assert native.backend.executor.native.fused(3) == (matmul == "native")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (21, 40, 7)]
    # scattered, out-of-order blocks: the kernels must follow the tables
    tables = [[9, 2, 30, 4, 11], [5, 17, 3, 50, 51], [60, 1, 44, 8, 20]]
    _same_steps(native, eager, prompts, tables, 6, logits_tol=1e-4, kv_tol=1e-5)


@needs_lib
def test_a_block_outside_the_pool_is_refused_before_the_kernels(tiny_model_dir, monkeypatch):
    r = _runner(tiny_model_dir, "cpu", monkeypatch)
    r.execute([SeqInput([5, 6, 7], 0, [0], True)])
    with pytest.raises(ValueError, match="outside the pool of 96 blocks"):
        r.execute([SeqInput([8], 3, [96], True)])
    out = r.execute([SeqInput([8], 3, [0], True)])  # the runner is still good
    assert torch.isfinite(out).all()


@needs_lib
def test_quantised_kv_keeps_the_eager_attention(tiny_model_dir, monkeypatch):
    r = _runner(tiny_model_dir, "cpu", monkeypatch)
    r.reset_kv(96, "int8")
    assert r.backend.executor.native is None  # the native attention reads fp32 KV only
    out = r.execute([SeqInput([5, 6, 7], 0, [0], True)])
    assert torch.isfinite(r.execute([SeqInput([int(out.argmax())], 3, [0], True)])).all()
    r.reset_kv(96, "auto")
    assert r.backend.executor.native is not None


@needs_lib
def test_loading_the_library_leaves_float_semantics_alone():
    """Built with -ffast-math it would set flush-to-zero process-wide when loaded."""
    assert 5e-324 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() > 0
    assert (torch.tensor([1e-38]) * 1e-3).item() > 0  # a denormal result survives


def test_disabled_or_unbuildable_kernels_fall_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HELEXA_CPU_KERNELS", "0")
    assert cpu_native.load() is None
    monkeypatch.setenv("HELEXA_CPU_KERNELS", "1")
    monkeypatch.setenv("HELEXA_CACHE", str(tmp_path))  # no cached library
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    assert cpu_native.load() is None
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_native.build(tmp_path / "x.so")
    assert not list(tmp_path.rglob("*.so*"))  # no half-written library left behind


# A GGUF whose layer 0 is K-quants (4-bit kquant, 8-bit Q6_K / Q5_K) and layer 1 Q8_0
# attention with float MLPs: every matmul kind hx_decode_layers runs, in one step.
_MIXED = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
          {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
           "ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "F16"}]


def _gguf_type(mixed: bool):
    def type_of(name: str) -> str:
        if name.startswith("blk.") and mixed:
            _, layer, part, _ = name.split(".")
            return _MIXED[int(layer)][part]
        return "Q8_0" if name.startswith(("blk.", "token_embd")) else "Q6_K"
    return type_of


@needs_lib
@pytest.mark.parametrize(("arch", "mixed", "kind"), [
    *[("qwen3", True, isa) for isa in ("plain", "avx2", "vnni", "vnni8", "avx512")],
    ("qwen2", True, "avx2"),  # QKV bias: added after the quantised product
    ("qwen3", False, "int8g"),  # all 8-bit: int8g.c's kernel inside the fused step
    ("qwen3", True, "tile"),  # torch tiles somewhere: layer by layer
])
def test_quantised_decode_runs_every_layer_in_one_native_call(
        tiny_checkpoint, tmp_path, monkeypatch, arch, mixed, kind):
    """A GGUF model's decode step through hx_decode_layers gives the logits and KV of the
    same kernels called layer by layer from Python."""
    from support.gguf_reference import write_gguf

    from helexa.kernels.cpu import kquant

    if kind in kquant.ISAS and kind not in kquant.isas():
        pytest.skip(f"no {kind} build on this CPU")
    src = tiny_checkpoint(arch, hidden_size=256, num_heads=4, num_kv_heads=2,
                          intermediate_size=512, num_layers=2)
    write_gguf(src, tmp_path / "m.gguf", _gguf_type(mixed))
    monkeypatch.setenv("HELEXA_CPU_KQUANT", kind)  # read at each call, not only at load
    fused, layered = (_runner(tmp_path / "m.gguf", "cpu", monkeypatch, 1, "native",
                              dtype="float32") for _ in range(2))
    layered.backend.executor.native._fused_plan = lambda rows: None
    assert fused.backend.executor.native.fused(1) == fused.backend.executor.native.fused(3) \
        == (kind != "tile")
    if kind != "tile":  # the LM head's matmul and the embedding's lookup in the same call
        assert fused.backend.executor.native._fused_plan(1)[3] is not None
        assert fused.backend.executor.native.embed is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (19, 33, 6)]
    tables = [[9, 2, 30, 4, 11], [5, 17, 3, 50, 51], [60, 1, 44, 8, 20]]
    _same_steps(fused, layered, prompts, tables, 5, logits_tol=1e-5, kv_tol=0)
    if kind != "tile":  # a token id past the table fails the step, as torch's lookup does
        vocab = int(fused.backend.executor.native.embed[1])
        with pytest.raises(IndexError, match="outside the vocabulary"):
            fused.execute([SeqInput([vocab + 3], 19, tables[0], True)])
