"""The Triton source of helexa/kernels/cuda/int8g.py's kernel (imported only where Triton is).

One program computes a [BLOCK_M, BLOCK_N] block of x @ W^T over one span of K: it reads
each int8 weight byte of its rows and span once, and each group's scale (and zero) once
per step where the groups tile the step (``grouping``), dequantises in registers and
multiplies on the tensor cores; partial sums go out in fp32, one slab per span, for the
caller to add. Offsets into the weight are 64-bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


def int8g_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, k_span,  # noqa: ANN001
                 stride_x, stride_w, stride_s,
                 G: tl.constexpr, GROUPING: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_n = offs_n < N
    rows_w = offs_n[:, None].to(tl.int64) * stride_w  # a vocabulary-wide head passes 2^31
    rows_s = offs_n[:, None].to(tl.int64) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_span
    for k in range(0, k_span, BLOCK_K):
        k0 = k_start + k  # a multiple of BLOCK_K: spans are whole steps
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        q = tl.load(w_ptr + rows_w + offs_k[None, :], mask=in_n[:, None] & in_k[None, :],
                    other=0).to(tl.float32)
        w = dequant_groups(q, s_ptr, z_ptr, rows_s, in_n, offs_k, k0, K, G, GROUPING,
                           HAS_ZEROS, BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    # the spans' partial sums: [split, M, N] fp32, this program's span at pid_k
    out = out_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=in_m[:, None] & in_n[None, :])


@triton.jit
def dequant_groups(q, s_at, z_at, rows_s, in_n, offs_k, k0, K,  # noqa: ANN001
                   G: tl.constexpr, GROUPING: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int8 values [BLOCK_N, BLOCK_K] (fp32) as q * scale + zero of their groups, each
    group's scale read once where the groups tile the step (``grouping``); the routed MoE
    kernel's int8 stacks too (_moe_routed_triton.py)."""
    if GROUPING == 1:  # G divides BLOCK_K: the step's BLOCK_K // G groups, one load each
        NG: tl.constexpr = BLOCK_K // G
        offs_g = k0 // G + tl.arange(0, NG)
        gmask = in_n[:, None] & (offs_g[None, :] < K // G)
        s = tl.load(s_at + rows_s + offs_g[None, :], mask=gmask, other=0.0).to(tl.float32)
        w = q.reshape(BLOCK_N, NG, G) * s[:, :, None]
        if HAS_ZEROS:
            z = tl.load(z_at + rows_s + offs_g[None, :], mask=gmask, other=0.0)
            w += z.to(tl.float32)[:, :, None]
        w = w.reshape(BLOCK_N, BLOCK_K)
    elif GROUPING == 2:  # BLOCK_K divides G: the step lies in one group
        smask = in_n[:, None] & ((k0 + tl.zeros((BLOCK_N, 1), dtype=tl.int32)) < K)
        w = q * tl.load(s_at + rows_s + k0 // G, mask=smask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            w += tl.load(z_at + rows_s + k0 // G, mask=smask, other=0.0).to(tl.float32)
    else:  # any other group: each value's own group's scale
        group = offs_k[None, :] // G
        wmask = in_n[:, None] & (offs_k[None, :] < K)
        w = q * tl.load(s_at + rows_s + group, mask=wmask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            w += tl.load(z_at + rows_s + group, mask=wmask, other=0.0).to(tl.float32)
    return w


def grouping(group_size: int, block_k: int) -> int:
    """How a step of ``block_k`` inputs reads its scales: 1, a load per group (the group
    divides the step); 2, one group for the whole step; 0, a scale per value (neither)."""
    if block_k % group_size == 0:
        return 1
    if group_size % block_k == 0:
        return 2
    return 0


def operands(dtype: torch.dtype, interpret: bool) -> tuple[Any, str]:
    """The dot's operand dtype and precision for activations of ``dtype``: the model's own
    16-bit type on the tensor cores, fp32 exactly ("ieee", not TF32) for an fp32 model.
    Triton's interpreter multiplies 16-bit floats as their raw bits (its create_dot hands
    the uint16 arrays that hold them to numpy), so there the dot takes fp32 operands: the
    one way an interpreted run differs from the card's."""
    if interpret or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


@functools.cache
def build(interpret: bool) -> Any:
    """The kernel compiled for the device, or run by Triton's interpreter on CPU tensors
    (the tests). M is not specialised on: one build per layer shape serves every row count."""
    # Triton specialises an int argument on its divisibility by 16 and a pointer on its
    # alignment: a shape a graph capture sees first would compile there, which a capture
    # refuses. The row count and the input's stride and address vary with the step, so
    # none of them is specialised on: one build per layer shape serves every step.
    keep = {"do_not_specialize": ["M", "stride_x"], "do_not_specialize_on_alignment": ["x_ptr"]}
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(int8g_kernel, **keep)
    return triton.jit(int8g_kernel, **keep)
