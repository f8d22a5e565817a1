"""A hybrid layer's causal conv1d decode step on CUDA in one kernel (Triton).

helexa/kernels/gated_delta.py's ``conv1d_decode_slots``, the reference, gathers each
decode row's window from its state slot, concatenates the new input, scatters the shifted
window back, multiplies, sums and applies SiLU: six kernels a linear-attention layer a
step (about 290 a step for the 48 such layers of Qwen3.5-27B, each a few microseconds on
the device even inside a CUDA graph). This kernel
(helexa/kernels/cuda/_conv_decode_triton.py) does all of it in one launch, reading and
writing each window in its slot. Its sum is in fp32 where the reference rounds each
product to the model's dtype first: equal in fp32, to the dtype's rounding in bf16.

The state backend (helexa/kernels/backends/gdn.py) runs it where :func:`probe` agreed on
the device at load (a seeded step at the layers' sizes against the reference, windows
included), else the reference, the reason logged as ``kernels.cuda_conv_fallback``. No
Triton (a CPU-only install) or ``HELEXA_TRITON_CONV=0``: the reference. The tests run the
kernel's source on CPU through Triton's interpreter. It is unmeasured on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from helexa.kernels import cuda as cuda_kernels
from helexa.kernels import gated_delta as gd

BLOCK_C = 128  # channels a program: a row of Qwen3.5-27B's 10,240 conv channels is 80 programs
_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def unavailable() -> str:
    """"" where the kernel can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_CONV", "_conv_decode_triton")


def conv1d_decode_slots(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """As gated_delta.conv1d_decode_slots: x [B, C] (rows at any stride, channels
    contiguous); weight [C, K]; pool [slots, C, K - 1], row b's window at ``slots[b]``
    (read, then written back in place) -> [B, C] in x's dtype."""
    from helexa.kernels.cuda import _conv_decode_triton

    b, c = x.shape
    k = weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(b, c, dtype=x.dtype, device=x.device)
    if b == 0:
        return y
    assert pool.is_contiguous() and weight.is_contiguous() and k >= 2
    grid = (b, -(-c // BLOCK_C))
    _conv_decode_triton.build(interpret)[grid](
        x, weight, pool, slots, y, c, x.stride(0), y.stride(0), pool.stride(0),
        K=k, KW=cuda_kernels.pow2(k - 1, 2), BLOCK_C=BLOCK_C)
    return y


def probe(device: torch.device, channels: int, kernel: int, dtype: torch.dtype,
          interpret: bool = False) -> str:
    """A seeded decode step of 3 rows (slots out of order, the rows at a stride) at a
    layer's sizes against the reference: the outputs, and every window after, within the
    dtype's tolerance: "" ; else why not (a failure of the kernel included)."""
    gen = torch.Generator().manual_seed(channels)
    wide = torch.randn(3, channels + 40, generator=gen).to(device, dtype)
    x = wide[:, 7:7 + channels]  # rows at a stride, as a layer's in_proj split gives them
    weight = torch.randn(channels, kernel, generator=gen).to(device, dtype)
    pool = torch.randn(6, channels, kernel - 1, generator=gen).to(device, dtype)
    slots = torch.tensor([4, 0, 2], device=device)
    want_pool = pool.clone()
    want = gd.conv1d_decode_slots(x, weight, want_pool, slots).float()
    try:
        got = conv1d_decode_slots(x, weight, pool, slots, interpret).float()
    except Exception as e:  # noqa: BLE001 - any failure: the reference serves, said why
        return f"the Triton conv1d decode failed ({type(e).__name__}: {e})"
    tol = _TOL.get(dtype, 1e-2)
    err = float((got - want).norm() / want.norm())
    if err >= tol:
        return f"the Triton conv1d decode is off by {err:.2g} (relative; {tol} allowed)"
    if not torch.equal(pool, want_pool):
        return "the Triton conv1d decode left other windows than the reference's"
    return ""


def chosen(device: torch.device, channels: int, kernel: int, dtype: torch.dtype
           ) -> tuple[Callable[..., torch.Tensor], str]:
    """The conv1d decode step for layers of these sizes on ``device``: this kernel where
    its probe agreed, else the reference; and why the kernel was refused ("" where it
    serves, or could never run here: no CUDA device, no Triton)."""
    if device.type != "cuda" or unavailable():
        return gd.conv1d_decode_slots, ""
    why = probe(device, channels, kernel, dtype)
    return (gd.conv1d_decode_slots, why) if why else (conv1d_decode_slots, "")
