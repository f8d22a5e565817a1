"""int4 products of many rows on CUDA (helexa/kernels/cuda/int4_tiles.py): the weight torch's
CUDA op packed, dequantised in tiles by a Triton kernel run here on CPU tensors through
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), over a replica of torch's
CUDA packing (tests/support/tinygemm.py); its probe; and which rows take it."""

from __future__ import annotations

import os

import pytest
import torch
from support import tinygemm

from helexa.kernels import quant as qk
from helexa.kernels.cuda import int4_tiles as it

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))


def _layer(n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    z = torch.randn(n, k // group, generator=gen) * 0.01
    sz = torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]
    want = (q.float() - 8) * sz[..., 0].float().t().repeat_interleave(group, 1) + \
        sz[..., 1].float().t().repeat_interleave(group, 1)
    return q, sz, want


@pytest.mark.parametrize(("inner", "group"), [(8, 128), (4, 32), (2, 64), (8, 256)])
def test_the_kernel_dequantises_torchs_cuda_packing(inner, group):
    """Every value back at its row and column, whatever the inner k-tiling: 48 rows (six
    tiles of 8), K of two super-tiles or more, a tile starting mid-layer."""
    n, k = 48, 2 * max(group, inner * 16)
    q, sz, want = _layer(n, k, group, seed=inner + group)
    packed = tinygemm.pack(q, inner)
    assert packed.shape == (n // 8, k // (inner * 16), 32, inner // 2)
    # to bf16's rounding (Triton's interpreter casts to bf16 by truncating: one unit apart)
    got = it.dequantize(packed, sz, 0, n, group, interpret=True)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-6)
    part = it.dequantize(packed, sz, 16, 40, group, interpret=True).float()
    torch.testing.assert_close(part, want[16:40], rtol=8e-3, atol=1e-6)


def test_a_prefill_chunk_is_the_matmul_of_the_dequantised_tiles(monkeypatch):
    """x @ W^T over tiles of the weight (three here, the last ragged), each multiplied whole."""
    q, sz, want = _layer(40, 256, 128, seed=3)
    monkeypatch.setattr(it, "TILE_BYTES", 16 * 256 * 2)  # 16 rows a tile
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = it.tiled(x, tinygemm.pack(q, 8), 128, 40, sz, interpret=True)
    torch.testing.assert_close(got.float(), (x.float() @ want.bfloat16().float().t()),
                               rtol=2e-2, atol=2e-2)


def test_the_probe_passes_torchs_packing_and_catches_another(monkeypatch):
    for inner, group in ((8, 128), (4, 32)):
        assert it.probe(torch.device("cpu"), group, inner, tinygemm.pack, interpret=True) == ""

    def swapped(q, inner):  # each byte's nibbles the other way round: a wrong layout
        return tinygemm.pack(torch.cat([q[:, 1::2], q[:, ::2]], 1)
                             .view(q.shape[0], 2, -1).transpose(1, 2).reshape(q.shape), inner)

    why = it.probe(torch.device("cpu"), 128, 8, swapped, interpret=True)
    assert why.startswith("the Triton int4 dequantisation is off by"), why


def test_more_rows_than_a_decode_step_take_the_tiles_where_they_proved_themselves(monkeypatch):
    """torch's op for up to ROWS rows (and in a graph capture); beyond, the tiles, once this
    kind's probe agreed; where it did not, torch's op. The device is meta here, standing in
    for CUDA."""
    calls: list[str] = []
    monkeypatch.setattr(it, "tiled", lambda x, *a: calls.append(f"tiles {x.shape[0]}") or
                        torch.zeros(x.shape[0], 40, device=x.device))
    monkeypatch.setattr(it, "verdict", lambda device, group, inner, pack: verdicts[group])
    verdicts = {128: "", 32: "off"}

    def op(x, packed, group, sz):
        calls.append(f"op {x.shape[0]}")
        return torch.zeros(x.shape[0], 40, device=x.device)

    packed, sz = torch.zeros(5, 2, 32, 4, dtype=torch.int32, device="meta"), None
    for rows, group in ((1, 128), (it.ROWS, 128), (it.ROWS + 1, 128), (300, 32)):
        it.linear(torch.zeros(rows, 256, device="meta"), packed, group, 40, sz, op, None)
    assert calls == ["op 1", f"op {it.ROWS}", f"tiles {it.ROWS + 1}", "op 300"]
    # and qk.int4_linear off the CPU goes through it
    seen = []
    monkeypatch.setattr(it, "linear", lambda x, *a: seen.append(x.shape) or
                        torch.zeros(x.shape[0], 40, device=x.device))
    y = qk.int4_linear(torch.zeros(2, 3, 256, device="meta"), packed, 128, 40,
                       torch.zeros(2, 40, 2, dtype=torch.bfloat16, device="meta"), None)
    assert y.shape == (2, 3, 40) and seen == [(6, 256)]


def test_the_backend_line_says_what_serves_int4_prefill(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(it._verdicts, "_by_kind", {(dev, 128, 8): "", (dev, 32, 4): "off by 2"})
    assert it.describe(dev) == ("int4 prefill: dequantised tiles on cuBLAS; "
                                "int4 prefill: torch's op (off by 2)")
    assert it.describe(torch.device("cuda", 1)) == ""  # nothing proved on that card
    monkeypatch.setenv("HELEXA_TRITON_INT4", "0")
    assert it.describe(dev) == "int4 prefill: torch's op (HELEXA_TRITON_INT4=0)"
