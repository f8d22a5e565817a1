"""The cuda executor's one-kernel norms and SiLU (cuda_fused.py), with FlashInfer's three
kernels stood in by torch forms of what they compute (fp32 inside, in place where
FlashInfer writes in place): every norm and MLP of a dense and a hybrid model is routed
to them, and the model's logits are what its torch forms give, to bf16 rounding. No GPU
runs here: what the kernels save on one is measured by bench/gpu_check.sh."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.backends import cuda_fused
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
from helexa.neuron.models.layers import RMSNorm


class StandInOps:
    def __init__(self, fail: bool = False) -> None:
        self.calls: Counter[str] = Counter()
        self.fail = fail

    @staticmethod
    def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                out: torch.Tensor | None) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("ninja: build stopped")
        self.calls["rmsnorm"] += 1
        y = self._norm(x, w, eps).to(x.dtype)
        return y if out is None else out.copy_(y)

    def fused_add_rmsnorm(self, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          eps: float) -> None:
        self.calls["fused_add_rmsnorm"] += 1
        s = x.float() + y.float()
        x.copy_(s)
        y.copy_(self._norm(s, w, eps))  # the unrounded sum, as FlashInfer's kernel

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["silu_and_mul"] += 1
        gate, up = x.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)

    def apply_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cache: torch.Tensor) -> None:
        """FlashInfer's apply_rope_with_cos_sin_cache_inplace (neox): the leading
        cache.shape[1] dims of each head as two halves, in fp32 from the cache, in place."""
        if self.fail:
            raise RuntimeError("ninja: build stopped")
        assert cache.dtype == torch.float32 and q.shape[-1] == k.shape[-1]
        self.calls["apply_rope"] += 1
        half = cache.shape[1] // 2
        cos, sin = cache[positions, :half][:, None], cache[positions, half:][:, None]
        for x in (q, k):
            x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
            x[..., :half], x[..., half:2 * half] = x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    return runner.execute([SeqInput(prompt, 0, [0, 1, 2], True, 0)])[0].float()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_norms_and_mlps_run_the_fused_kernels_and_agree(
        tiny_checkpoint: Callable[..., Path], arch: str) -> None:
    path = tiny_checkpoint(arch=arch, dtype="bfloat16", hidden_size=64, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128)
    runner = ModelRunner(path, device="cpu", dtype="bfloat16", num_blocks=8, block_size=16,
                         max_num_seqs=2, num_state_slots=2, backend="torch", max_batched_tokens=64)
    prompt = [5, 9, 14, 3, 7, 21, 2]
    plain = _logits(runner, prompt)
    runner.close()
    runner = ModelRunner(path, device="cpu", dtype="bfloat16", num_blocks=8, block_size=16,
                         max_num_seqs=2, num_state_slots=2, backend="torch", max_batched_tokens=64)
    ops = StandInOps()
    line = cuda_fused.install(runner.model, torch.bfloat16, ops)  # type: ignore[arg-type]
    assert line == "norms, residual add + norm, SiLU: FlashInfer kernels"
    norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is not None and m.add_kernel is not None for m in norms)
    ops.calls.clear()  # the install's probe calls
    fused = _logits(runner, prompt)
    runner.close()
    layers = len(runner.model.model.layers)
    # every layer's two adds are fused; each MLP's gate is one kernel
    assert ops.calls["fused_add_rmsnorm"] == 2 * layers
    assert ops.calls["silu_and_mul"] == layers
    assert ops.calls["rmsnorm"] >= 1  # the first input norm (and the q / k norms)
    err = (fused - plain).norm() / plain.norm()
    assert err < 2e-2, err
    assert fused.argmax() == plain.argmax()


def test_rows_off_the_norm_kernels_alignment_take_the_torch_form(
        tiny_checkpoint: Callable[..., Path]) -> None:
    """FlashInfer's CuTe-DSL norms assume 16-byte aligned rows (a contiguous 2-D input:
    gcd(128, its row bytes)); a row sliced off a wider tensor at an odd offset is
    contiguous, yet starts elsewhere. Such an input takes the torch form (the kernel
    says None) and never reaches FlashInfer."""
    runner = _small_runner(tiny_checkpoint)
    ops = StandInOps()
    cuda_fused.install(runner.model, torch.bfloat16, ops)  # type: ignore[arg-type]
    norm = next(m for m in runner.model.modules() if isinstance(m, RMSNorm))
    ops.calls.clear()
    wide = torch.randn(4, 3 * 64, dtype=torch.bfloat16)  # rows of 384 B
    assert norm.kernel(wide[1:2, 64:128], None, 1e-6, None) is not None  # 512 B in
    assert norm.kernel(wide[1:2, 8:72], None, 1e-6, None) is None  # 400 B: 16, not 128
    assert norm.kernel(wide[1:3, 8:72], None, 1e-6, None) is not None  # strided: 16 B
    assert norm.kernel(wide[1:3, 4:68], None, 1e-6, None) is None  # 392 B: not even 16
    flat = torch.randn(3 * 64 + 8, dtype=torch.bfloat16)
    y, x = flat[4:4 + 64].view(1, 64), torch.randn(1, 64, dtype=torch.bfloat16)
    assert norm.add_kernel(y, x, None, 1e-6) is None  # 8 B in
    assert norm.add_kernel(flat[64:128].view(1, 64), x, None, 1e-6) is not None
    assert ops.calls["rmsnorm"] == 2 and ops.calls["fused_add_rmsnorm"] == 1
    runner.close()


def _small_runner(tiny_checkpoint: Callable[..., Path]) -> ModelRunner:
    """A bf16 qwen3 of head_dim 16 (a size FlashInfer's rope is not built for)."""
    path = tiny_checkpoint(arch="qwen3", dtype="bfloat16", hidden_size=64, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128)
    return ModelRunner(path, device="cpu", dtype="bfloat16", num_blocks=8, block_size=16,
                       max_num_seqs=2, backend="torch", max_batched_tokens=64)


def test_what_the_kernels_do_not_serve_keeps_the_torch_forms(
        tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _small_runner(tiny_checkpoint)
    model = runner.model
    assert cuda_fused.install(model, torch.float32, StandInOps()) == (  # type: ignore[arg-type]
        "norms, SiLU: torch (float32 weights)")
    line = cuda_fused.install(model, torch.bfloat16, StandInOps(fail=True))  # type: ignore[arg-type]
    assert line == "norms, SiLU: torch (FlashInfer's kernels failed: RuntimeError)"
    monkeypatch.setenv("HELEXA_CUDA_FUSED", "0")
    assert cuda_fused.install(model, torch.bfloat16, StandInOps()) == (  # type: ignore[arg-type]
        "norms, SiLU: torch (HELEXA_CUDA_FUSED=0)")
    assert all(m.kernel is None and m.add_kernel is None
               for m in model.modules() if isinstance(m, RMSNorm))
    runner.close()


@pytest.mark.parametrize(("arch", "head_dim"), [("qwen3", 64), ("qwen3_5", 64)])
def test_rope_runs_one_kernel_a_layer_and_agrees(
        tiny_checkpoint: Callable[..., Path], arch: str, head_dim: int) -> None:
    """q and k rotated together in place, once per attention layer, from an fp32 table: the
    logits are the torch form's to bf16 rounding; Qwen3.5's partial rotary (its leading
    quarter) included."""
    path = tiny_checkpoint(arch=arch, dtype="bfloat16", hidden_size=128, num_heads=2,
                           num_kv_heads=1, head_dim=head_dim, intermediate_size=128)

    def run(ops: StandInOps | None) -> tuple[torch.Tensor, str, ModelRunner]:
        runner = ModelRunner(path, device="cpu", dtype="bfloat16", num_blocks=8,
                             block_size=16, max_num_seqs=2, num_state_slots=2,
                             backend="torch", max_batched_tokens=64)
        line = "" if ops is None else cuda_fused.install_rope(
            runner.model, torch.bfloat16, ops)  # type: ignore[arg-type]
        if ops is not None:
            ops.calls.clear()  # the probe's
        logits = runner.execute([SeqInput([5, 9, 14, 3, 7, 21, 2], 0, [0, 1], True, 0)])
        logits = torch.cat([logits, runner.execute([SeqInput([11], 7, [0, 1], True, 0)])])
        runner.close()
        return logits.float(), line, runner

    plain, _, _ = run(None)
    ops = StandInOps()
    fused, line, runner = run(ops)
    assert line == "rope: FlashInfer kernel"
    rotary = runner.model.rotary
    assert rotary.cos_sin_cache is not None and rotary.cos_sin_cache.dtype == torch.float32
    assert rotary.cos_sin_cache.shape[1] == rotary.head_dim  # the rotary dims: a quarter
    assert ops.calls["apply_rope"] == 2 * len(runner.model.attention_layers)  # two steps
    err = (fused - plain).norm() / plain.norm()
    assert err < 2e-2, err
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_rope_the_kernel_cannot_serve_or_that_fails_its_probe_stays_torch(
        tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _small_runner(tiny_checkpoint)
    model = runner.model
    assert cuda_fused.install_rope(model, torch.bfloat16, StandInOps()) == (  # type: ignore[arg-type]
        "rope: torch (FlashInfer's rope does not take this dtype or head size)")  # 16
    monkeypatch.setattr(cuda_fused, "ROPE_HEAD_DIMS", (16,))
    assert cuda_fused.install_rope(model, torch.bfloat16, StandInOps(fail=True)) == (  # type: ignore[arg-type]
        "rope: torch (FlashInfer's rope failed: RuntimeError)")

    class Wrong(StandInOps):  # rotates by the wrong half: caught by the probe
        def apply_rope(self, positions, q, k, cache):  # type: ignore[no-untyped-def]
            super().apply_rope(positions, q, k, cache.flip(-1))

    line = cuda_fused.install_rope(model, torch.bfloat16, Wrong())  # type: ignore[arg-type]
    assert line.startswith("rope: torch (FlashInfer's rope is off by "), line
    assert model.rotary.kernel is None
    monkeypatch.setenv("HELEXA_CUDA_FUSED", "0")
    assert cuda_fused.install_rope(model, torch.bfloat16, StandInOps()) == (  # type: ignore[arg-type]
        "rope: torch (HELEXA_CUDA_FUSED=0)")
    assert model.rotary.kernel is None
    runner.close()
