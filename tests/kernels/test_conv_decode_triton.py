"""A hybrid layer's conv1d decode step in one Triton launch (helexa/kernels/cuda/conv_decode.py),
run on CPU tensors by Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), against
the torch form it replaces on CUDA; its probe; the state backend's choice; and a whole
hybrid model's decode steps with it."""

from __future__ import annotations

import os

import pytest
import torch

from helexa.kernels import gated_delta as gd
from helexa.kernels.cuda import conv_decode as cd

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("channels", "kernel"), [(300, 4), (128, 4), (70, 3), (40, 2), (33, 6)])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_kernel_is_the_torch_form(dtype, channels, kernel, rows):
    # outputs equal to the dtype's rounding (fp32 sums, where the torch form rounds each
    # product first); the windows after, every slot's, exactly; rows at a stride, slots
    # out of order, channels ragged against the 128-channel blocks
    g = torch.Generator().manual_seed(channels * kernel + rows)
    x = torch.randn(rows, channels + 9, generator=g).to(dtype)[:, 5:5 + channels]
    weight = torch.randn(channels, kernel, generator=g).to(dtype)
    pool = torch.randn(5, channels, kernel - 1, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4][:rows])
    want_pool = pool.clone()
    want = gd.conv1d_decode_slots(x, weight, want_pool, slots)
    got = cd.conv1d_decode_slots(x, weight, pool, slots, interpret=True)
    assert got.dtype == dtype and got.shape == (rows, channels)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(pool, want_pool)


def test_the_probe_passes_the_kernel_and_catches_a_wrong_one(monkeypatch):
    cpu = torch.device("cpu")
    assert cd.probe(cpu, 300, 4, torch.bfloat16, interpret=True) == ""
    real = cd.conv1d_decode_slots

    def off(x, weight, pool, slots, interpret=False):
        return real(x, weight, pool, slots, interpret) * 1.1

    monkeypatch.setattr(cd, "conv1d_decode_slots", off)
    assert cd.probe(cpu, 300, 4, torch.bfloat16, interpret=True).startswith(
        "the Triton conv1d decode is off by")

    def no_shift(x, weight, pool, slots, interpret=False):  # right sums, windows untouched
        return gd.conv1d_decode_slots(x, weight, pool.clone(), slots)

    monkeypatch.setattr(cd, "conv1d_decode_slots", no_shift)
    assert cd.probe(cpu, 300, 4, torch.float32, interpret=True) == (
        "the Triton conv1d decode left other windows than the reference's")


def test_the_choice_runs_the_kernel_only_on_cuda_where_it_agreed(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert cd.chosen(cpu, 300, 4, torch.bfloat16) == (gd.conv1d_decode_slots, "")
    monkeypatch.setattr(cd, "probe", lambda *a: "")
    assert cd.chosen(cuda, 300, 4, torch.bfloat16) == (cd.conv1d_decode_slots, "")
    monkeypatch.setattr(cd, "probe", lambda *a: "the Triton conv1d decode failed (X)")
    assert cd.chosen(cuda, 300, 4, torch.bfloat16) == (
        gd.conv1d_decode_slots, "the Triton conv1d decode failed (X)")
    monkeypatch.setenv("HELEXA_TRITON_CONV", "0")
    try:
        assert cd.chosen(cuda, 300, 4, torch.bfloat16) == (gd.conv1d_decode_slots, "")
    finally:
        monkeypatch.delenv("HELEXA_TRITON_CONV")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_hybrid_decodes_the_same_with_the_kernel(tiny_checkpoint, dtype):
    """A whole hybrid model (qwen3_5): prefill, then decode steps of two rows with each
    linear-attention layer's conv on the kernel, against the torch form, the same tokens
    fed to both: fp32 logits equal to summation order, bf16's to its rounding carried over
    six steps; and the backend line says which runs."""
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

    path = tiny_checkpoint("qwen3_5", dtype=dtype)
    runs = []
    for kernel in (False, True):
        r = ModelRunner(path, num_blocks=16, block_size=8, max_num_seqs=2,
                        max_batched_tokens=64, num_state_slots=2, backend="torch")
        calls: list[int] = []
        if kernel:
            def counted(*args, _calls=calls):
                _calls.append(args[0].shape[0])
                return cd.conv1d_decode_slots(*args, interpret=True)

            r.linear_states._conv_decode = counted
            assert r.linear_states.describe().endswith("conv1d decode Triton, one launch")
        else:
            assert r.linear_states.describe().endswith("conv1d decode torch")
        a, b = list(range(1, 10)), list(range(20, 25))
        out = [r.execute([SeqInput(a, 0, [0, 1], True, 0), SeqInput(b, 0, [2, 3], True, 1)])]
        for i in range(5):
            out.append(r.execute([SeqInput([30 + i], 9 + i, [0, 1], True, 0),
                                  SeqInput([40 + i], 5 + i, [2, 3], True, 1)]))
        runs.append(out)
        r.close()
        if kernel:  # every linear-attention layer's decode rows, each decode step
            layers = sum(1 for t in r.model.cfg.layer_types if t == "linear_attention")
            assert calls == [2] * (5 * layers), calls
    for plain, fused in zip(*runs, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
        else:
            assert (fused - plain).abs().max() <= 0.05 * plain.abs().max()
