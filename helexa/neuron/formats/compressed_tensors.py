"""compressed-tensors ``pack-quantized`` checkpoints (what llm-compressor writes): W4A16 and
W8A16 integer weights, unpacked at load into the one layout of helexa/kernels/quant.py.

The checkpoint holds per quantised linear ``weight_packed`` (int32 words, 32/bits
values each, lowest bits first, stored as ``q + 2^(bits-1)``), ``weight_scale``
``[N, groups]``, ``weight_zero_point`` (asymmetric only, packed the same way along
the output dim) and ``weight_shape``; its float weight is ``(q - zp) * scale``.
Modules on the ``ignore`` list (often ``lm_head``) stay float.

Unpacking gives each value one byte ([N, K] uint8, ``q + 8`` for 4 bits); the
layer's own weight loader then splits it, the scales and the zero points by rank
like its float weight (columns and groups alike for row-parallel layers), so
groups never straddle ranks. After loading (:meth:`CtMethod.process_weights_after_loading`)
the result goes into the device op's layout (methods.py): int4 takes ``zero = -zp * scale``
(so ``(q+8 - 8) * s + zero``); int8 symmetric per channel runs on the per-row int8 op,
grouped or asymmetric int8 on the grouped one (``w = q * scale + zero``, same zero).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from helexa.neuron.formats.base import (
    Checkpoint,
    LinearMethod,
    UnsupportedQuantization,
    asks_quantize,
    set_aside_mtp,
)
from helexa.neuron.formats.methods import (
    PackAsLoaded,
    UnpackedSlice,
    drop_float_weight,
    install_int4,
    install_int8g,
)
from helexa.neuron.formats.streaming import SafetensorsFormat
from helexa.neuron.models.layers import ParallelLinearBase, RowParallelLinear, replicated_loader

if TYPE_CHECKING:
    from helexa.neuron.formats.quantise import QuantSpec


@dataclass(frozen=True)
class CtScheme:
    num_bits: int  # 4 or 8
    symmetric: bool
    group_size: int | None  # None: one scale per output channel
    ignore: tuple[str, ...]

    def ignored(self, module_name: str) -> bool:
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module_name):
                    return True
            elif module_name == pat or module_name.endswith("." + pat):
                return True
        return False


def parse_ct_config(qc: dict[str, Any]) -> CtScheme:
    """The scheme of a ``quantization_config`` with quant_method compressed-tensors."""
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "pack-quantized" or len(groups) != 1:
        raise UnsupportedQuantization(
            f"compressed-tensors: expected format pack-quantized with one config group, "
            f"got format {fmt!r} with {len(groups)} groups")
    w = groups[0].get("weights") or {}
    if groups[0].get("input_activations"):
        raise UnsupportedQuantization("compressed-tensors: only weight-only schemes (W4A16, "
                                      "W8A16) are supported, this one quantises activations")
    bits, strategy = int(w.get("num_bits", 0)), w.get("strategy")
    if w.get("type", "int") != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
        raise UnsupportedQuantization(
            f"compressed-tensors weights: expected int 4 or 8 bits by group or channel, got "
            f"{w.get('type')} {bits} bits by {strategy}")
    sym = bool(w.get("symmetric", True))
    group = int(w["group_size"]) if strategy == "group" else None
    return CtScheme(bits, sym, group, tuple(qc.get("ignore") or ()))


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """int32 words [R, W] -> stored values (q + 2^(bits-1)) as uint8 [R, cols]; 4 and 8
    bits never straddle a byte, so the words' little-endian bytes are the values."""
    by = packed.contiguous().view(torch.uint8)  # [R, 4W], lowest byte first (little-endian)
    if num_bits == 8:
        return by[:, :cols].contiguous()
    return torch.stack((by & 0xF, by >> 4), dim=-1).reshape(by.shape[0], -1)[:, :cols].contiguous()


