"""The Triton source of helexa/kernels/cuda/int8g.py's kernel (imported only where Triton is).

One program computes a [BLOCK_M, BLOCK_N] block of x @ W^T over one span of K: it reads
each int8 weight byte of its rows and span once, with the scale (and zero) of the byte's
group, dequantises in registers and multiplies on the tensor cores; partial sums go out in
fp32, one slab per span, for the caller to add.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


def int8g_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, G, k_span,  # noqa: ANN001
                 stride_x, stride_w, stride_s, stride_part,
                 HAS_ZEROS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m = offs_m < M
    in_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_span
    for k in range(0, k_span, BLOCK_K):
        offs_k = k_start + k + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        wmask = in_n[:, None] & in_k[None, :]
        q = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=wmask, other=0)
        group = offs_k // G
        s = tl.load(s_ptr + offs_n[:, None] * stride_s + group[None, :], mask=wmask, other=0.0)
        w = q.to(tl.float32) * s.to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n[:, None] * stride_s + group[None, :], mask=wmask,
                        other=0.0)
            w += z.to(tl.float32)
        acc += tl.dot(x.to(DOT), tl.trans(w.to(DOT)), input_precision=PRECISION)
    out = out_ptr + pid_k * stride_part + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=in_m[:, None] & in_n[None, :])


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
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(int8g_kernel, do_not_specialize=["M"])
    return triton.jit(int8g_kernel, do_not_specialize=["M"])
