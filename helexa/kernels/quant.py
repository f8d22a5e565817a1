"""Weight-only quantised matmuls: one op per device over one packed layout.

The layout (docs/quantization.md) is what torch's own weight-only ops take:

- int8: ``qweight`` int8 [N, K], one scale per output row, ``w = q * scale``;
  run by ``aten._weight_int8pack_mm`` on CPU; on CUDA as grouped int8 (below) with one
  group a row (torch's CUDA kernel gives each output a thread that reads its weight row
  alone, once per input row), which keeps a decode step's few rows where the grouped
  kernel does not serve (``INT8_CUDA_OP_ROWS``).
- int4: values 0..15 in groups of ``group_size`` along K, a scale and a float
  zero per (group, row), ``w = (q - 8) * scale + zero`` (tinygemm's convention);
  packed by ``aten._convert_weight_to_int4pack_for_cpu`` and run by
  ``aten._weight_int4pack_mm_for_cpu`` (CUDA: ``_weight_int4pack_mm``, and for more than a
  decode step's rows its packed weight dequantised in tiles onto cuBLAS:
  helexa/kernels/cuda/int4_tiles.py).
- grouped int8: ``qweight`` int8 [N, K] in groups of ``group_size`` along K, a
  scale and an optional zero per (row, group), ``w = q * scale + zero``: the
  layout of GGUF Q8_0/Q6_K/Q5_K, GPTQ 8-bit and grouped or asymmetric int8. No
  torch op takes groups, so :func:`int8g_tiles` dequantises one tile of rows at
  a time (at most ``INT8G_TILE_BYTES`` of float weight live) and multiplies it;
  on CPU a decode step's few rows go to a native kernel that dequantises in
  registers instead, where it measures faster (helexa/kernels/cpu/int8g.py); on CUDA
  to a Triton kernel that does the same, where it agrees with the tiles on the card
  (helexa/kernels/cuda/int8g.py).

No op materialises the whole float weight. Activations, scales and zeros are in
the model's dtype. On CPU torch's int8 and int4 ops are vectorised only for bf16
activations (fp32 input falls to a scalar loop, 4-8x slower than MKL's fp32 GEMM:
see the commit that added this file), so such a model is fast on CPU in bf16; fp32
stays exact (the tests compare it with transformers token for token). The grouped
int8 decode kernel is vectorised for fp32 and bf16 alike.
"""

from __future__ import annotations

import torch

from helexa.kernels.cpu import int8g as int8g_cpu
from helexa.kernels.cuda import int4_tiles as int4_cuda
from helexa.kernels.cuda import int8g as int8g_cuda

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_ROW_MULTIPLE = 16  # the packers need N % 16 == 0
_INNER_K_TILES = 2  # the CPU packer's argument (its layout does not depend on it)
# The CUDA op's tile depth along K: 8 inner k-tiles load 16 bytes at a time (the fast
# layout gpt-fast and torchao use), 2 only 4. Its packer lays the weight out as
# [N/8][K/(tiles*16)][32][tiles/2], so a depth must divide K/16; the mm reads it back
# from the packed shape.
_CUDA_INNER_K_TILES = (8, 4, 2)


def cuda_inner_k_tiles(k: int) -> int:
    """The deepest inner k-tiling of the CUDA int4 layout that K (the in-features) allows."""
    for tiles in _CUDA_INNER_K_TILES:
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"the CUDA int4 layout needs in-features divisible by 32, got {k}")


def compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the ops run in (and the scales are stored in)."""
    return model_dtype


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scales [N])^T + bias."""
    shape = x.shape
    if x.numel() == 0:  # a step wanting no logits: the CUDA op's launch of 0 rows is invalid
        return x.new_zeros(*shape[:-1], qweight.shape[0])
    x2 = x.reshape(-1, shape[-1]).to(scales.dtype).contiguous()  # as int4_linear
    if x2.device.type != "cpu":  # one group a row: the Triton kernel for a decode step's
        # rows where it proved itself on the card, else _int8_rows_fallback
        y = int8g_cuda.linear(x2, qweight, scales[:, None], None, qweight.shape[1],
                              _int8_rows_fallback).to(x.dtype)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, qweight, scales).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], qweight.shape[0])


# torch's CUDA op reads a weight row per output thread, once per input row: a decode
# step's few rows keep it where the Triton kernel does not serve (no Triton, its probe
# failed, HELEXA_TRITON_INT8G=0), more take the tiles. Read from the kernels, not measured.
INT8_CUDA_OP_ROWS = 8


