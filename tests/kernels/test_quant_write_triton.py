"""A step's new K and V quantised into a quantised pool in one Triton launch
(helexa/kernels/cuda/quant_write.py), run on CPU tensors by Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET), against kernels/kv_quant.py's torch form byte
for byte: the rounding ties, fp8's subnormals and edge, int4's partial groups; its probe;
and the torch backend writing through it."""

from __future__ import annotations

import os

import pytest
import torch

from helexa.kernels import kv_quant
from helexa.kernels.cuda import quant_write as qw
from helexa.kernels.paged_kv import PagedKV

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))

CPU = torch.device("cpu")


def _both(kv_dtype: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
          blocks: int = 4, bs: int = 4) -> tuple[PagedKV, PagedKV]:
    """The pool the reference wrote and the one the kernel wrote."""
    n, kvh, d = k.shape
    pools = [PagedKV(blocks, bs, kvh, d, kv_dtype=kv_dtype, storage=None, compute=k.dtype,
                     device=CPU) for _ in range(2)]
    pools[0].write(slots, k, v)
    qw.write(pools[1], slots, k, v, interpret=True)
    return pools[0], pools[1]


def _same(want: PagedKV, got: PagedKV) -> None:
    for name in ("k_data", "k_scale", "v_data", "v_scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# the default run: each KV dtype from each activation dtype, every head layout at least
# twice, 9 of the 36 cases (interpreted, a case is ~1 s on a 2-core CPU); `-m slow` all
_WRITE_DEFAULT = {("int8", 64, torch.bfloat16), ("int8", 80, torch.float16),
                  ("int8", 33, torch.float32), ("fp8_e4m3", 80, torch.bfloat16),
                  ("fp8_e4m3", 33, torch.float16), ("fp8_e4m3", 128, torch.float32),
                  ("int4", 33, torch.bfloat16), ("int4", 128, torch.float16),
                  ("int4", 64, torch.float32)}


@pytest.mark.parametrize(("dtype", "kvh", "d", "kv_dtype"), [
    pytest.param(dtype, kvh, d, kv, marks=[pytest.mark.slow] * (
        (kv, d, dtype) not in _WRITE_DEFAULT), id=f"dtype{i}-{kvh}-{d}-{kv}")
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32))
    for kvh, d in ((2, 64), (1, 80), (3, 33), (2, 128))
    for kv in ("int8", "fp8_e4m3", "int4")])
def test_the_kernel_writes_the_references_bytes(kv_dtype, kvh, d, dtype):
    # the load probe's inputs: an all-zero token, one with a 1e4 outlier, rows at a stride
    assert qw.probe(CPU, kv_dtype, kvh, d, dtype, interpret=True) == ""


