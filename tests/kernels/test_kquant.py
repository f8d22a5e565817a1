"""helexa/kernels/cpu/kquant.c against its plain-torch statements (helexa/kernels/cpu/kquant.py):
the activation quantised bit for bit as ``quantize_activation`` says, every build (plain C,
AVX2, VNNI: whichever this CPU has) within fp32 summation order of ``emulate`` (the same
integer arithmetic in fp64), and within the stated bound of the dequantised fp32 product.
GGUF blocks of each type go through gguf_unpack as the loader sends them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.gguf_reference import quantize

from helexa.kernels.cpu import kquant as kq
from helexa.kernels.cpu import native
from helexa.neuron.formats.gguf.unpack import UNPACKERS

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not kq.isas(), reason="no C compiler: no native kernels")]

# Each row's error against the fp32 product is at most sum_i |w_i| * dx_i / 2 (v rounds to
# the nearest unit dx = amax / VMAX); fp32 sums add a few ulps of sum |w| |x|.
SUM_ORDER = 1e-6  # relative to sum |w| |x|


def unpacked(typ: str, n: int, k: int, seed: int) -> kq.KqWeight:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).numpy()
    q, scale, zero = UNPACKERS[typ](quantize(w, typ))
    packed = kq.pack(q, scale, zero)
    assert packed is not None
    return packed


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_the_activation_is_quantised_as_the_torch_rule_says(rows):
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0  # an all-zero block: scale 0, values 0
    got = torch.empty(rows, 256, dtype=torch.int16)
    dx, sums = torch.empty(rows, 8), torch.empty(rows, 16)
    native.load().hx_kq_quantize(x.data_ptr(), rows, 256, got.data_ptr(), dx.data_ptr(),
                                 sums.data_ptr())
    v, want_dx = kq.quantize_activation(x)
    assert torch.equal(got, v)
    assert torch.equal(dx, want_dx)
    assert int(v.abs().max()) == int(kq.VMAX) and not v[0, :32].any()
    want_sums = (v.view(rows, 16, 16).sum(-1).float() * dx.repeat_interleave(2, dim=1))
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=0)


@pytest.mark.parametrize("typ", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])
def test_every_build_computes_the_torch_arithmetic(typ, rows):
    w = unpacked(typ, 40, 512, seed=rows)
    assert w.bits == (4 if typ == "Q4_K" else 8)  # Q4_K's nibbles stay nibbles
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(100 + rows))
    ref = kq.emulate(x, w).double()
    exact = x.double() @ kq.dequantize(w).double().t()
    w_abs = kq.dequantize(w).double().abs()
    scale = x.double().abs() @ w_abs.t()  # [rows, N]
    _, dx = kq.quantize_activation(x)
    bound = (dx.double().repeat_interleave(kq.XBLOCK, 1) / 2) @ w_abs.t()
    for isa in kq.isas():
        for threads in (1, 2):
            y = kq.native(isa, x, w, threads).double()
            assert ((y - ref).abs() <= SUM_ORDER * scale + 1e-12).all(), (isa, threads)
            assert ((y - exact).abs() <= bound + SUM_ORDER * scale).all(), (isa, threads)


@pytest.mark.parametrize(("bits", "group", "zeros", "k"), [
    (4, 32, True, 512), (4, 128, True, 512), (8, 16, False, 512), (8, 32, True, 512),
    (8, 256, True, 512), (8, 512, False, 512),
    (4, 64, True, 320), (8, 16, False, 96)])  # K no multiple of 128: the 512-bit loop's tail
def test_the_forms_the_loader_hands_over(bits, group, zeros, k):
    # GGUF's types, and the layouts of layers fusing several (int8 at 16 with zeros) or
    # per-channel ones; a 4-bit form keeps its values exactly
    g = torch.Generator().manual_seed(group)
    n = 24
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01
    z = torch.randn(n, k // group, generator=g) * 0.05 if zeros else None
    w = kq.pack(q, s, z)
    assert w is not None and w.bits == bits and torch.equal(kq.values(w).long(), q)
    x = torch.randn(4, k, generator=g)
    scale = (x.double().abs() @ kq.dequantize(w).double().abs().t())
    for isa in kq.isas():
        err = (kq.native(isa, x, w, 1).double() - kq.emulate(x, w).double()).abs()
        assert (err <= SUM_ORDER * scale + 1e-12).all(), isa


def test_shapes_the_kernel_does_not_take_stay_with_the_callers_op():
    q = torch.randint(0, 16, (8, 48))
    assert kq.pack(q, torch.ones(8, 3), None) is None  # K not whole blocks of 32
    assert kq.pack(torch.randint(0, 16, (8, 64)), torch.ones(8, 8), None) is None  # groups of 8


def test_prefill_and_decode_rows_take_their_buckets_measured_kind(monkeypatch):
    w = unpacked("Q4_K", 64, 256, seed=1)
    layer = kq.KQuantLinear(torch.nn.Module(), w)
    layer.prepare(8)
    x = torch.randn(20, 256)
    for rows in (1, 20):  # a decode row; a prefill chunk (its own bucket, measured too)
        kind, threads = kq.choice(w, rows)
        assert kind in kq.KINDS and (kind != "int8g" or rows <= kq.NATIVE_MAX_ROWS)
        torch.testing.assert_close(layer(x[:rows], None), kq.run(kind, x[:rows], w, threads),
                                   rtol=0, atol=0)
        assert np.isclose(float((layer(x[:rows], None) - kq.tiles(x[:rows], w)).abs().max()),
                          0, atol=1e-3)
    assert {c.split(" (")[1] for c in kq.chosen()} >= {"1 row)", "2-8 rows)", "prefill)"}
    monkeypatch.setenv("HELEXA_CPU_KQUANT", "tile")  # forced: the tiles, whatever the rows
    torch.testing.assert_close(layer(x, None), kq.tiles(x, w), rtol=0, atol=0)


def test_a_short_prefill_takes_the_native_passes_when_they_cost_less_than_tiles(monkeypatch):
    """The prefill bucket is measured at 64 rows; a chunk of 16 whose two passes of 8 rows
    measured cheaper than that tile call runs natively, one of 40 (five passes) on tiles."""
    w = unpacked("Q4_K", 64, 256, seed=2)
    threads = torch.get_num_threads()
    few, prefill = kq._key(w, 1, threads), kq._key(w, 2, threads)
    build = kq.isas()[-1]
    monkeypatch.setitem(kq._choices, prefill, ("tile", 0))
    # 2-8 rows: int8g.c fastest (no passes beyond 8 rows), then the native build
    monkeypatch.setitem(kq._times, few, {("int8g", 1): 250.0, (build, 1): 300.0, ("tile", 0): 900})
    monkeypatch.setitem(kq._times, prefill, {("tile", 0): 1000.0, (build, 1): 2400.0})
    monkeypatch.setitem(kq._choices, few, ("int8g", 1))
    assert kq.choice(w, 16) == (build, 1)
    assert kq.choice(w, 40) == ("tile", 0)
    assert kq.choice(w, 4) == ("int8g", 1)  # decode rows keep their bucket's winner
    kq._times[few][build, 1] = 600.0  # two passes no longer pay
    assert kq.choice(w, 16)[0] == "tile"
    kq._times[few][build, 1] = 300.0
    x = torch.randn(16, 256)
    layer = kq.KQuantLinear(torch.nn.Module(), w)
    torch.testing.assert_close(layer(x, None), kq.run(build, x, w, 1), rtol=0, atol=0)
