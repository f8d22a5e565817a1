"""torch's CUDA int4 packing (``aten._convert_weight_to_int4pack``) replayed in torch ops on
any device, so that helexa/kernels/cuda/int4_tiles.py's dequantisation can be tested where
no GPU is. Written from torch's aten/src/ATen/native/cuda/int4mm.cu
(matrix_to_m16n8k16_Bint4_layout, the NVIDIA path): the input is [N, K / 2] uint8, each
byte's high nibble the even k; word (nt, ko, t, j) of the [N / 8, K / (inner * 16), 32,
inner / 2] int32 output packs row nt * 8 + t // 4's bytes at offsets t % 4, t % 4 + 4,
8 + t % 4, 12 + t % 4 of k-tiles ko * inner + 2j and the next, high nibbles in the low 16
bits. On the GPU the load probe checks the real packing the same way."""

from __future__ import annotations

import torch


def pack(q: torch.Tensor, inner: int) -> torch.Tensor:
    """Values 0..15 [N, K] -> the packed int32 tensor torch's CUDA op reads."""
    n, k = q.shape
    u8 = ((q[:, ::2].to(torch.int64) << 4) | q[:, 1::2].to(torch.int64))  # [N, K / 2]
    n_tiles, k_super = -(-n // 8), k // (inner * 16)
    t = torch.arange(32)
    rows = torch.arange(n_tiles)[:, None, None, None] * 8 + (t // 4)[None, None, :, None]
    base = ((torch.arange(k_super)[None, :, None, None] * inner
             + 2 * torch.arange(inner // 2)[None, None, None, :]) * 8)
    lane = (t % 4)[None, None, :, None]
    v = []
    for off in (0, 4, 8, 12):
        byte = (base + lane + off).expand(n_tiles, k_super, 32, inner // 2)
        row = rows.expand_as(byte)
        valid = row < n
        v.append(torch.where(valid, u8[row.clamp(max=n - 1), byte], 0))
    word = ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | (
        (v[0] & 0xF) << 16) | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | (
        (v[0] & 0xF0) >> 4)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