def unpack_zero_point(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Zero points packed along the output dim [ceil(N * bits / 32), G] -> signed int8
    [N rounded up to 32 / bits, G] (the layer's loader takes its rows)."""
    stored = unpack_int32(packed.t(), num_bits, packed.shape[0] * 32 // num_bits).t()
    return (stored.to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)


def dequantize_ct(stored: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  num_bits: int) -> torch.Tensor:
    """The format's float weight, computed as the format computes it (in scale's dtype)."""
    q = stored.to(torch.int16) - (1 << (num_bits - 1))
    group = stored.shape[1] // scale.shape[1]
    x = q.to(scale.dtype)
    if zero_point is not None:
        x = x - zero_point.to(scale.dtype).repeat_interleave(group, dim=1)
    return x * scale.repeat_interleave(group, dim=1)


class CompressedTensors(SafetensorsFormat):
    """quantization_config.quant_method = "compressed-tensors" (pack-quantized)."""

    packed = True  # its layers' float weights are built on meta (loader.py)

    describes = "compressed-tensors pack-quantized"

    def __init__(self, ckpt: Checkpoint, scheme: CtScheme) -> None:
        super().__init__(ckpt)
        self.scheme = scheme
        self.packed_modules: dict[str, Any] = {}

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> CompressedTensors | None:
        qc = ckpt.quantization_config
        if ckpt.gguf is not None or qc.get("quant_method") != "compressed-tensors":
            return None
        if asks_quantize(quantize):
            assert quantize is not None
            raise UnsupportedQuantization(f"{ckpt.path}: already quantised (compressed-tensors); "
                                          f"quantize = {quantize.kind!r} applies to float checkpoints")
        return cls(ckpt, parse_ct_config(qc))

    def attach(self, model: nn.Module) -> None:
        set_aside_mtp(model)
        self.packed_modules = getattr(model, "packed_modules", {})
        self.as_loaded = PackAsLoaded()
        super().attach(model)
        self.as_loaded.count(model, self.ckpt.config.tie_word_embeddings,
                             ("weight_packed", "weight_scale", "weight_zero_point"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if not isinstance(layer, ParallelLinearBase) or self._all_ignored(prefix):
            return None
        return CtMethod(self.scheme, self)

    def _all_ignored(self, name: str) -> bool:
        """Our fused modules (qkv_proj, gate_up_proj) are ignored when their parts are."""
        parts = [src for src, (dst, _) in self.packed_modules.items() if name.endswith("." + dst)]
        if not parts:
            return self.scheme.ignored(name)
        base = name.rsplit(".", 1)[0]
        flags = {self.scheme.ignored(f"{base}.{p}") for p in parts}
        if len(flags) > 1:
            raise UnsupportedQuantization(f"{name}: some of {parts} are ignored and some not")
        return flags.pop()


class CtMethod(LinearMethod):
    """A quantised linear not on the ignore list: the checkpoint's parameters (weight_packed
    as one byte a value, weight_scale, weight_zero_point) in place of its float weight,
    each loaded through the layer's own weight loader."""

    def __init__(self, scheme: CtScheme, fmt: CompressedTensors) -> None:
        self.scheme, self.fmt = scheme, fmt

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        scheme, bits = self.scheme, self.scheme.num_bits
        n, k = layer.weight.shape
        groups = 1 if scheme.group_size is None else k // scheme.group_size
        if scheme.group_size is not None and k % scheme.group_size:
            raise UnsupportedQuantization(
                f"{prefix}: groups of {scheme.group_size} would straddle ranks: "
                f"{k * layer.tp_size} input features / tp={layer.tp_size} = {k} per rank")
        dtype, device = drop_float_weight(layer)
        row = isinstance(layer, RowParallelLinear)
        full_k = k * (layer.tp_size if row else 1)
        params = {"weight_packed": (torch.uint8, k, lambda t, c=full_k: unpack_int32(t, bits, c)),
                  "weight_scale": (dtype, groups, lambda t: t)}
        if not scheme.symmetric:
            params["weight_zero_point"] = (torch.int8, groups,
                                           lambda t: unpack_zero_point(t, bits))
        for pname, (pdtype, width, fn) in params.items():
            inner = layer.weight_loader
            if pname != "weight_packed" and scheme.group_size is None and row:
                inner = replicated_loader  # one scale per whole row: every rank holds it whole
            self.fmt.as_loaded.part(layer, pname, (n, width), pdtype, device,
                                    _unpacking_loader(inner, fn))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The unpacked values into the op's layout: 4 bits -> int4 with zero = -zp * scale,
        8 bits -> grouped int8 with the same zero (symmetric per channel: the per-row op)."""
        if "weight_packed" not in layer._parameters:
            return  # done already
        stored, scale = layer.weight_packed.data, layer.weight_scale.data
        zp = getattr(layer, "weight_zero_point", None)
        dtype = self.fmt.dtype
        if self.scheme.num_bits == 8:  # (q - zp) * s = q * s + (-zp * s)
            q = (stored.to(torch.int16) - 128).to(torch.int8)
            install_int8g(layer, q, scale, None if zp is None else -zp.float() * scale.float(), dtype)
        else:
            zeros = (torch.zeros_like(scale, dtype=torch.float32) if zp is None
                     else -zp.float() * scale.float())
            install_int4(layer, stored, scale, zeros, dtype)
        for name in ("weight_packed", "weight_scale", "weight_zero_point"):
            if name in layer._parameters:
                del layer._parameters[name]


def _unpacking_loader(inner: Any, fn: Any) -> Any:
    def loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        inner(param, UnpackedSlice(loaded, fn), shard_id)

    return loader
