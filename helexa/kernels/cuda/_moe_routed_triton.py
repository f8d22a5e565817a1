"""The Triton source of helexa/kernels/cuda/moe_routed.py's kernel (imported only where
Triton is): each (token, slot) pair's product with its expert, read in place from the stack.

One program computes BLOCK_N outputs of one pair over one span of K: it reads the pair's
row of x (``rows``) and its expert's weight rows (``experts``: an offset into the stack,
so no expert is copied out first), dequantises in registers and reduces in fp32 (a pair
is one row: a sum of products, no tensor-core tile to pad); partial sums go out one slab
per span, for the caller to add. The stack is one of (``KIND``):

- 0, float [E, N, K];
- 1, grouped int8 [E, N, K] with scales (and zeros) [E, N, K / G]: ``q * scale + zero``;
- 2, torch's CUDA int4 layout, [E, N / 8, K / (INNER * 16), 32, INNER / 2] int32 with
  scales and zeros [E, K / G, N, 2]: ``(q - 8) * scale + zero``, each value's word and
  nibble found as helexa/kernels/cuda/_int4_tiles_triton.py says.

Offsets into the stack are 64-bit (an expert stack passes 2^31 bytes).
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

from helexa.kernels.cuda._int8g_triton import dequant_groups


def routed_kernel(x_ptr, rows_ptr, experts_ptr, w_ptr, s_ptr, z_ptr, out_ptr,  # noqa: ANN001
                  pairs, N, K, k_span, stride_x, stride_we, stride_se, stride_s,
                  KIND: tl.constexpr, G: tl.constexpr, GROUPING: tl.constexpr,
                  HAS_ZEROS: tl.constexpr, INNER: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pair = tl.program_id(2)
    row = tl.load(rows_ptr + pair).to(tl.int64)
    e = tl.load(experts_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    n = offs_n[:, None].to(tl.int64)
    w_at = w_ptr + e * stride_we
    s_at = s_ptr + e * stride_se
    z_at = z_ptr + e * stride_se
    x_at = x_ptr + row * stride_x
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = pid_k * k_span
    for step in range(0, k_span, BLOCK_K):
        k0 = k_start + step  # a multiple of BLOCK_K: spans are whole steps
        if KIND == 2:
            acc += _int4_step(x_at, w_at, s_at, offs_n, in_n, n, k0, K, stride_s,
                              G, INNER, BLOCK_N, BLOCK_K)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < K
            mask = in_n[:, None] & in_k[None, :]
            x = tl.load(x_at + offs_k, mask=in_k, other=0.0).to(tl.float32)
            w = tl.load(w_at + n * K + offs_k[None, :], mask=mask, other=0).to(tl.float32)
            if KIND == 1:
                w = dequant_groups(w, s_at, z_at, n * stride_s, in_n, offs_k, k0, K, G,
                                   GROUPING, HAS_ZEROS, BLOCK_N, BLOCK_K)
            acc += tl.sum(w * x[None, :], axis=1)
    # the spans' partial sums: [split, pairs, N] fp32, this program's span at pid_k
    tl.store(out_ptr + (pid_k * pairs + pair).to(tl.int64) * N + offs_n, acc, mask=in_n)


@triton.jit
def _int4_step(x_at, w_at, s_at, offs_n, in_n, n, k0, K, stride_s,  # noqa: ANN001
               G: tl.constexpr, INNER: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """One step's sums of products for torch's CUDA int4 layout, [BLOCK_N] fp32.

    A row's words of one k-block (INNER * 16 values) lie together, 4 J of them (lane t =
    row % 8 * 4 + t4, then j), so the step reads each row's words whole and takes their
    nibbles in place: value v of the step is nibble v % 8 of word v // 8, and the input it
    multiplies is gathered to match (k of v below), not the weight moved to k's order.
    The nibble in slot s is byte i = s % 4's (offsets t4, t4 + 4, 8 + t4, 12 + t4 of its
    k-tile pair), the high one (even k) for s < 4. Scales and zeros apply per group as
    masked sums of the products: sum q x s + z sum x over each group the step holds."""
    J: tl.constexpr = INNER // 2
    U: tl.constexpr = 4 * J  # a row's words in one k-block
    KB: tl.constexpr = BLOCK_K // (INNER * 16)  # k-blocks in the step
    NG: tl.constexpr = BLOCK_K // G if BLOCK_K >= G else 1  # groups the step holds
    blocks = K // (INNER * 16)
    wv = tl.arange(0, KB * U)[None, :]
    ko = k0 // (INNER * 16) + wv // U
    word_at = (((n // 8) * blocks + ko) * 32 + (n % 8) * 4) * J + wv % U
    words = tl.load(w_at + word_at, mask=in_n[:, None] & (ko < blocks), other=0)
    q = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
    v = tl.arange(0, BLOCK_K)
    u = (v // 8) % U
    slot = v % 8
    k = (k0 + (v // (8 * U)) * (INNER * 16) + (u % J) * 32 + ((slot % 4) // 2) * 16
         + (slot % 2) * 8 + (u // J) * 2 + slot // 4)
    x = tl.load(x_at + k, mask=k < K, other=0.0).to(tl.float32)
    qx = q * x[None, :]
    group = k // G - k0 // G
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for gi in tl.static_range(NG):
        at = s_at + (k0 // G + gi) * stride_s + offs_n * 2
        ok = in_n & ((k0 // G + gi + tl.zeros_like(offs_n)) < K // G)
        s = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
        mine = group == gi
        acc += s * tl.sum(tl.where(mine[None, :], qx, 0.0), axis=1)
        acc += z * tl.sum(tl.where(mine, x, 0.0))
    return acc


@functools.cache
def build(interpret: bool) -> Any:
    """The kernel compiled for the device, or run by Triton's interpreter on CPU tensors
    (the tests). What varies with the step (the pair count, the activations' row stride
    and addresses, the ids' tensors) is not specialised on, so the build the load's probe
    makes on a stack serves every step on it, in a graph capture too; the stack's shape
    and strides are, as a layer's, and its loads are as wide as its rows allow."""
    keep = {"do_not_specialize": ["pairs", "stride_x"],
            "do_not_specialize_on_alignment": ["x_ptr", "rows_ptr", "experts_ptr"]}
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(routed_kernel, **keep)
    return triton.jit(routed_kernel, **keep)
