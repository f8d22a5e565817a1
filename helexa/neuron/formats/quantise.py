"""Quantise-at-load: a float safetensors checkpoint's weights made int8 or int4 as they load.

Each marked layer's float weight is loaded as usual (this rank's shard), then its
method turns it into the packed layout of helexa/kernels/quant.py and installs the
product as the layer's ``kernel`` (methods.py); the float weight is freed. Models
never see any of this: they call their layers as before.

``quantize = "int8"``: every linear, the LM head and the embedding int8, one
scale per output row (symmetric). ``"int4"``: the decoder's linears int4 in
groups of ``group_size`` along the input (asymmetric: a scale and a zero per
group), the LM head and the embedding int8 (the head is the layer most
sensitive to error and a small share of the bytes). A MoE block's routed experts
are quantised as its linears are, each expert a weight of its own, once the load is
done (:func:`quantise_experts`), and run on the quantised stacks' op
(helexa/neuron/formats/gguf/experts.py ``QuantExperts``); its router stays float.

Quantisation is of the checkpoint's tensor, independent of tensor parallelism:
an int8 row scale is the absmax of the whole row (row-parallel layers read it
from the full tensor at load), and int4 groups never straddle ranks (a
row-parallel shard whose width is not a whole number of groups is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from helexa.kernels import quant as qk
from helexa.neuron.formats.base import Checkpoint, LinearMethod, asks_quantize
from helexa.neuron.formats.gguf.experts import QuantExperts
from helexa.neuron.formats.methods import Int4Linear, Int8Linear, Int8Lookup, QuantConfigError
from helexa.neuron.formats.streaming import SafetensorsFormat
from helexa.neuron.models import deferred
from helexa.neuron.models.layers import (
    ParallelLinearBase,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from helexa.neuron.models.moe import SparseMoeBlock

QUANT_KINDS = ("none", "int8", "int4")


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
    # absmax: from the checkpoint's whole rows, read on the host
    amax = w.abs().amax(dim=1) if absmax is None else absmax.to(w.device, torch.float32)
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


# ---------------------------------------------------------------- the format


class QuantiseAtLoad(SafetensorsFormat):
    """A float safetensors checkpoint with ``quantize`` = int8 or int4."""

    stages_float = True  # on a GPU the float weights wait in host memory (loader.py)

    def __init__(self, ckpt: Checkpoint, spec: QuantSpec) -> None:
        super().__init__(ckpt)
        self.spec = spec
        # id(float weight) -> its int8 pair: a tied head shares the embedding's rows
        self.int8_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> QuantiseAtLoad | None:
        if ckpt.gguf is not None or ckpt.quantization_config or not asks_quantize(quantize):
            return None
        assert quantize is not None
        return cls(ckpt, quantize)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if isinstance(layer, VocabParallelEmbedding):  # the LM head and the embedding: int8
            return AtLoadMethod(self, "int8", 0)
        if isinstance(layer, ParallelLinearBase):
            return AtLoadMethod(self, self.spec.kind, self.spec.group_size)
        return None

    def attach(self, model: nn.Module) -> None:
        super().attach(model)
        for name, mod in model.named_modules():
            if isinstance(mod, SparseMoeBlock):  # refused now, not after the whole load
                _check_experts(name, mod, self.spec)
                if self.spec.kind == "int8" and mod.tp_size > 1:
                    _wrap_expert_absmax(mod)

    def finish(self, model: nn.Module) -> None:
        super().finish(model)
        for mod in model.modules():
            if isinstance(mod, SparseMoeBlock) and mod.experts_kernel is None:
                quantise_experts(mod, self.spec, self.dtype)


def quantise_experts(mlp: SparseMoeBlock, spec: QuantSpec, dtype: torch.dtype) -> None:
    """A MoE block's float expert stacks (w13 [E, 2 x inter, hidden], w2 [E, hidden, inter])
    -> the quantised stacks QuantExperts runs, each expert quantised as a linear of its own
    (int8: a scale a row, from the whole row at tp > 1; int4: groups of ``group_size``),
    one expert at a time on the stack's home device (a stack staged in host memory moves
    there an expert at a time); the float stacks are freed."""
    kernel = QuantExperts(mlp)
    absmax: dict[int, torch.Tensor] = getattr(mlp, "w2_absmax", {})
    for which in ("w13", "w2"):
        w = getattr(mlp, which)
        at = deferred.home(mlp, w)
        e, rows, k = w.shape
        if spec.kind == "int8":  # grouped int8 of one group a row: the per-row layout
            qs = torch.empty(e, rows, k, dtype=torch.int8, device=at)
            ss = torch.empty(e, rows, 1, dtype=dtype, device=at)
            for i in range(e):
                whole = absmax.get(i) if which == "w2" else None
                q, sc = quantize_int8(w[i].to(at), whole, dtype)
                qs[i], ss[i, :, 0] = q, sc
            mlp.register_buffer(f"{which}_qweight", qs, persistent=False)
            mlp.register_buffer(f"{which}_qscales", ss, persistent=False)
            kernel.ops[which] = ("int8g", k, rows)
        else:
            packed, sz = [], []
            for i in range(e):
                q, sc, z = quantize_int4(w[i].to(at), spec.group_size, dtype)
                packed.append(qk.int4_pack(q))
                sz.append(qk.int4_scales_zeros(sc, z, dtype))
            mlp.register_buffer(f"{which}_qweight", torch.stack(packed), persistent=False)
            mlp.register_buffer(f"{which}_qscales_zeros", torch.stack(sz), persistent=False)
            kernel.ops[which] = ("int4", spec.group_size, rows)
        del mlp._parameters[which]
        mlp.register_buffer(which, torch.empty(0, dtype=w.dtype, device=at), persistent=False)
    mlp.__dict__.pop("w2_absmax", None)
    mlp.experts_kernel = kernel


def _check_experts(name: str, mlp: SparseMoeBlock, spec: QuantSpec) -> None:
    if spec.kind != "int4":
        return
    for which in ("w13", "w2"):
        _, n, k = getattr(mlp, which).shape
        _check_int4_shape(f"{name}.{which}", n, k, spec.group_size,
                          f"{k} input features per rank", "ranks or experts' rows")


def _wrap_expert_absmax(mlp: Any) -> None:
    """int8 at tp > 1: each expert's down projection is split by its inputs, so each rank
    keeps the whole rows' absmax as they load (its scales then are tp's own, as a
    row-parallel linear's)."""
    inner = mlp.w2.weight_loader
    mlp.w2_absmax = {}

    def loader(param: nn.Parameter, loaded: Any, shard: Any) -> None:
        mlp.w2_absmax[shard] = whole_row_absmax(loaded, param.dtype)
        inner(param, loaded, shard)

    mlp.w2.weight_loader = loader