def _int8_rows_fallback(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Per-row int8 off the Triton kernel (scales [N, 1], one group a row): torch's op for
    up to INT8_CUDA_OP_ROWS rows, else the tiles (a probe's layer of several groups too)."""
    if x.shape[0] <= INT8_CUDA_OP_ROWS and scales.shape[1] == 1 and zeros is None:
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales[:, 0])
    return int8g_tiles(x, qweight, scales, zeros, group_size)


INT8G_TILE_BYTES = 4 << 20  # float bytes of one dequantised tile: stays in cache


def int8g_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T + bias, W = q * scale + zero per (row, group of ``group_size``)."""
    shape = x.shape
    n, k = qweight.shape
    x2 = x.reshape(-1, k).to(scales.dtype)
    if x2.device.type == "cpu":  # few rows: the native kernel where it measured faster
        out = int8g_cpu.linear(x2, qweight, scales, zeros, group_size, int8g_tiles)
    elif x2.device.type == "cuda":  # few rows: the Triton kernel where it proved itself
        out = int8g_cuda.linear(x2, qweight, scales, zeros, group_size, int8g_tiles)
    else:
        out = int8g_tiles(x2, qweight, scales, zeros, group_size)
    y = out.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], n)


def int8g_tiles(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The plain-torch grouped int8 product, x2 [M, K] in scales' dtype -> [M, N]: the
    reference, and the path for many rows."""
    n, k = qweight.shape
    dtype = scales.dtype
    out = torch.empty(x2.shape[0], n, dtype=dtype, device=x2.device)
    rows = max(1, INT8G_TILE_BYTES // (k * x2.element_size()))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = _int8g_tile(qweight[r0:r1], scales[r0:r1],
                        None if zeros is None else zeros[r0:r1], group_size, dtype)
        torch.mm(x2, w.t(), out=out[:, r0:r1])
    return out


def _int8g_tile(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                group_size: int, dtype: torch.dtype) -> torch.Tensor:
    r, k = q.shape
    g = q.view(r, k // group_size, group_size).to(dtype) * scales.unsqueeze(-1)
    if zeros is not None:
        g = g + zeros.unsqueeze(-1)
    return g.view(r, k)


def dequantize_int8g(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """The reference float weight of the grouped int8 layout (fp32)."""
    return _int8g_tile(qweight, scales.float(), None if zeros is None else zeros.float(),
                       group_size, torch.float32)


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] (any int dtype) -> the device op's packed tensor."""
    if q.device.type == "cuda":
        return int4_pack_cuda(q, cuda_inner_k_tiles(q.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                              _INNER_K_TILES)


def int4_pack_cuda(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Values 0..15 [N, K] on a CUDA device -> torch's CUDA int4 op's packed tensor."""
    u8 = (q[:, ::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(u8.contiguous(), inner_k_tiles)


def int4_operand_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the int4 op's scales and activations for a model of ``dtype``: on CUDA
    bf16 whatever the model's (torch's CUDA op, ``_weight_int4pack_mm``, takes bf16 only:
    an fp16 or fp32 model's activations are rounded to bf16 for these products and the
    products come back in its dtype, as vLLM serves fp16 AWQ files), else ``dtype``."""
    return torch.bfloat16 if device.type == "cuda" else dtype


def int4_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scales, zeros [N, G] -> the op's [G, N, 2] operand, in int4_operand_dtype (every int4
    format packs through here at load)."""
    op = int4_operand_dtype(scales.device, dtype)
    return torch.stack([scales.t(), zeros.t()], dim=-1).to(op).contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int, n: int,
                scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T + bias for the int4 layout above; W has ``n`` rows."""
    shape = x.shape
    if x.numel() == 0:  # a step wanting no logits: the CUDA op's launch of 0 rows is invalid
        return x.new_zeros(*shape[:-1], n)
    x2 = x.reshape(-1, shape[-1]).to(scales_zeros.dtype).contiguous()  # the ops require it
    if packed.dim() == 4:  # torch's CUDA layout; many rows: dequantised tiles where they
        y = int4_cuda.linear(x2, packed, group_size, n, scales_zeros,  # proved themselves
                             torch.ops.aten._weight_int4pack_mm, int4_pack_cuda)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_zeros)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], n)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference float weight of the int8 layout (fp32)."""
    return qweight.float() * scales.float()[:, None]


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The reference float weight of the int4 layout from its unpacked values (fp32)."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (q.float() - 8) * s + z
