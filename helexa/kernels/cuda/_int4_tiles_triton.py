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
    t = tl.arange(0, 32)[:, None]
    j = tl.arange(0, J)[None, :]
    words = tl.load(p_ptr + ((nt.to(tl.int64) * k_super + ko) * 32 + t) * J + j)
    n = nt * 8 + t // 4  # [32, 1]: each word's row
    in_n = n < n_end
    base = (ko * INNER + 2 * j) * 8  # [1, J]: the word's first byte in its row
    for i in tl.static_range(4):
        byte = base + (i // 2) * 8 + (i % 2) * 4 + t % 4  # [32, J]
        for h in tl.static_range(2):  # the byte's high nibble (even k), then its low
            q = (words >> (4 * i + 16 * h)) & 0xF
            k = 2 * byte + h
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
    its tiling: none is specialised on, so the load probe's build serves every layer."""
    keep = {"do_not_specialize": ["n_end", "n_start", "k_super", "stride_sz", "stride_out"]}
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(int4_tile_kernel, **keep)
    return triton.jit(int4_tile_kernel, **keep)
