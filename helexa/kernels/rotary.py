"""Rotary position embeddings: inverse frequencies for each rope type, a cos/sin
table indexed by position, and the rotation itself.

The frequencies follow transformers' ``modeling_rope_utils`` exactly (default,
linear, llama3, yarn) so logits match the reference. Layout is "rotate half"
(first half / second half of head_dim), as the Llama/Qwen checkpoints use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# A device's one-launch rotation: (positions [N], q [N, h, d], k [N, kvh, d], the table's
# cos_sin_cache) -> None, q's and k's leading rotary dims rotated in place
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def rope_inv_freq(
    rope_type: str, theta: float, head_dim: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the cos/sin scaling factor."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_ff = float(params["low_freq_factor"])
        high_ff = float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(theta, dim, params)
    raise ValueError(f"rope type {rope_type!r} is not supported")


def _yarn_inv_freq(theta: float, dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    orig_max = float(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_max / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where we extrapolate (high frequencies), 0 where we interpolate
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryTable:
    """cos/sin rows per position, grown on demand, in the model's dtype.

    ``cos_sin(positions)`` returns ``cos, sin_signed`` of shape [N, head_dim]
    where ``sin_signed`` carries the sign of ``rotate_half`` so the rotation
    is ``x * cos + roll(x, half) * sin_signed`` (fewer ops than a cat).
    """

    def __init__(
        self, rope_type: str, theta: float, head_dim: int, params: dict[str, Any],
        *, dtype: torch.dtype, device: torch.device | str, initial_len: int = 4096,
    ) -> None:
        inv_freq, self.scaling = rope_inv_freq(rope_type, theta, head_dim, params)
        self.inv_freq = inv_freq.to(device)
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernel: RopeKernel | None = None  # use_kernel
        self.cos_sin_cache: torch.Tensor | None = None  # the kernel's table (kernel_cache)
        self.frozen = False  # set where CUDA graphs will hold the table: it never grows
        self._build(initial_len)

    def _build(self, length: int) -> None:
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # [T, d/2] fp32, same products as transformers
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sign = torch.ones(self.head_dim, device=self.device)
        sign[:half] = -1.0
        self.cos = (emb.cos() * self.scaling).to(self.dtype)
        self.sin_signed = ((emb.sin() * self.scaling).to(self.dtype)) * sign.to(self.dtype)
        self.length = length

    def ensure(self, max_position: int) -> None:
        """Grow the table so positions < max_position can be looked up (ValueError once
        frozen: CUDA graphs hold its address, and a new table would leave them reading
        freed memory)."""
        if max_position > self.length:
            if self.frozen:
                raise ValueError(
                    f"position {max_position - 1} is past the rotary table's {self.length} "
                    "positions, which the captured CUDA graphs hold (the model's positions: "
                    "config.json max_position_embeddings and its rope scaling)")
            self._build(max(max_position, 2 * self.length))
            if self.kernel is not None:
                self.cos_sin_cache = self.kernel_cache()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin_signed[positions]

    def kernel_cache(self) -> torch.Tensor:
        """[length, rotary_dim] fp32: each frequency's cos, then its sin, scaled and not
        rounded (the table FlashInfer's rope reads: vLLM's and SGLang's cos_sin_cache)."""
        pos = torch.arange(self.length, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        return torch.cat([freqs.cos() * self.scaling, freqs.sin() * self.scaling], dim=-1)

    def use_kernel(self, kernel: RopeKernel | None, cache: torch.Tensor | None = None) -> None:
        """Rotate with a device's one-launch kernel from now on (None: the torch form), over
        ``cache`` (this table's kernel_cache, made here when not given)."""
        self.kernel = kernel
        if kernel is None:
            self.cos_sin_cache = None
        else:
            self.cos_sin_cache = cache if cache is not None else self.kernel_cache()

    def rotation(self, positions: torch.Tensor) -> Rotation:
        """The step's rotation of rows at ``positions`` [N]."""
        if self.kernel is not None:  # FlashInfer's checks its ids contiguous
            return Rotation(positions=positions.contiguous(), table=self)
        cos, sin = self.cos_sin(positions)
        return Rotation(cos.unsqueeze(1), sin.unsqueeze(1))


@dataclass
class Rotation:
    """One step's rotary embedding, as each attention layer of the step applies it to its q
    and k: cos and sign-carrying sin rows [N, 1, rotary_dim] gathered once (the torch form),
    or the step's positions for the table's device kernel, which rotates q and k in place
    in one launch (RotaryTable.use_kernel: FlashInfer's on CUDA, cuda_fused.install_rope)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    table: RotaryTable | None = None

    def pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, h, d] and k [N, kvh, d] rotated in their leading rotary_dim dims, the rest
        passed through; in place where the kernel runs (so they must be the step's own)."""
        if self.table is not None:
            assert self.table.kernel is not None and self.table.cos_sin_cache is not None
            self.table.kernel(self.positions, q, k, self.table.cos_sin_cache)
            return q, k
        assert self.cos is not None and self.sin is not None
        r = self.cos.shape[-1]
        if r == q.shape[-1]:
            return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)
        return (torch.cat([apply_rotary(q[..., :r], self.cos, self.sin), q[..., r:]], dim=-1),
                torch.cat([apply_rotary(k[..., :r], self.cos, self.sin), k[..., r:]], dim=-1))

    def joint(self, qk: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k side by side in one tensor [N, heads + kv_heads, d] (full rotary) -> the
        rotated q and k: one rotation of both in the torch form, as in the kernel."""
        if self.table is not None:
            q, k = qk.split_with_sizes([heads, qk.shape[1] - heads], 1)
            return self.pair(q, k)
        assert self.cos is not None and self.sin is not None
        rotated = apply_rotary(qk, self.cos, self.sin)
        q, k = rotated.split_with_sizes([heads, qk.shape[1] - heads], 1)
        return q, k


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] by per-token cos/sin [N, 1, head_dim] (from cos_sin,
    unsqueezed once per step so every layer reuses them)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def apply_rotary_reference(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """Plain transformers-style rotation (rotate_half), for tests."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(x.dtype)[:, None, :]
    sin = (emb.sin() * scaling).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
