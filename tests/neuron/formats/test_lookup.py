"""A quantised embedding table's rows (helexa/neuron/formats/methods.py Int8gLookup): the
dequantised table's rows bit for bit, on the fp32 path a decode step takes and on torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helexa.neuron.formats.methods import Int8gLookup


def _table(zeros: bool) -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(int(zeros))
    vocab, hidden, group = 50, 64, 16
    mod = nn.Module()
    mod.register_buffer("qweight", torch.randint(-128, 128, (vocab, hidden), dtype=torch.int8,
                                                 generator=g))
    mod.register_buffer("qscales", torch.rand(vocab, hidden // group, generator=g) * 0.02)
    table = mod.qweight.view(vocab, -1, group).float() * mod.qscales.unsqueeze(-1)
    if zeros:
        mod.register_buffer("qzeros", torch.randn(vocab, hidden // group, generator=g) * 0.1)
        table = table + mod.qzeros.unsqueeze(-1)
    return mod, table.view(vocab, hidden)


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 4)])
def test_the_rows_are_the_dequantised_tables_rows(zeros, shape):
    mod, table = _table(zeros)
    ids = torch.randint(0, 50, shape, generator=torch.Generator().manual_seed(len(shape)))
    lookup = Int8gLookup(mod, 16)
    with torch.inference_mode():
        got = lookup(ids, torch.float32)
        assert got.dtype == torch.float32 and got.shape == (*shape, 64)
        assert torch.equal(got, table[ids])
        # bf16 takes torch's ops: the same rows, rounded once at the end of each product
        low = lookup(ids, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), table[ids], rtol=2e-2, atol=2e-2)
