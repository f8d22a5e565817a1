"""Quantised KV cache: quantise on write, dequantise on read (plain torch).

Layout beside the plain cache (per layer, K and V alike):

    data  [num_blocks, block_size, kv_heads, data_dim]   1-byte elements
    scale [num_blocks, block_size, kv_heads, num_scales] fp32

| kv_dtype  | data                                   | scales per token-head    |
|-----------|----------------------------------------|--------------------------|
| fp8_e4m3  | float8_e4m3fn bits (stored as uint8)   | 1: amax × (1/448)        |
| int8      | int8, symmetric, −127..127             | 1: amax × (1/127)        |
| int4      | two per byte (even index = low nibble), | ceil(head_dim / 32):     |
|           | stored as value + 8, −7..7             | amax of the group × (1/7) |

So one token-head takes exactly `helexa.checkpoint.layer_memory.kv_token_head_bytes` bytes
(`QuantSpec.bytes_per_token_head`), which is what `helexa plan`, the ledger
and the advertised limits count. The scale is per token and head (and per
group of 32 for int4), computed when the token is written, so writing never
re-touches older tokens and a block's content never changes once written
(prefix-cache sharing stays valid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QUANT_DTYPES = ("fp8_e4m3", "int8", "int4")
INT4_GROUP = 32
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12  # an all-zero token-head gets this scale, never 0 (no 0/0)


@dataclass(frozen=True)
class QuantSpec:
    """Storage of one quantised kv_dtype for a given head_dim."""

    kv_dtype: str
    head_dim: int
    data_dim: int  # bytes of data per token-head
    num_scales: int  # fp32 scales per token-head
    data_dtype: torch.dtype  # storage element type (1 byte)

    @property
    def bytes_per_token_head(self) -> int:
        return self.data_dim + 4 * self.num_scales


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANT_DTYPES


def quant_spec(kv_dtype: str, head_dim: int) -> QuantSpec:
    if kv_dtype == "int4":
        return QuantSpec(kv_dtype, head_dim, (head_dim + 1) // 2,
                         math.ceil(head_dim / INT4_GROUP), torch.uint8)
    if kv_dtype == "int8":
        return QuantSpec(kv_dtype, head_dim, head_dim, 1, torch.int8)
    if kv_dtype == "fp8_e4m3":
        return QuantSpec(kv_dtype, head_dim, head_dim, 1, torch.uint8)
    raise ValueError(f"kv_dtype: expected one of {', '.join(QUANT_DTYPES)}, got {kv_dtype!r}")


def allocate(spec: QuantSpec, num_blocks: int, block_size: int, kv_heads: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (data, scale) for one of K or V of one layer; zeros dequantise to 0.0."""
    data = torch.zeros(num_blocks, block_size, kv_heads, spec.data_dim, dtype=spec.data_dtype,
                       device=device)
    if spec.kv_dtype == "int4":
        data.fill_(0x88)  # both nibbles hold 0 (stored as value + 8)
    scale = torch.zeros(num_blocks, block_size, kv_heads, spec.num_scales, dtype=torch.float32,
                        device=device)
    return data, scale


# ---------------------------------------------------------------- quantise


