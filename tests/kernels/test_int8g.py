"""The grouped int8 op (helexa/kernels/quant.py): the matmul of its dequantised weight, on the torch
tiles and on the native kernels of helexa/kernels/cpu/int8g.c (every build this CPU has)."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels import quant as qk
from helexa.kernels.cpu import int8g as int8g_cpu
from helexa.kernels.cpu import native as cpu_native
from helexa.kernels.cuda import int8g as int8g_cuda


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("tile_bytes", [qk.INT8G_TILE_BYTES, 3000])  # one tile; ragged tiles
def test_int8g_linear_is_the_matmul_of_its_dequantised_weight(zeros: bool, tile_bytes: int,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(qk, "INT8G_TILE_BYTES", tile_bytes)
    monkeypatch.setenv("HELEXA_CPU_INT8G", "tile")  # the reference path, whatever is faster
    g = torch.Generator().manual_seed(1)
    n, k, group = 70, 96, 16
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.02
    z = torch.randn(n, k // group, generator=g) * 0.02 if zeros else None
    bias = torch.randn(n, generator=g)
    x = torch.randn(2, 3, k, generator=g)
    w = qk.dequantize_int8g(q, s, z, group)
    assert w[0, :group].tolist() == (q[0, :group].float() * s[0, 0]
                                     + (z[0, 0] if z is not None else 0)).tolist()
    y = qk.int8g_linear(x, q, s, z, group, bias)
    torch.testing.assert_close(y, x @ w.t() + bias, rtol=1e-5, atol=1e-5)


lib = cpu_native.load()
NATIVE = int8g_cpu.isas(lib) if lib is not None else []
needs_lib = pytest.mark.skipif(lib is None, reason="no C compiler: the native kernels are off")


def _layer(n: int, k: int, group: int, dtype: torch.dtype, zeros: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02).to(dtype)
    z = (torch.randn(n, k // group, generator=g) * 0.02).to(dtype) if zeros else None
    return q, s, z, g


@needs_lib
@pytest.mark.parametrize("isa", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11])
def test_native_equals_the_dequantised_matmul(isa, dtype, group, m):
    # 37 rows: ragged against every row block (4, 2); K spans of whole groups end ragged too
    # (X_SPAN_FLOATS / (m * group) groups a span); 11 rows: a second pass of x rows
    n, k = 37, group * (70 if group < 128 else 10)
    q, s, z, g = _layer(n, k, group, dtype, zeros=m % 2 == 1, seed=m * 100 + group)
    x = torch.randn(m, k, generator=g).to(dtype)
    y = int8g_cpu.native(lib, isa, x, q, s, z, group)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float() @ qk.dequantize_int8g(q, s, z, group).t()  # fp32 math on the same values
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@needs_lib
@pytest.mark.parametrize("kind", ["tile", *NATIVE])
def test_the_op_gives_the_same_products_whichever_kernel_serves_it(kind, monkeypatch):
    monkeypatch.setenv("HELEXA_CPU_INT8G", kind)
    q, s, z, g = _layer(40, 256, 32, torch.float32, zeros=True, seed=5)
    bias = torch.randn(40, generator=g)
    for rows in (1, 4, 9):  # 9: past NATIVE_MAX_ROWS, the tiles whatever was asked
        x = torch.randn(rows, 256, generator=g)
        torch.testing.assert_close(qk.int8g_linear(x, q, s, z, 32, bias),
                                   qk.int8g_tiles(x, q, s, z, 32) + bias, rtol=1e-5, atol=1e-5)


@needs_lib
def test_a_group_the_native_lanes_do_not_divide_falls_back_to_the_tiles(monkeypatch):
    monkeypatch.setenv("HELEXA_CPU_INT8G", NATIVE[-1] if NATIVE else "tile")
    q, s, z, g = _layer(8, 72, 24, torch.float32, zeros=False, seed=6)  # 24: not 8 or 16 lanes
    x = torch.randn(1, 72, generator=g)
    torch.testing.assert_close(qk.int8g_linear(x, q, s, z, 24, None),
                               x @ qk.dequantize_int8g(q, s, z, 24).t(), rtol=1e-5, atol=1e-5)


def test_the_choice_is_measured_once_per_shape_and_bucket(monkeypatch):
    monkeypatch.delenv("HELEXA_CPU_INT8G", raising=False)
    monkeypatch.setattr(int8g_cpu, "_choices", {})
    q, s, z, g = _layer(16, 64, 16, torch.float32, zeros=True, seed=7)
    for rows in (1, 1, 3, 8):
        qk.int8g_linear(torch.randn(rows, 64, generator=g), q, s, z, 16, None)
    expected = 2 if lib is not None else 0  # one row; 2-8 rows
    assert len(int8g_cpu._choices) == expected
    assert {kind for kind, _ in int8g_cpu._choices.values()} <= {"tile", *NATIVE}


def test_a_bad_override_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("HELEXA_CPU_INT8G", "avx9")
    q, s, z, g = _layer(8, 32, 16, torch.float32, zeros=False, seed=8)
    if not NATIVE:
        pytest.skip("no native build for this CPU: the override is never read")
    with pytest.raises(ValueError, match="HELEXA_CPU_INT8G='avx9'"):
        qk.int8g_linear(torch.randn(1, 32, generator=g), q, s, z, 16, None)


def test_kernels_off_serves_the_tiles(monkeypatch):
    monkeypatch.setenv("HELEXA_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_native, "_tried", False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(int8g_cpu, "native", None)  # would raise if reached
    q, s, z, g = _layer(8, 32, 16, torch.float32, zeros=True, seed=9)
    x = torch.randn(1, 32, generator=g)
    torch.testing.assert_close(qk.int8g_linear(x, q, s, z, 16, None),
                               x @ qk.dequantize_int8g(q, s, z, 16).t(), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("isa", NATIVE)
def test_rows_split_over_threads_give_the_same_products(isa):
    # 203 x 4096 int8: 812 KiB, three threads' worth (MIN_THREAD_BYTES 256 KiB), ragged split
    q, s, z, g = _layer(203, 4096, 32, torch.float32, zeros=True, seed=10)
    x = torch.randn(5, 4096, generator=g)
    ref = x @ qk.dequantize_int8g(q, s, z, 32).t()
    for threads in (1, 3, 8):
        y = int8g_cpu.native(lib, isa, x, q, s, z, 32, threads=threads)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_per_row_int8_off_the_cpu_runs_as_grouped_int8_of_one_group_a_row(monkeypatch) -> None:
    """On CUDA torch's per-row int8 op gives each output a thread reading its weight row
    alone: every step goes to the grouped int8 op instead (the Triton kernel for a decode
    step's rows), the row's scale its one group. Where that kernel does not serve, a decode
    step's few rows keep torch's op and more take the tiles, which give the same product.
    The device is meta here, standing in for CUDA; the products are compared on the CPU."""
    calls: list[tuple[int, tuple[int, ...], int]] = []
    ops: list[int] = []

    def not_served(x, q, s, z, group, fallback):  # the kernel off: its fallback runs
        calls.append((x.shape[0], tuple(s.shape), group))
        return fallback(x, q, s, z, group)

    real_op = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(int8g_cuda, "linear", not_served)
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm",
                        lambda x, q, s: ops.append(x.shape[0]) or real_op(x, q, s))
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (40, 64), dtype=torch.int8, generator=g)
    s = torch.rand(40, generator=g) * 0.02
    for rows in (1, qk.INT8_CUDA_OP_ROWS, qk.INT8_CUDA_OP_ROWS + 1, 300):
        y = qk.int8_linear(torch.randn(rows, 64, device="meta"), q.to("meta"), s.to("meta"), None)
        assert y.shape == (rows, 40) and y.device.type == "meta"
    assert [c[0] for c in calls] == [1, 8, 9, 300] and {c[1:] for c in calls} == {((40, 1), 64)}
    assert ops == [1, qk.INT8_CUDA_OP_ROWS]  # 9 and 300 rows: the tiles
    monkeypatch.undo()
    x = torch.randn(5, 64, generator=g)  # the grouped forms' product is the op's
    want = torch.ops.aten._weight_int8pack_mm(x, q, s)
    torch.testing.assert_close(qk.int8g_tiles(x, q, s[:, None], None, 64), want,
                               rtol=1e-5, atol=1e-5)  # the kernel's: test_int8g_triton.py