class AtLoadMethod(LinearMethod):
    """One layer quantised at load: int8 (a scale a row) or int4 (groups of ``group_size``)."""

    def __init__(self, fmt: QuantiseAtLoad, kind: str, group_size: int) -> None:
        self.fmt, self.kind, self.group_size = fmt, kind, group_size
        self.absmax: torch.Tensor | None = None  # int8 row-parallel: whole-row absmax, read at load

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        """The float weight stays; a row-parallel int8 layer reads its rows' absmax from
        the whole tensor as it loads, an int4 one is checked against its rank's shape."""
        if self.kind == "int4":
            _check_int4(prefix, layer, self.group_size)
        if self.kind == "int8" and isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            _wrap_absmax_loader(layer, self)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w, dtype = layer.weight, self.fmt.dtype
        if w.numel() == 0:
            return  # done already
        data = w.data.to(deferred.home(layer, w))  # a weight staged on the host: one layer
        if self.kind == "int8":
            rows = self.fmt.int8_rows
            if id(w) not in rows:  # a tied head shares the embedding's rows
                rows[id(w)] = quantize_int8(data, self.absmax, dtype)
            q, s = rows[id(w)]
            layer.register_buffer("qweight", q, persistent=False)
            layer.register_buffer("qscales", s, persistent=False)
            layer.kernel = Int8Linear(layer)
        else:
            q, s, z = quantize_int4(data, self.group_size, dtype)
            layer.register_buffer("qweight", qk.int4_pack(q), persistent=False)
            layer.register_buffer("qscales_zeros", qk.int4_scales_zeros(s, z, dtype),
                                  persistent=False)
            layer.kernel = Int4Linear(layer, self.group_size, q)
        self.absmax = None
        if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
            layer.lookup = Int8Lookup(layer)
        # its float weight goes now, not once every layer is done: the load peaks at the
        # float model and one layer's quantised copy (a tied head's float goes with the
        # later of its two layers, which both hold it)
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=deferred.home(layer, w)),
                                    requires_grad=False)


def _check_int4(name: str, mod: Any, group: int) -> None:
    n, k = mod.weight.shape
    _check_int4_shape(name, n, k, group, f"{k * mod.tp_size} input features / "
                      f"tp={mod.tp_size} = {k} per rank")


def _check_int4_shape(name: str, n: int, k: int, group: int, inputs: str,
                      straddles: str = "ranks") -> None:
    """A rank's [n, k] share of an int4 weight: whole groups of ``group`` inputs a row,
    and rows by the packer's multiple."""
    if k % group:
        raise QuantConfigError(f"{name}: int4 groups of {group} would straddle {straddles}: "
                               f"{inputs}, not a multiple of {group}")
    if n % qk.INT4_ROW_MULTIPLE:
        raise QuantConfigError(f"{name}: int4 needs output rows per rank divisible by "
                               f"{qk.INT4_ROW_MULTIPLE}, got {n}")


def whole_row_absmax(loaded: Any, dtype: torch.dtype) -> torch.Tensor:
    """Each row's absmax over the checkpoint tensor's every column (all ranks' shards), of
    the rows as the model holds them: rounded to its ``dtype`` first (a float32 file
    served in bf16), as tp = 1 quantises them. The int8 row scale of a row-parallel shard."""
    return loaded[:].to(dtype).float().abs().amax(dim=1)


def _wrap_absmax_loader(mod: Any, method: AtLoadMethod) -> None:
    inner = mod.weight.weight_loader

    def loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 2:  # the weight: each row's absmax over all ranks' columns
            method.absmax = whole_row_absmax(loaded, param.dtype)
        inner(param, loaded, shard_id)

    mod.weight.weight_loader = loader
