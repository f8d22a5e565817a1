"""ModelRunner steps give transformers' logits, whatever the batch layout."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helexa.kernels.attention import DECODE_CHUNK_TOKENS
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(tiny_model_dir, num_blocks=64, block_size=4, max_num_seqs=8,
                       max_batched_tokens=256)


@pytest.fixture(scope="module")
def hf_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return run


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_step_logits_match_reference_in_input_order(runner, hf_logits):
    a, b, c = seq(10, 1), seq(7, 2), seq(13, 3)
    ta, tb, tc = [5, 9, 2], [11, 1], [20, 30, 40, 50]
    # Step 1: prefill a fully, b partly (no logits), c's first chunk.
    runner.execute([SeqInput(a, 0, ta, True), SeqInput(b[:4], 0, tb, False),
                    SeqInput(c[:6], 0, tc, False)])
    # Step 2, prefill rows before decode rows: c's next chunk with logits, a decodes, b finishes.
    out = runner.execute([SeqInput(c[6:], 6, tc, True), SeqInput([7], 10, ta, True),
                          SeqInput(b[4:], 4, tb, True)])
    assert out.shape == (3, runner.vocab_size) and out.dtype == torch.float32
    torch.testing.assert_close(out[0], hf_logits(c)[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], hf_logits(a + [7])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2], hf_logits(b)[-1], atol=1e-4, rtol=1e-4)


def test_decode_rows_of_different_lengths_in_one_forward(runner, hf_logits):
    prompts = [seq(n, 10 + n) for n in (3, 9, 6)]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    runner.execute([SeqInput(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
    nxt = [4, 8, 15]
    out = runner.execute([SeqInput([x], len(p), t, True)
                          for p, t, x in zip(prompts, tables, nxt, strict=True)])
    for i, (p, x) in enumerate(zip(prompts, nxt, strict=True)):
        torch.testing.assert_close(out[i], hf_logits(p + [x])[-1], atol=1e-4, rtol=1e-4)


def test_one_row_decode_matches_whichever_matmul_the_backend_measured(runner, hf_logits):
    # The cpu backend times its matmuls at load (packed hx_gemm, oneDNN, or F.linear over
    # column-major weights) and keeps the fastest, which on a loaded machine can differ from run
    # to run: a lone decode row matches transformers whichever was chosen.
    p = seq(9, 40)
    runner.execute([SeqInput(p, 0, [40, 41, 42], False)])
    out = runner.execute([SeqInput([17], 9, [40, 41, 42], True)])
    torch.testing.assert_close(out[0], hf_logits(p + [17])[-1], atol=1e-4, rtol=1e-4)


def test_batched_decode_steps_keep_matching_as_rows_come_and_go(runner, hf_logits):
    # Several decode rows keep their context from step to step (CPU): still transformers'
    # logits every step, and when a row is replaced or the batch shrinks.
    prompts = [seq(n, 60 + n) for n in (5, 8, 3)]
    tables = [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    runner.execute([SeqInput(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
    for step in range(6):
        if step == 3:  # the second row is replaced by another request, same length
            prompts[1] = seq(len(prompts[1]), 99)
            tables[1] = [22, 23, 24, 25]
            runner.execute([SeqInput(prompts[1], 0, tables[1], False)])
        rows = range(3) if step < 5 else range(2)  # the last row is gone
        nxt = [(7 * step + i) % 400 + 3 for i in rows]
        out = runner.execute([SeqInput([nxt[i]], len(prompts[i]), tables[i], True) for i in rows])
        for i in rows:
            prompts[i] = prompts[i] + [nxt[i]]
            torch.testing.assert_close(out[i], hf_logits(prompts[i])[-1], atol=1e-4, rtol=1e-4)


def test_short_block_table_is_refused(runner):
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([SeqInput(seq(9, 4), 0, [1, 2], True)])


def test_reset_kv_changes_pool_and_keeps_weights(tiny_model_dir, hf_logits):
    r = ModelRunner(tiny_model_dir, num_blocks=8, block_size=4, max_num_seqs=2,
                    max_batched_tokens=64)
    before = r.kv_bytes_per_block
    assert r.kv_dtype == "fp32"
    r.reset_kv(16, "bf16")
    assert r.num_blocks == 16 and r.kv_dtype == "bf16"
    assert r.k_caches[0].shape[0] == 16 and r.k_caches[0].dtype == torch.bfloat16
    assert r.kv_bytes_per_block == before // 2
    p = seq(6, 5)
    out = r.execute([SeqInput(p, 0, [3, 9], True)])
    torch.testing.assert_close(out[0], hf_logits(p)[-1], atol=5e-2, rtol=5e-2)
    with pytest.raises(ValueError, match="kv_dtype"):
        r.reset_kv(16, "int3")
    r.reset_kv(16, "int8")  # quantised: 1 B/elt + an fp32 scale per token-head
    assert r.kv_dtype == "int8"
    assert r.kv_bytes_per_block == 2 * 2 * 4 * 2 * (16 + 4)  # layers × K,V × block × heads × B
    out = r.execute([SeqInput(p, 0, [3, 9], True)])
    torch.testing.assert_close(out[0], hf_logits(p)[-1], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(("dtype", "torch_dtype", "kv"), [("bfloat16", torch.bfloat16, "bf16"),
                                                         ("fp16", torch.float16, "fp16")])
def test_half_weights_load_and_decode(tiny_model_dir, hf_logits, dtype, torch_dtype, kv):
    progress: list[tuple[int, int]] = []
    r = ModelRunner(tiny_model_dir, dtype=dtype, num_blocks=8, block_size=4, max_num_seqs=1,
                    max_batched_tokens=64, progress=lambda done, total: progress.append((done, total)))
    assert r.dtype == torch_dtype and r.kv_dtype == kv
    assert progress and progress[-1][0] == progress[-1][1]
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)
    p = seq(8, 6)
    out = r.execute([SeqInput(p, 0, [0, 1], True)])
    ref = hf_logits(p)[-1]
    assert int(out[0].argmax()) == int(ref.argmax())


class PeakBytes(TorchDispatchMode):
    """Counts the bytes of tensors ops allocate while it is on, and their peak live total:
    an op's result that aliases nothing is a new allocation, freed when the last tensor on
    its storage is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors on it]
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        outs = out if isinstance(out, tuple | list) else (out,)
        for ret, t in zip(rets, outs, strict=False):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            key = t.untyped_storage().data_ptr()
            if ret.alias_info is None and key not in self.live:
                nbytes = t.untyped_storage().nbytes()
                self.live[key] = [nbytes, 0]
                self.now += nbytes
                self.peak = max(self.peak, self.now)
            if key in self.live:
                self.live[key][1] += 1
                weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_decode_step_beside_a_32k_row_allocates_a_bounded_amount(tiny_model_dir, kv_dtype):
    """1 x 32k + 7 x 100-token rows on the torch path, the long row's blocks shuffled: the
    step allocates under a few chunks of context, not the batch padded to 32k."""
    bs, long_len, short = 16, 32 * 1024, 100
    long_blocks = long_len // bs + 1
    num_blocks = long_blocks + 7 * (short // bs + 1)
    r = ModelRunner(tiny_model_dir, num_blocks=num_blocks, block_size=bs, kv_dtype=kv_dtype,
                    max_num_seqs=8, max_batched_tokens=256, backend="torch")
    g = torch.Generator().manual_seed(0)
    for kv in r.kv_pools:  # the context's K/V: random, written straight into the pool
        slots = torch.arange(num_blocks * bs)
        shape = (slots.numel(), kv.num_kv_heads, kv.head_dim)
        kv.write(slots, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[:long_blocks]] + [perm[long_blocks + i * 7 : long_blocks + (i + 1) * 7]
                                     for i in range(7)]
    lens = [long_len - 1] + [short - 1] * 7

    def step() -> torch.Tensor:
        return r.execute([SeqInput([5 + i], n, t, True)
                          for i, (n, t) in enumerate(zip(lens, tables, strict=True))])

    step()  # first: the rotary table grows to 32k positions (kept, not a temporary)
    with PeakBytes() as pb:
        out = step()
    assert torch.isfinite(out).all()
    kvh, d = r.num_kv_heads, r.config.head_dim
    padded = 2 * 8 * long_len * kvh * d * 4  # K and V of every row padded to 32k, fp32
    # Bound: K and V of one chunk (DECODE_CHUNK_TOKENS row-tokens) gathered, dequantised and
    # made fp32 (three copies each), the long row's slot table, plus 1 MiB for the rest.
    chunk = 2 * 3 * DECODE_CHUNK_TOKENS * kvh * d * 4
    bound = chunk + long_len * 8 + 2**20
    assert pb.peak < bound < padded / 8, (pb.peak, bound, padded)


def test_the_plan_and_the_pool_must_agree_on_bytes_per_block(tiny_model_dir):
    from helexa.neuron.engine.memory_plan import KvPlanError

    kw = {"num_blocks": 8, "block_size": 4, "max_num_seqs": 2, "max_batched_tokens": 64}
    real = ModelRunner(tiny_model_dir, **kw).kv_bytes_per_block
    assert ModelRunner(tiny_model_dir, plan_bytes_per_block=real, **kw).num_blocks == 8
    with pytest.raises(KvPlanError, match=rf"plan's {real + 4}, this runner's {real}, "
                                          r"tensor-parallel ranks' none"):
        ModelRunner(tiny_model_dir, plan_bytes_per_block=real + 4, **kw)


def test_a_pool_that_cannot_hold_the_context_refuses_with_the_arithmetic():
    from helexa.neuron.engine.memory_plan import KvPlanError, fit_blocks

    mib = 2**20
    kw = {"bytes_per_block": mib, "block_size": 16, "total_bytes": 1000 * mib}
    # 2000 MiB free - 500 MiB step - 256 MiB margin = 1244 blocks, under the plan's 1500
    assert fit_blocks(planned_blocks=1500, context=4096, free_bytes=2000 * mib,
                      step_peak=500 * mib, **kw) == 1244
    assert fit_blocks(planned_blocks=900, context=4096, free_bytes=2000 * mib,
                      step_peak=500 * mib, **kw) == 900  # the plan is the ceiling
    with pytest.raises(KvPlanError, match=r"2,000 MiB free .* 500 MiB peak .* 256 MiB margin "
                                          r"= 1,244 MiB = 1244 blocks .*\(40000 tokens\) needs "
                                          r"2500 blocks"):
        fit_blocks(planned_blocks=5000, context=40000, free_bytes=2000 * mib,
                   step_peak=500 * mib, **kw)


def test_every_tensor_parallel_rank_reports_its_bytes_per_block(tiny_model_dir):
    import multiprocessing

    from helexa.neuron.engine.memory_plan import KvPlanError

    kw = {"num_blocks": 8, "block_size": 4, "max_num_seqs": 2, "max_batched_tokens": 64,
          "tp_size": 2}
    r = ModelRunner(tiny_model_dir, **kw)
    per_rank = r.kv_bytes_per_block
    assert r._tp.kv_bytes_per_block == [per_rank]  # rank 1's, as it reported it
    r.close()
    with pytest.raises(KvPlanError, match=rf"plan's {2 * per_rank}, this runner's {per_rank}, "
                                          rf"tensor-parallel ranks' \[{per_rank}\]"):
        ModelRunner(tiny_model_dir, plan_bytes_per_block=2 * per_rank, **kw)
    assert not multiprocessing.active_children()  # the failed load stopped its ranks
