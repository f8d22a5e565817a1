"""The grouped int8 decode kernel for CUDA (helexa/kernels/cuda/int8g.py), run on CPU tensors by
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before Triton is imported): the
same kernel source the card compiles, its dot on fp32 operands (the interpreter's one
difference, helexa/kernels/cuda/_int8g_triton.py ``operands``). Then the choice around it:
which steps take it, its probe, and what serves when the probe or Triton says no."""

from __future__ import annotations

import os

import pytest
import structlog
import torch

from helexa.kernels import quant as qk
from helexa.kernels.cuda import int8g as ci

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))


def _layer(n: int, k: int, group: int, dtype: torch.dtype, zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
    z = (torch.randn(n, k // group, generator=g) * 0.02).to(dtype) if zeros else None
    return q, s, z, g


# The default run takes 7 of the 54 cases (each interpreted case 0.3-4 s on a 2-core CPU):
# every group size, every row count, and each dtype at each way its steps read scales
# (_int8g_triton.grouping: fp32's 32-wide steps never take a scale per value); `-m slow`
# runs them all
_INT8G_DEFAULT = {(torch.float32, 32, 1), (torch.float32, 256, 3), (torch.bfloat16, 16, 16),
                  (torch.bfloat16, 256, 1), (torch.bfloat16, 96, 3), (torch.float16, 128, 3),
                  (torch.float16, None, 16)}


@pytest.mark.parametrize(("m", "group", "zeros", "dtype"), [
    pytest.param(m, group, zeros, dtype, marks=[pytest.mark.slow] * (
        (dtype, group, m) not in _INT8G_DEFAULT), id=f"{m}-{group}-{zeros}-dtype{i}")
    for m in (1, 3, 16)
    for group, zeros in ((16, True), (32, False), (128, True), (256, True), (96, False),
                         (None, False))
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16))])
def test_kernel_is_the_matmul_of_the_dequantised_weight(dtype, group, zeros, m):
    # 133 outputs: three blocks of 64, the last ragged; K about 1,344 inputs, whole groups:
    # 128-wide steps, the last ragged where K is not a multiple of 128; sms=8: K split in
    # spans (split_k). Groups of 16/32/128 tile a step, one of 256 spans two, 96 and a
    # whole row (None: per-channel scales) neither (each value's own scale)
    group = group or 1344
    n, k = 133, group * -(-1344 // group)
    q, s, z, g = _layer(n, k, group, dtype, zeros, seed=m + group)
    x = torch.randn(m, k, generator=g).to(dtype)
    assert ci.split_k(n, k, m, sms=8) >= 2
    y = ci.run(x, q, s, z, group, sms=8, interpret=True)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float() @ qk.dequantize_int8g(q, s, z, group).t()
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # the output's rounding to 16 bits
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_kernel_reads_rows_at_their_stride_and_agrees_with_the_tiles():
    # x a column slice of a wider tensor (a fused qkv's part): rows at a stride, each
    # contiguous; two spans of K; the tiles are the reference the card's probe uses
    q, s, z, g = _layer(70, 1024, 32, torch.float32, zeros=True, seed=7)
    wide = torch.randn(5, 3000, generator=g)
    x = wide[:, 1000:2024]
    assert not x.is_contiguous()
    y = ci.run(x, q, s, z, 32, sms=4, interpret=True)
    ref = qk.int8g_tiles(x.contiguous(), q, s, z, 32)  # fp32, summed in another order
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_a_decode_batch_of_several_row_blocks_and_a_weight_view():
    """40 rows (three blocks of 16, the last ragged) and a weight that is a view into a
    wider one (read at its own copy's row stride)."""
    q, s, z, g = _layer(70, 1024, 32, torch.bfloat16, zeros=False, seed=11)
    wide = torch.randint(-128, 128, (70, 1500), generator=g, dtype=torch.int8)
    wide[:, :1024] = q
    x = torch.randn(40, 1024, generator=g).to(torch.bfloat16)
    assert ci.ROWS >= 40
    y = ci.run(x, wide[:, :1024], s, z, 32, sms=4, interpret=True)
    ref = x.float() @ qk.dequantize_int8g(q, s, z, 32).t()
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())


@pytest.mark.parametrize("k", [640, 1280])  # a row of 5 steps of 128 (one scale a step);
def test_one_group_a_row_is_torchs_per_row_int8_op(k):  # 10 (K split in two spans)
    """Per-row int8 (quantize = "int8") runs on CUDA as this kernel with the row's scale its
    one group (helexa/kernels/quant.py int8_linear): torch's own op's product."""
    g = torch.Generator().manual_seed(k)
    q = torch.randint(-128, 128, (133, k), dtype=torch.int8, generator=g)
    s = torch.rand(133, generator=g) * 0.02 + 1e-3
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(ci.run(x, q, s[:, None], None, k, sms=8, interpret=True),
                               torch.ops.aten._weight_int8pack_mm(x, q, s), rtol=1e-4, atol=1e-4)


def test_each_group_size_reads_its_scales_the_cheapest_way():
    from helexa.kernels.cuda._int8g_triton import grouping

    assert [grouping(g, 128) for g in (16, 32, 64, 128)] == [1, 1, 1, 1]  # a load per group
    assert [grouping(g, 128) for g in (256, 17408)] == [2, 2]  # the step in one group
    assert [grouping(g, 128) for g in (96, 1344)] == [0, 0]  # a scale per value


def test_an_fp32_models_steps_are_shallower():
    # fp32 operands at 128-wide steps took 255 registers and spilled (sm90 build): 32
    assert ci.BLOCK_K_FP32 == 32
    assert ci.split_k(5120, 17408, 1, sms=132, block_k=ci.BLOCK_K_FP32) == 7
    assert ci.split_k(64, 1024, 1, sms=132, block_k=ci.BLOCK_K_FP32) == 8  # spans of 4 steps


def test_split_k_fills_the_card_and_keeps_spans_whole():
    # Qwen3.5-27B's down projection (5120 x 17408) at one row on an H100 (132 SMs):
    # 80 output blocks want 4 x 132 programs, so 7 spans of K (each 20 steps of 128)
    assert ci.split_k(5120, 17408, 1, sms=132) == 7
    # a wide layer already fills the card: K stays whole
    assert ci.split_k(248320, 5120, 1, sms=132) == 1
    # a short K is never cut below MIN_SPAN_BLOCKS steps a span
    assert ci.split_k(64, 1024, 1, sms=132) == 1024 // (ci.BLOCK_K * ci.MIN_SPAN_BLOCKS)
    assert ci.split_k(64, 256, 1, sms=132) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_passes_the_kernel_and_catches_a_wrong_one(dtype):
    cpu = torch.device("cpu")
    assert ci.probe(cpu, dtype, 32, True, qk.int8g_tiles, sms=4, interpret=True) == ""

    def off(x, q, s, z, group):  # a reference the kernel cannot match
        return qk.int8g_tiles(x, q, s, z, group) * 1.1

    why = ci.probe(cpu, dtype, 32, True, off, sms=4, interpret=True)
    assert why.startswith("the Triton kernel is off by")


class _Card:
    """linear() on CPU tensors as if on a card: the interpreter runs, no capture by default."""

    def __init__(self, monkeypatch, capturing: bool = False) -> None:
        self.tile_calls = 0
        monkeypatch.setattr(ci._verdicts, "_by_kind", {})
        monkeypatch.setattr(ci, "_sms", lambda index: 4)
        monkeypatch.setattr(ci, "_capturing", lambda: capturing)
        run = ci.run
        monkeypatch.setattr(ci, "run", lambda *a, **kw: run(*a[:6], interpret=True))
        self.run = run

    def tiles(self, *args):
        self.tile_calls += 1
        return qk.int8g_tiles(*args)


def test_a_decode_step_takes_the_kernel_once_it_has_proved_itself(monkeypatch):
    card = _Card(monkeypatch)
    q, s, z, g = _layer(70, 1024, 32, torch.float32, zeros=True, seed=3)
    x = torch.randn(2, 1024, generator=g)
    with structlog.testing.capture_logs() as logs:
        y = ci.linear(x, q, s, z, 32, card.tiles)
        ci.linear(x, q, s, z, 32, card.tiles)
    assert card.tile_calls == 2  # the probe's two references; the steps ran the kernel
    assert [e["event"] for e in logs] == ["kernels.cuda_grouped_matmul_chosen"]
    assert logs[0]["group"] == 32 and logs[0]["zeros"] is True
    ref = qk.int8g_tiles(x, q, s, z, 32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert ci.describe(torch.device("cpu")) == "grouped int8 decode: Triton kernel"
    # a prefill chunk (more than ROWS rows) keeps the tiles
    ci.linear(torch.randn(ci.ROWS + 1, 1024, generator=g), q, s, z, 32, card.tiles)
    assert card.tile_calls == 3


def test_a_kernel_that_fails_its_probe_leaves_that_kind_to_the_tiles(monkeypatch):
    card = _Card(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(ci, "run", broken)
    q, s, z, g = _layer(70, 1024, 32, torch.bfloat16, zeros=False, seed=4)
    x = torch.randn(1, 1024, generator=g).to(torch.bfloat16)
    with structlog.testing.capture_logs() as logs:
        y = ci.linear(x, q, s, z, 32, card.tiles)
        ci.linear(x, q, s, z, 32, card.tiles)
    assert [e["event"] for e in logs] == ["kernels.cuda_grouped_matmul_fallback"]
    assert logs[0]["reason"] == ("the Triton kernel failed (RuntimeError: out of shared memory)")
    assert card.tile_calls == 2  # both steps (the probe stopped at the failure)
    torch.testing.assert_close(y, qk.int8g_tiles(x, q, s, z, 32))
    assert ci.describe(torch.device("cpu")) == (
        "grouped int8 decode: dequantised tiles (the Triton kernel failed "
        "(RuntimeError: out of shared memory))")


def test_no_probe_inside_a_graph_capture(monkeypatch):
    # a probe reads its error back to the host, which a capture forbids: an unproved kind
    # captures the tiles and is probed at its next eager step
    card = _Card(monkeypatch, capturing=True)
    q, s, z, g = _layer(70, 1024, 32, torch.float32, zeros=False, seed=5)
    x = torch.randn(1, 1024, generator=g)
    ci.linear(x, q, s, z, 32, card.tiles)
    assert card.tile_calls == 1 and len(ci._verdicts) == 0


def test_without_triton_the_tiles_serve(monkeypatch):
    monkeypatch.setenv("HELEXA_TRITON_INT8G", "0")
    try:
        card = _Card(monkeypatch)
        q, s, z, g = _layer(70, 1024, 32, torch.float32, zeros=False, seed=6)
        ci.linear(torch.randn(1, 1024, generator=g), q, s, z, 32, card.tiles)
        assert card.tile_calls == 1 and len(ci._verdicts) == 0
        assert ci.describe(torch.device("cpu")) == (
            "grouped int8 decode: dequantised tiles (HELEXA_TRITON_INT8G=0)")
    finally:
        monkeypatch.delenv("HELEXA_TRITON_INT8G")


def test_a_layer_whose_own_build_fails_falls_back_and_says_why(monkeypatch):
    # the probe passed, then this layer's own shape failed to build: its kind takes the
    # tiles from then on (outside a capture), never failing the load or the step
    card = _Card(monkeypatch)
    q, s, z, g = _layer(70, 1024, 32, torch.float32, zeros=False, seed=8)
    x = torch.randn(1, 1024, generator=g)
    ci.linear(x, q, s, z, 32, card.tiles)  # proves itself
    monkeypatch.setattr(ci, "run", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("out of resources: shared memory")))
    with structlog.testing.capture_logs() as logs:
        y = ci.linear(x, q, s, z, 32, card.tiles)
    assert [e["event"] for e in logs] == ["kernels.cuda_grouped_matmul_fallback"]
    assert logs[0]["reason"] == ("the Triton kernel failed on a (70, 1024) layer "
                                 "(RuntimeError: out of resources: shared memory)")
    torch.testing.assert_close(y, qk.int8g_tiles(x, q, s, z, 32))
    assert ci.describe(torch.device("cpu")).startswith("grouped int8 decode: dequantised tiles")


@pytest.mark.parametrize("group", [256, 1792])  # a step in one group; one group a row
def test_a_span_past_k_reads_no_scale_past_its_row(group):
    # K = 1,792 cut into 3 spans of 640 (5 steps) covers 1,920: the last span's last step
    # lies past K, where a row has no group left. Its scale and zero must not be read: the
    # tensors here sit in a larger buffer whose next values are NaN (the last row's would
    # have read one), and the output must be the dequantised matmul's
    n, k = 64, 1792  # bf16: steps of 128 (fp32's are 32, whose spans end at K here)
    assert ci.split_k(n, k, 1, sms=8) == 3
    q, s, z, g = _layer(n, k, group, torch.bfloat16, zeros=True, seed=group)
    groups = k // group
    s_buf = torch.full((n * groups + 8,), float("nan"), dtype=torch.bfloat16)
    z_buf = torch.full((n * groups + 8,), float("nan"), dtype=torch.bfloat16)
    s_buf[:n * groups], z_buf[:n * groups] = s.flatten(), z.flatten()
    s_view, z_view = s_buf[:n * groups].view(n, groups), z_buf[:n * groups].view(n, groups)
    x = torch.randn(2, k, generator=g).to(torch.bfloat16)
    y = ci.run(x, q, s_view, z_view, group, sms=8, interpret=True).float()
    ref = x.float() @ qk.dequantize_int8g(q, s, z, group).t()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
