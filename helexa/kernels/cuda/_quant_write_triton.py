"""The Triton source of helexa/kernels/cuda/quant_write.py's kernel (imported only where
Triton is).

One program takes one new token and one kv head, K and V both: it reads the token-head's
values, takes the amax (of the whole head, or of each 32-dim group for int4), divides by
the scale correctly rounded (``div_rn``, as torch divides) and rounds half to even (as
torch.round and the float8 cast do), and stores the data and its scales at the token's
slot. fp8 e4m3 is encoded from the float's bits, so no float8 type is needed.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

# KIND: quant_write.KINDS (0 int8, 1 fp8 e4m3, 2 int4). kv_quant._TINY (an all-zero
# token-head's scale) and the formats' reciprocals are written as literals: a Triton kernel
# reads no module global, and the scale is amax times the reciprocal, as kv_quant computes
# it on every device (CUDA's tensor / scalar is that too)


@triton.jit
def _rne(y):
    """Round half to even (torch.round): from the floor and the exact remainder (adding 0.5
    first would round 0.49999997 up)."""
    r = tl.floor(y)
    d = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _fp8_bits(y):
    """float8_e4m3fn bits (as int32) of y in [-448, 448], rounded half to even."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 127  # a's exponent (a >= 2^-6 below)
    frac = bits & 8388607  # 23 mantissa bits
    m = frac >> 20
    rem = frac & 1048575
    up = (rem > 524288) | ((rem == 524288) & ((m & 1) == 1))
    normal = ((e + 7) << 3) + m + up.to(tl.int32)  # a carry into the exponent is right too
    sub = _rne(a * 512.0).to(tl.int32)  # below 2^-6: m / 8 * 2^-6, m = 8 is 2^-6 itself
    code = tl.where(a < 0.015625, sub, normal)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, code | 128, code)  # -0.0 too


@triton.jit
def _quantise(src, data, scale, row, slot, head, offs, in_d, KV_HEADS: tl.constexpr,
              HEAD_DIM: tl.constexpr, DP: tl.constexpr, DATA_DIM: tl.constexpr,
              NUM_SCALES: tl.constexpr, NSP: tl.constexpr, KIND: tl.constexpr, stride_t,
              stride_h):
    base = src + row * stride_t + head * stride_h
    at = slot * KV_HEADS + head  # the token-head's row in the flat pool
    if KIND == 2:  # int4: a scale per 32 dims, two values a byte (even dim low), value + 8
        offs_g = tl.arange(0, NSP)
        offs_j = tl.arange(0, 16)  # a group's 16 bytes: dims 2j (low nibble) and 2j + 1
        lo_d = offs_g[:, None] * 32 + 2 * offs_j[None, :]  # [NSP, 16]
        hi_d = lo_d + 1
        lo = tl.load(base + lo_d, mask=lo_d < HEAD_DIM, other=0.0).to(tl.float32)
        hi = tl.load(base + hi_d, mask=hi_d < HEAD_DIM, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))
        s = tl.maximum(amax, 1e-12) * 0.14285714285714285  # [NSP]: amax * (1 / 7)
        tl.store(scale + at * NUM_SCALES + offs_g, s, mask=offs_g < NUM_SCALES)
        q_lo = tl.minimum(tl.maximum(_rne(tl.math.div_rn(lo, s[:, None])), -7.0), 7.0) + 8.0
        q_hi = tl.minimum(tl.maximum(_rne(tl.math.div_rn(hi, s[:, None])), -7.0), 7.0) + 8.0
        byte = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)
        at_b = offs_g[:, None] * 16 + offs_j[None, :]
        tl.store(data + at * DATA_DIM + at_b, byte.to(tl.uint8), mask=at_b < DATA_DIM)
    else:
        x = tl.load(base + offs, mask=in_d, other=0.0).to(tl.float32)
        top = 127.0 if KIND == 0 else 448.0
        inv = 0.007874015748031496 if KIND == 0 else 0.002232142857142857  # 1/127, 1/448
        s = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) * inv
        tl.store(scale + at, s)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -top), top)
        if KIND == 0:
            tl.store(data + at * DATA_DIM + offs, _rne(y).to(tl.int8), mask=in_d)
        else:
            tl.store(data + at * DATA_DIM + offs, _fp8_bits(y).to(tl.uint8), mask=in_d)


def write_kernel(k_ptr, v_ptr, slots_ptr, k_data, k_scale, v_data, v_scale,  # noqa: ANN001
                 stride_kt, stride_kh, stride_vt, stride_vh,
                 KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DP: tl.constexpr,
                 DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr, NSP: tl.constexpr,
                 KIND: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs = tl.arange(0, DP)
    in_d = offs < HEAD_DIM
    _quantise(k_ptr, k_data, k_scale, row, slot, head, offs, in_d, KV_HEADS, HEAD_DIM, DP,
              DATA_DIM, NUM_SCALES, NSP, KIND, stride_kt, stride_kh)
    _quantise(v_ptr, v_data, v_scale, row, slot, head, offs, in_d, KV_HEADS, HEAD_DIM, DP,
              DATA_DIM, NUM_SCALES, NSP, KIND, stride_vt, stride_vh)


@functools.cache
def build(interpret: bool) -> Any:
    """The kernel compiled for the device, or run by Triton's interpreter on CPU tensors."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(write_kernel)
    return triton.jit(write_kernel)