def test_fp8_encodes_every_value_and_every_tie_as_the_float8_cast_does():
    """A token-head whose amax is 448 has scale 1: its values reach the encoder as they are.
    Every e4m3 value, every midpoint between two neighbours (ties to even), and values just
    either side of each midpoint give the cast's bits."""
    exact = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (exact[1:] + exact[:-1]) / 2
    values = torch.cat([exact, mids, mids * (1 + 2**-12), mids * (1 - 2**-12),
                        torch.tensor([448.0, 2.0**-10, 2.0**-9 * 0.5, 2.0**-12])])
    values = torch.cat([values, -values])
    d = 128
    rows = -(-values.numel() // d)
    x = torch.zeros(rows * d)
    x[:values.numel()] = values
    x = x.view(rows, 1, d)
    x[:, 0, -1] = 448.0  # every row's amax: scale exactly 1
    want, got = _both("fp8_e4m3", x, x.clone(), torch.arange(rows), blocks=rows, bs=1)
    _same(want, got)
    assert torch.equal(want.k_scale, torch.ones_like(want.k_scale))


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_integer_formats_round_ties_to_even(kv_dtype):
    """Scale 1 (amax 127, or 7 in each int4 group): k + 0.5 rounds to the even neighbour, as
    torch.round does, and -0.5 to 0."""
    top = 127 if kv_dtype == "int8" else 7
    ties = torch.arange(-top, top).float() + 0.5
    # and just under a half, where adding 0.5 first would round up: torch.round gives 0, 1
    ties = torch.cat([torch.tensor([0.49999997, -0.49999997, 1.4999999]), ties])
    d = 32 if kv_dtype == "int4" else 256
    x = torch.zeros(2, 1, d)
    flat = x.view(-1)
    flat[:ties.numel()] = ties[:flat.numel()]
    x[:, 0, d - 1] = top  # every row's (and group's) amax
    want, got = _both(kv_dtype, x, x.clone(), torch.tensor([3, 1]))
    _same(want, got)


def test_scales_are_amax_times_the_reciprocal_on_every_device():
    """kv_quant's scale is amax * float32(1 / 127) (and 1/448, 1/7), what CUDA computes for
    a tensor divided by a number, so CPU, CUDA and the kernel agree bit for bit; amax / 127
    differs in the last bit for some amax (here, a few of 4,096)."""
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 100 + 0.01
    x = torch.zeros(4096, 1, 32)
    x[:, 0, 0] = amax
    for kv_dtype, c in (("int8", 127.0), ("fp8_e4m3", 448.0), ("int4", 7.0)):
        _, scale = kv_quant.quantize(x, kv_dtype)
        want = amax * torch.tensor(1.0 / c, dtype=torch.float32)
        assert torch.equal(scale[:, 0, 0], want), kv_dtype
        assert not torch.equal(want, amax / c)  # the division would store other scales


def test_the_probe_catches_a_wrong_or_failing_kernel(monkeypatch):
    real = qw.write

    def off_by_one(kv, slots, k, v, interpret=False):
        real(kv, slots, k, v, interpret)
        kv.v_data.view(-1)[5] ^= 1

    monkeypatch.setattr(qw, "write", off_by_one)
    assert qw.probe(CPU, "int8", 2, 64, torch.bfloat16, interpret=True) == (
        "the Triton quantised-KV write's v_data differs from the reference's")

    def broken(*a, **kw):
        raise RuntimeError("PTX: unsupported")

    monkeypatch.setattr(qw, "write", broken)
    assert qw.probe(CPU, "int8", 2, 64, torch.bfloat16, interpret=True) == (
        "the Triton quantised-KV write failed (RuntimeError: PTX: unsupported)")
    assert qw.chosen(CPU, "int8", 2, 64, torch.bfloat16) == (False, "")


def test_the_torch_backend_writes_through_the_kernel_and_reads_it_back():
    """With the kernel set (as the cuda backend sets it where its probe agreed) a step's new
    tokens land where and as the reference puts them: the pools are byte-equal and a
    dequantised read gives the tokens back to the format's rounding."""
    from helexa.checkpoint.layer_memory import AttentionSpec
    from helexa.kernels.backends.base import PrefillRow, StepPlan
    from helexa.kernels.backends.torch_ref import TorchBackend

    pools = []
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(6, h, 32, generator=gen).half() for h in (4, 2, 2))
    for kernel in (None, lambda *a: qw.write(*a, interpret=True)):
        backend = TorchBackend(CPU)
        backend.quant_write = kernel
        backend.allocate_kv([AttentionSpec(2, 32, "int4")], 8, 4, storage=None,
                            compute=torch.float16)
        step = StepPlan(slot_mapping=torch.tensor([9, 10, 11, 12, 13, 14]), block_size=4,
                        num_blocks=8, prefills=[PrefillRow(0, 6, 0, [2, 3])])
        backend.forward(0, q, k, v, backend.plan(step))
        pools.append(backend.pools[0])
    _same(*pools)
    back = kv_quant.gather_dequantized(pools[1].k_data, pools[1].k_scale,
                                       torch.arange(9, 15), "int4", 32, torch.float32)
    assert float((back - k.float()).abs().max()) < 0.2 * float(k.float().abs().max())
