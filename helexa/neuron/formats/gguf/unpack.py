"""GGUF tensor data -> one form for every quantised type: ``w = q * scale + zero``.

Each function takes a tensor's raw blocks (uint8 [rows, blocks * block bytes], as
``GGUFReader`` maps them) and returns ``q`` int8 [rows, K], ``scale`` fp32 [rows,
K / group] and ``zero`` fp32 (or None), computing scale and zero as gguf's own
``dequantize`` does (``gguf/quants.py``), so ``q * scale + zero`` in fp32 is its
dequantised weight bit for bit. Block layouts are ggml's (``ggml-common.h``):

- Q8_0: 32 values; ``d`` fp16, ``qs`` int8[32]; ``w = d * q``.
- Q6_K: 256 values; ``ql`` [128] low nibbles, ``qh`` [64] high 2 bits, ``scales``
  int8[16] (one per 16 values), ``d`` fp16; ``w = (d * sc) * (q - 32)``.
- Q5_K / Q4_K: 256 values; ``d``, ``dmin`` fp16, 12 bytes of 6-bit scales and mins
  (one pair per 32 values), [Q5_K: ``qh`` [32] the fifth bits], ``qs`` [128] nibbles;
  ``w = (d * sc) * q - dmin * m``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from helexa.checkpoint.gguf_layout import Layout

QK_K = 256
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    return torch.from_numpy(np.array(raw, copy=True)).view(-1, block_bytes)  # mmap: read-only


def _f16(b: torch.Tensor) -> torch.Tensor:  # uint8 [n, 2] -> fp32 [n, 1]
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [n, 128] -> [n, 8, 32]: 32-byte chunk c gives sub-block 2c (low) and 2c+1 (high)."""
    q = qs.view(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of K-quant 6-bit scales and mins [n, 12] -> (sc, m) [n, 8]."""
    d, m, m_d = s.view(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _rows(rows: int, q: torch.Tensor, scale: torch.Tensor,
          zero: torch.Tensor | None) -> Unpacked:
    return (q.reshape(rows, -1).contiguous(), scale.reshape(rows, -1).contiguous(),
            None if zero is None else zero.reshape(rows, -1).contiguous())


def unpack_q8_0(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 34)
    return _rows(raw.shape[0], b[:, 2:].contiguous().view(torch.int8), _f16(b[:, :2]), None)


def unpack_q6_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 210)
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:]
    lo = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    lo = (lo & 0x0F).reshape(-1, 8, 32)
    hi = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    hi = (hi & 0x03).reshape(-1, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int16) - 32).to(torch.int8)
    scale = _f16(d) * sc.contiguous().view(torch.int8).float()  # [n, 16]
    return _rows(raw.shape[0], q, scale, None)


def _k4_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = scale_min_k4(b[:, 4:16])
    return _f16(b[:, :2]) * sc.float(), -(_f16(b[:, 2:4]) * m.float())


def unpack_q5_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 176)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    q = _nibbles(b[:, 48:]) | ((qh & 0x01) << 4)
    scale, zero = _k4_scales(b)
    return _rows(raw.shape[0], q.to(torch.int8), scale, zero)


def unpack_q4_k(raw: np.ndarray) -> Unpacked:
    b = _blocks(raw, 144)
    scale, zero = _k4_scales(b)
    return _rows(raw.shape[0], _nibbles(b[:, 16:]).to(torch.int8), scale, zero)


UNPACKERS: dict[str, Callable[[np.ndarray], Unpacked]] = {
    "Q8_0": unpack_q8_0, "Q6_K": unpack_q6_k, "Q5_K": unpack_q5_k, "Q4_K": unpack_q4_k}


def float_tensor(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor (BF16 is mapped as its bytes)."""
    t = torch.from_numpy(np.array(raw, copy=True))
    if type_name == "BF16":
        return t.view(torch.bfloat16)
    return t


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """The unpacked form's float weight (fp32): ``q * scale + zero`` per group."""
    rows, k = q.shape
    w = q.view(rows, scale.shape[1], -1).float() * scale.unsqueeze(-1)
    if zero is not None:
        w = w + zero.unsqueeze(-1)
    return w.view(rows, k)


def to_layout(unpacked: Unpacked, layout: Layout) -> Unpacked:
    """One part's unpacked form in its layer's layout: scales repeated over a smaller group
    (the same values), zeros added where the layer has them."""
    q, scale, zero = unpacked
    rep = q.shape[1] // scale.shape[1] // layout.group
    if rep > 1:
        scale = scale.repeat_interleave(rep, dim=1)
        zero = None if zero is None else zero.repeat_interleave(rep, dim=1)
    if layout.zeros and zero is None:
        zero = torch.zeros_like(scale)
    return q, scale, zero