def quantize(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] → (data [..., data_dim], scale [..., num_scales] fp32)."""
    spec = quant_spec(kv_dtype, x.shape[-1])
    xf = x.float()
    if kv_dtype == "int4":
        return _quantize_int4(xf, spec)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY)
    # amax times the reciprocal, not amax / 127: CUDA computes a tensor divided by a number
    # that way, so CPU, CUDA and the Triton write kernel (kernels/cuda/quant_write.py)
    # store the same scales bit for bit
    if kv_dtype == "int8":
        scale = amax * (1.0 / 127.0)
        data = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    else:  # fp8_e4m3: scale the token-head into the format's range, keep its 3-bit mantissa
        scale = amax * (1.0 / _FP8_MAX)
        data = (xf / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return data, scale


def _quantize_int4(xf: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    d = spec.head_dim
    padded = spec.num_scales * INT4_GROUP
    if padded != d:
        xf = torch.nn.functional.pad(xf, (0, padded - d))
    groups = xf.unflatten(-1, (spec.num_scales, INT4_GROUP))  # [..., G, 32]
    scale = groups.abs().amax(dim=-1).clamp_min(_TINY) * (1.0 / 7.0)  # [..., G]
    # Offset to 1..15 before the cast: float → uint8 of a negative value is undefined.
    q = (torch.round(groups / scale.unsqueeze(-1)).clamp_(-7, 7) + 8).to(torch.uint8)
    q = q.flatten(-2)[..., : 2 * spec.data_dim]
    if q.shape[-1] < 2 * spec.data_dim:  # odd head_dim: a zero (8) in the last high nibble
        q = torch.nn.functional.pad(q, (0, 1), value=8)
    data = q[..., 0::2] | (q[..., 1::2] << 4)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, kv_dtype: str, head_dim: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(data [..., data_dim], scale [..., num_scales]) → [..., head_dim] in `dtype`."""
    if kv_dtype == "int8":
        out = data.float() * scale
    elif kv_dtype == "fp8_e4m3":
        out = data.view(torch.float8_e4m3fn).float() * scale
    elif kv_dtype == "int4":
        spec = quant_spec(kv_dtype, head_dim)
        q = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).float() - 8.0  # [..., 2*dd]
        padded = spec.num_scales * INT4_GROUP
        if q.shape[-1] < padded:
            q = torch.nn.functional.pad(q, (0, padded - q.shape[-1]))
        q = q[..., :padded].unflatten(-1, (spec.num_scales, INT4_GROUP)) * scale.unsqueeze(-1)
        out = q.flatten(-2)[..., :head_dim]
    else:
        raise ValueError(f"kv_dtype: expected one of {', '.join(QUANT_DTYPES)}, got {kv_dtype!r}")
    return out.to(dtype)


# ------------------------------------------------------------- paged cache


def write_quantized(data_cache: torch.Tensor, scale_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, x: torch.Tensor, kv_dtype: str) -> None:
    """Quantise new tokens x [N, kv_heads, head_dim] into their slots (as write_kv does)."""
    data, scale = quantize(x, kv_dtype)
    kvh = data_cache.shape[-2]
    data_cache.view(-1, kvh, data_cache.shape[-1]).index_copy_(0, slot_mapping, data)
    scale_cache.view(-1, kvh, scale_cache.shape[-1]).index_copy_(0, slot_mapping, scale)


def gather_dequantized(data_cache: torch.Tensor, scale_cache: torch.Tensor, slots: torch.Tensor,
                       kv_dtype: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The tokens at `slots` dequantised: [len(slots), kv_heads, head_dim] in `dtype`."""
    kvh = data_cache.shape[-2]
    data = data_cache.view(-1, kvh, data_cache.shape[-1]).index_select(0, slots)
    scale = scale_cache.view(-1, kvh, scale_cache.shape[-1]).index_select(0, slots)
    return dequantize(data, scale, kv_dtype, head_dim, dtype)


_PLAIN = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class PagedKV:
    """K or V of one layer in any resolved kv_dtype: one write/gather path for all of them.

    Plain dtypes keep one tensor [num_blocks, block_size, kv_heads, head_dim];
    quantised ones keep (data, scale) as above. Slots index the flattened
    [num_blocks × block_size] token axis, as the block tables give them.
    """

    def __init__(self, kv_dtype: str, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu") -> None:
        self.kv_dtype, self.head_dim, self.kv_heads = kv_dtype, head_dim, kv_heads
        self.num_blocks, self.block_size = num_blocks, block_size
        if kv_dtype in _PLAIN:
            # Zeroed, so padded gather rows (masked out later) never hold NaN.
            self.data = torch.zeros(num_blocks, block_size, kv_heads, head_dim,
                                    dtype=_PLAIN[kv_dtype], device=device)
            self.scale: torch.Tensor | None = None
        else:
            self.data, self.scale = allocate(quant_spec(kv_dtype, head_dim), num_blocks,
                                             block_size, kv_heads, device)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    @property
    def bytes_per_token_head(self) -> int:
        return self.nbytes // (self.num_blocks * self.block_size * self.kv_heads)

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Store new tokens x [N, kv_heads, head_dim] at their slots [N]."""
        if self.scale is None:
            flat = self.data.view(-1, self.kv_heads, self.head_dim)
            flat.index_copy_(0, slot_mapping, x.to(self.data.dtype))
        else:
            write_quantized(self.data, self.scale, slot_mapping, x, self.kv_dtype)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tokens at `slots` as [len(slots), kv_heads, head_dim] in `dtype`."""
        if self.scale is None:
            flat = self.data.view(-1, self.kv_heads, self.head_dim)
            return flat.index_select(0, slots).to(dtype)
        return gather_dequantized(self.data, self.scale, slots, self.kv_dtype, self.head_dim,
                                  dtype)
