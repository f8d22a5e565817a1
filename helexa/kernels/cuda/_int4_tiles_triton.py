"""The Triton source of helexa/kernels/cuda/int4_tiles.py's kernel (imported only where
Triton is): torch's CUDA int4 weight, as ``_convert_weight_to_int4pack`` packed it for its
tensor-core op (tinygemm's m16n8k16 B layout), dequantised to a row-major tile.

The packed tensor is [N / 8, K / (INNER * 16), 32, INNER / 2] int32. Word (nt, ko, t, j)
holds eight 4-bit values of weight row ``nt * 8 + t // 4``, from the 16 bytes (32 values)
of k-tiles ``ko * INNER + 2j`` and the one after: the bytes at offsets t % 4, t % 4 + 4,
8 + t % 4 and 12 + t % 4 (b0..b3), each byte's high nibble the even k, its low nibble the
odd one, laid out low bits first as b0hi, b1hi, b2hi, b3hi, b0lo, b1lo, b2lo, b3lo
(torch's aten/src/ATen/native/cuda/int4mm.cu, matrix_to_m16n8k16_Bint4_layout). One
program reads one (nt, ko) block, 32 x INNER / 2 words, and writes its 8 rows x INNER * 16
values as (q - 8) * scale + zero with the [K / G, N, 2] scales and zeros the op reads.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def int4_tile_kernel(p_ptr, sz_ptr, out_ptr, n_end, n_start, k_super,  # noqa: ANN001
                     stride_sz, stride_out, INNER: tl.constexpr, G: tl.constexpr):
    nt = n_start // 8 + tl.program_id(0)
    ko = tl.program_id(1)
    J: tl.constexpr = INNER // 2
    # the program's output, in order: its 8 rows by its INNER * 16 values along k, so that
    # neighbouring values go out in one wide store; each value's word and nibble found
    # backwards (the words, 32 x J of them, are read again from L1 for each nibble)
    r = tl.arange(0, 8)[:, None]
    c = tl.arange(0, INNER * 16)[None, :]
    n = nt * 8 + r
    in_n = n < n_end
    b = (c % 32) // 2  # the value's byte in its 16 bytes (k-tiles 2j, 2j + 1; j = c // 32)
    t = r * 4 + b % 4  # the word's lane: its row, the byte's offset mod 4
    shift = 4 * ((b // 8) * 2 + (b % 8) // 4) + 16 * (c % 2)  # the byte in the word; odd k low
    words = tl.load(p_ptr + ((nt.to(tl.int64) * k_super + ko) * 32 + t) * J + c // 32)
    q = (words >> shift) & 0xF
    k = ko * (INNER * 16) + c
    at = (k // G).to(tl.int64) * stride_sz + n * 2  # [K / G, N, 2]: this row's pair
    s = tl.load(sz_ptr + at, mask=in_n, other=0.0).to(tl.float32)
    z = tl.load(sz_ptr + at + 1, mask=in_n, other=0.0).to(tl.float32)
    w = (q - 8).to(tl.float32) * s + z
    tl.store(out_ptr + (n - n_start).to(tl.int64) * stride_out + k,
             w.to(out_ptr.dtype.element_ty), mask=in_n)


@functools.cache
def build(interpret: bool) -> Any:
    """The kernel compiled for the device, or run by Triton's interpreter on CPU tensors
    (the tests). Its int arguments only place rows and groups, and vary with the layer and
    its tiling: none is specialised on, so the load probe's build serves every layer, but
    the tile's row stride (its K, a multiple of 32 for every layer and the probe's): known
    16-divisible, a row's values are stored 16 bytes at once."""
    keep = {"do_not_specialize": ["n_end", "n_start", "k_super", "stride_sz"]}
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(int4_tile_kernel, **keep)
    return triton.jit(int4_tile_kernel, **keep)
