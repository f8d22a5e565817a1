"""The Triton source of helexa/kernels/cuda/conv_decode.py's kernel (imported only where Triton is).

One program takes one decode row and a block of its channels: it reads the row's window
(the last K - 1 inputs of each channel) from the row's state slot, sums it and the new
input against the depthwise weight in fp32, writes SiLU of the sum, and writes the window
back in place shifted by the new input. Every load precedes every store it feeds.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def conv_decode_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, y_ptr, C, stride_x,  # noqa: ANN001
                       stride_y, stride_slot,
                       K: tl.constexpr, KW: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    offs_j = tl.arange(0, KW)  # the window's K - 1 taps, padded to a power of two
    in_j = offs_j < K - 1
    slot = tl.load(slots_ptr + row).to(tl.int64)
    window = pool_ptr + slot * stride_slot + offs_c * (K - 1)  # [BLOCK_C]: each channel's
    taps = window[:, None] + offs_j[None, :]
    both = in_c[:, None] & in_j[None, :]
    old = tl.load(taps, mask=both, other=0.0)
    x = tl.load(x_ptr + row * stride_x + offs_c, mask=in_c, other=0.0)
    w = tl.load(w_ptr + offs_c[:, None] * K + offs_j[None, :], mask=both, other=0.0)
    w_new = tl.load(w_ptr + offs_c * K + (K - 1), mask=in_c, other=0.0)
    acc = tl.sum(old.to(tl.float32) * w.to(tl.float32), 1) + x.to(tl.float32) * w_new.to(
        tl.float32)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + row * stride_y + offs_c, y.to(y_ptr.dtype.element_ty), mask=in_c)
    # the window shifted by one: tap j - 1 takes tap j, the last takes the new input
    tl.store(taps - 1, old, mask=both & (offs_j[None, :] >= 1))
    tl.store(window + (K - 2), x.to(pool_ptr.dtype.element_ty), mask=in_c)


@functools.cache
def build(interpret: bool) -> Any:
    """The kernel compiled for the device, or run by Triton's interpreter on CPU tensors."""
    keep = {"do_not_specialize_on_alignment": ["x_ptr"]}
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(conv_decode_kernel, **keep)
    return triton.jit(conv_decode_kernel, **keep)
