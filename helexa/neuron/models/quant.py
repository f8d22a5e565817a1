"""Weight-only quantisation at load: the linear methods behind the parallel layers.

A parallel linear layer with ``quant`` set is a quantised layer: its float weight
is loaded as usual (this rank's shard), then :func:`quantize_model` turns it into
the packed layout of helexa/kernels/quant.py and installs the method as the layer's
``kernel`` (x -> x @ W^T + b). The float weight is freed. Models never see
any of this: they call their layers as before (as vLLM's ``quant_method``).

``quantize = "int8"``: every linear, the LM head and the embedding int8, one
scale per output row (symmetric). ``"int4"``: the decoder's linears int4 in
groups of ``group_size`` along the input (asymmetric: a scale and a zero per
group), the LM head and the embedding int8 (the head is the layer most
sensitive to error and a small share of the bytes).

Quantisation is of the checkpoint's tensor, independent of tensor parallelism:
an int8 row scale is the absmax of the whole row (row-parallel layers read it
from the full tensor at load), and int4 groups never straddle ranks (a
row-parallel shard whose width is not a whole number of groups is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import quant as qk

QUANT_KINDS = ("none", "int8", "int4")


class QuantConfigError(ValueError):
    """A quantisation that this model's shapes (or this tp) cannot take."""


@dataclass(frozen=True)
class QuantSpec:
    kind: str = "none"  # none | int8 | int4
    group_size: int = 128  # int4 only

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise QuantConfigError(f"quantize: expected one of {QUANT_KINDS}, got {self.kind!r}")
        if self.kind == "int4" and self.group_size not in qk.INT4_GROUP_SIZES:
            raise QuantConfigError(f"quant_group_size: expected one of {qk.INT4_GROUP_SIZES} "
                                   f"for int4, got {self.group_size}")


# ---------------------------------------------------------------- quantisers (fp32 math)


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (int8 [N, K], scales [N] in ``dtype``); symmetric, one scale a row.
    ``absmax`` per row (from the whole row) when ``w`` is one rank's columns."""
    w = w.float()
    amax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    scales = (amax / 127).clamp_min(1e-8).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (values 0..15 uint8 [N, K], scales [N, G], zeros [N, G]) with
    ``w ≈ (q - 8) * scale + zero``; asymmetric min/max per group."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-8).to(dtype)
    s = scales.float()
    q = torch.round((g - lo[..., None]) / s[..., None]).clamp_(0, 15)
    zeros = (lo + 8 * s).to(dtype)  # the float "zero" of tinygemm: value of q = 8
    # zeros was rounded: re-pick each q for the stored (scale, zero) so it is the nearest
    q = torch.round((g - zeros.float()[..., None]) / s[..., None] + 8).clamp_(0, 15)
    return q.to(torch.uint8).view(n, k), scales, zeros


# ---------------------------------------------------------------- linear methods


class Int8Linear:
    """kernel(x, bias) for an int8 layer; holds nothing but references to its buffers."""

    def __init__(self, mod: nn.Module, perm: torch.Tensor | None = None) -> None:
        self.mod = mod
        self.perm = perm  # GPTQ act-order: inputs gathered into the weight's column order

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int8_linear(x, self.mod.qweight, self.mod.qscales, bias)

    def dequantized(self) -> torch.Tensor:
        return qk.dequantize_int8(self.mod.qweight, self.mod.qscales)


class Int4Linear:
    def __init__(self, mod: nn.Module, group_size: int, q: torch.Tensor,
                 perm: torch.Tensor | None = None) -> None:
        self.mod, self.group_size, self.n = mod, group_size, q.shape[0]
        self.perm = perm  # GPTQ act-order: inputs gathered into group order first

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int4_linear(x, self.mod.qweight, self.group_size, self.n,
                              self.mod.qscales_zeros, bias)


class Int8gLinear:
    """kernel(x, bias) for a grouped int8 layer (w = q * scale + zero per group)."""

    def __init__(self, mod: nn.Module, group_size: int, perm: torch.Tensor | None = None) -> None:
        self.mod, self.group_size = mod, group_size
        self.perm = perm  # GPTQ act-order: inputs gathered into group order first

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int8g_linear(x, self.mod.qweight, self.mod.qscales,
                               getattr(self.mod, "qzeros", None), self.group_size, bias)

    def prepare(self, max_num_seqs: int) -> None:
        """Make the op choose its kernels for this layer now (helexa/kernels/cpu/int8g.py measures
        at the first call of each row bucket), not in the first request's decode step."""
        k = self.mod.qweight.shape[1]
        with torch.inference_mode():
            for rows in sorted({1, min(max_num_seqs, 2)}):
                self(torch.zeros(rows, k, dtype=self.mod.qscales.dtype,
                                 device=self.mod.qweight.device), None)

    def dequantized(self) -> torch.Tensor:
        """The float weight [N, K] in the inputs' own order."""
        w = qk.dequantize_int8g(self.mod.qweight, self.mod.qscales,
                                getattr(self.mod, "qzeros", None), self.group_size)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


