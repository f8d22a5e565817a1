"""The grouped int8 op (kernels/quant.py): the matmul of its dequantised weight."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels import quant as qk


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("tile_bytes", [qk.INT8G_TILE_BYTES, 3000])  # one tile; ragged tiles
def test_int8g_linear_is_the_matmul_of_its_dequantised_weight(zeros: bool, tile_bytes: int,
                                                               monkeypatch) -> None:
    monkeypatch.setattr(qk, "INT8G_TILE_BYTES", tile_bytes)
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
