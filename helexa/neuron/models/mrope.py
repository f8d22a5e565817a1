"""Multimodal rotary (M-RoPE, interleaved as Qwen3-VL and Qwen3.5 lay it out) and a step's
multimodal inputs as a model reads them.

Each token has three positions (t, h, w). The rotary frequencies are dealt to the axes
in turn — frequency j rotates by h when j % 3 == 1 and j < 3 × section[1], by w when
j % 3 == 2 and j < 3 × section[2], else by t — in both halves of the rotate-half layout.
A token whose three positions are equal (all text) is rotated exactly as plain rope
would: the fast path of text-only steps is the plain table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helexa.kernels.rotary import RotaryTable


@dataclass
class MmStep:
    """What a step with images or shifted positions hands the model (the runner sets it)."""

    positions: torch.Tensor | None  # [3, N] (t, h, w) per row; None: the 1-D positions
    rows: torch.Tensor | None  # [K] rows whose embedding is an image token's
    embeds: torch.Tensor | None  # [K, hidden] those rows' embeddings, from the tower


def axis_of_columns(rotary_dim: int, section: tuple[int, ...], device: torch.device | str
                    ) -> torch.Tensor:
    """[rotary_dim] long: which of (t, h, w) each rotated dimension follows."""
    half = rotary_dim // 2
    axis = torch.zeros(half, dtype=torch.long)
    for dim in (1, 2):
        axis[dim: 3 * section[dim]: 3] = dim
    return torch.cat([axis, axis]).to(device)


def mrope_cos_sin(table: RotaryTable, positions: torch.Tensor, axes: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-carrying sin [N, rotary_dim] of (t, h, w) positions [3, N]."""
    cos = table.cos[positions]  # [3, N, D]
    sin = table.sin_signed[positions]
    index = axes.view(1, 1, -1).expand(1, positions.shape[1], -1)
    return cos.gather(0, index)[0], sin.gather(0, index)[0]