@dataclass
class LinearQuant:
    """What a layer is to become (set before loading; see attach)."""

    kind: str  # int8 | int4
    group_size: int
    absmax: torch.Tensor | None = None  # int8 row-parallel: whole-row absmax, read at load


def attach(model: nn.Module, spec: QuantSpec) -> None:
    """Mark every linear (and the embedding) of ``model`` for ``spec``; before loading,
    so a row-parallel int8 layer can read its rows' absmax from the whole tensor."""
    from helexa.neuron.models.layers import (
        ParallelLinearBase,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if spec.kind == "none":
        return
    for name, mod in model.named_modules():
        if name.startswith("visual."):  # the vision tower stays float (its weights are few)
            continue
        if isinstance(mod, ParallelLMHead) or (isinstance(mod, VocabParallelEmbedding)):
            mod.quant = LinearQuant("int8", 0)
        elif isinstance(mod, ParallelLinearBase):
            kind = spec.kind
            if kind == "int4":
                _check_int4(name, mod, spec.group_size)
            mod.quant = LinearQuant(kind, spec.group_size)
            if kind == "int8" and isinstance(mod, RowParallelLinear) and mod.tp_size > 1:
                _wrap_absmax_loader(mod)


def _check_int4(name: str, mod: Any, group: int) -> None:
    n, k = mod.weight.shape
    if k % group:
        whole = k * mod.tp_size
        raise QuantConfigError(
            f"{name}: int4 groups of {group} would straddle ranks: {whole} input features"
            f" / tp={mod.tp_size} = {k} per rank, not a multiple of {group}")
    if n % qk.INT4_ROW_MULTIPLE:
        raise QuantConfigError(f"{name}: int4 needs output rows per rank divisible by "
                               f"{qk.INT4_ROW_MULTIPLE}, got {n}")


def _wrap_absmax_loader(mod: Any) -> None:
    inner = mod.weight.weight_loader

    def loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 2:  # the weight: each row's absmax over all ranks' columns
            mod.quant.absmax = loaded[:].float().abs().amax(dim=1)
        inner(param, loaded, shard_id)

    mod.weight.weight_loader = loader


def quantize_model(model: nn.Module) -> None:
    """After loading, before the model's finalize: replace every marked float weight by
    its packed layout and install the product as the layer's kernel."""
    from helexa.neuron.models.layers import ParallelLMHead, VocabParallelEmbedding

    dtype = qk.compute_dtype(next(model.parameters()).dtype)
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(float weight) -> int8 pair
    for mod in list(model.modules()):
        spec: LinearQuant | None = getattr(mod, "quant", None)
        if spec is None:
            continue
        if spec.kind == "ct":
            _from_ct(mod, dtype)
            continue
        if spec.kind == "gptq":
            _from_gptq(mod, dtype)
            continue
        if spec.kind == "gguf":
            from helexa.neuron.models.quant_gguf import install

            install(mod)
            continue
        w = mod.weight
        if spec.kind == "int8":
            if id(w) not in done:  # a tied head shares the embedding's rows
                done[id(w)] = quantize_int8(w.data, spec.absmax, dtype)
            q, s = done[id(w)]
            mod.register_buffer("qweight", q, persistent=False)
            mod.register_buffer("qscales", s, persistent=False)
            mod.kernel = Int8Linear(mod)
        else:
            q, s, z = quantize_int4(w.data, spec.group_size, dtype)
            mod.register_buffer("qweight", qk.int4_pack(q), persistent=False)
            mod.register_buffer("qscales_zeros", qk.int4_scales_zeros(s, z, dtype),
                                 persistent=False)
            mod.kernel = Int4Linear(mod, spec.group_size, q)
        spec.absmax = None
        if isinstance(mod, VocabParallelEmbedding) and not isinstance(mod, ParallelLMHead):
            mod.lookup = _Int8Lookup(mod)
    for mod in model.modules():  # free the float weights (a tied head's goes with the embedding)
        if getattr(mod, "quant", None) is not None and isinstance(mod.weight, nn.Parameter):
            mod.weight = nn.Parameter(torch.empty(0, dtype=mod.weight.dtype,
                                                  device=mod.weight.device), requires_grad=False)


def _from_ct(mod: nn.Module, dtype: torch.dtype) -> None:
    """A compressed-tensors layer's unpacked values (helexa/neuron/models/quant_ct.py) into the op's
    layout: 4 bits -> int4 with zero = -zp * scale, 8 bits -> grouped int8 with the same zero
    (symmetric per channel: the per-row int8 op)."""
    stored, scale = mod.weight_packed.data, mod.weight_scale.data
    zp = getattr(mod, "weight_zero_point", None)
    n, k = stored.shape
    if mod.quant.scheme.num_bits == 8:  # (q - zp) * s = q * s + (-zp * s)
        q = (stored.to(torch.int16) - 128).to(torch.int8)
        _install_int8g(mod, q, scale, None if zp is None else -zp.float() * scale.float(), dtype)
    else:
        zeros = (torch.zeros_like(scale, dtype=torch.float32) if zp is None
                 else -zp.float() * scale.float())
        _install_int4(mod, stored, scale, zeros, dtype)
    for name in ("weight_packed", "weight_scale", "weight_zero_point"):
        if name in mod._parameters:
            del mod._parameters[name]


def _install_int4(mod: nn.Module, q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
                  dtype: torch.dtype, perm: torch.Tensor | None = None) -> None:
    """q 0..15 [N, K] with ``w = (q - 8) * scale + zero`` per contiguous group [N, G] -> the
    int4 op; a group the op does not take (per channel, say) is split evenly: same values."""
    group = q.shape[1] // scale.shape[1]
    if group not in qk.INT4_GROUP_SIZES:
        op_group = next((g for g in reversed(qk.INT4_GROUP_SIZES) if group % g == 0), None)
        if op_group is None:
            raise QuantConfigError(f"int4 group of {group} inputs: the int4 op takes "
                                   f"groups of {qk.INT4_GROUP_SIZES}")
        scale = scale.repeat_interleave(group // op_group, dim=1)
        zeros = zeros.repeat_interleave(group // op_group, dim=1)
        group = op_group
    mod.register_buffer("qweight", qk.int4_pack(q), persistent=False)
    mod.register_buffer("qscales_zeros", qk.int4_scales_zeros(scale, zeros, dtype),
                         persistent=False)
    if perm is not None:
        mod.register_buffer("qperm", perm, persistent=False)
    mod.kernel = Int4Linear(mod, group, q, perm)


def _install_int8g(mod: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                   zeros: torch.Tensor | None, dtype: torch.dtype,
                   perm: torch.Tensor | None = None) -> None:
    """int8 q [N, K] with ``w = q * scale + zero`` per contiguous group [N, G] -> the grouped
    int8 op (helexa/kernels/quant.py); one group per row is the per-channel op when symmetric.
    ``perm``: GPTQ act-order, q's columns are the inputs in that order."""
    group = q.shape[1] // scale.shape[1]
    if group * scale.shape[1] != q.shape[1]:
        raise QuantConfigError(f"grouped int8: {q.shape[1]} inputs are not {scale.shape[1]} "
                               "whole groups")
    if perm is not None:
        mod.register_buffer("qperm", perm, persistent=False)
    if zeros is None and scale.shape[1] == 1:
        mod.register_buffer("qweight", q.contiguous(), persistent=False)
        mod.register_buffer("qscales", scale[:, 0].to(dtype).contiguous(), persistent=False)
        mod.kernel = Int8Linear(mod, perm)
        return
    mod.register_buffer("qweight", q.contiguous(), persistent=False)
    mod.register_buffer("qscales", scale.to(dtype).contiguous(), persistent=False)
    if zeros is not None:
        mod.register_buffer("qzeros", zeros.to(dtype).contiguous(), persistent=False)
    mod.kernel = Int8gLinear(mod, group, perm)


def _from_gptq(mod: nn.Module, dtype: torch.dtype) -> None:
    """A GPTQ layer (helexa/neuron/models/quant_gptq.py) into the int4 op: inputs in group order,
    ``zero = (8 - z) * scale``; 8 bits into the grouped int8 op: ``q - 128`` with ``zero =
    (128 - z) * scale``, none when every zero is 128 (symmetric)."""
    from helexa.neuron.models.quant_gptq import group_order

    perm, g_sorted = group_order(mod)
    q, z, s = mod.qweight.data, mod.qzeros.data, mod.scales.data
    if perm is not None:
        q = q[:, perm].contiguous()
    sizes = torch.bincount(g_sorted - g_sorted.min())
    if not bool((sizes == sizes[0]).all()) or sizes.numel() != s.shape[1]:
        raise QuantConfigError(f"GPTQ g_idx: groups of unequal sizes {sizes.tolist()[:8]}")
    bits = mod.quant.scheme.bits
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        mod._parameters.pop(name, None)
        mod._buffers.pop(name, None)
    if bits == 8:
        q8 = (q.to(torch.int16) - 128).to(torch.int8)
        zeros8 = None if bool((z == 128).all()) else (128 - z.float()) * s.float()
        _install_int8g(mod, q8, s, zeros8, dtype, perm)
        return
    _install_int4(mod, q, s, (8 - z.float()) * s.float(), dtype, perm)


class _Int8Lookup:
    """Embedding rows from the int8 table: gathers int8 rows, scales only those."""

    def __init__(self, mod: nn.Module) -> None:
        self.mod = mod

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = F.embedding(ids, self.mod.qweight).to(dtype)
        return rows * self.mod.qscales[ids].to(dtype).unsqueeze(-1)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held (parameters and buffers, each tensor once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or t.numel() == 0:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
