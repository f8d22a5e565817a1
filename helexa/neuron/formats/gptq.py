"""GPTQ checkpoints (AutoGPTQ / GPTQModel, ``checkpoint_format`` gptq): 4- and 8-bit
weights, ``desc_act`` false or true, unpacked at load into the int4 layout of
helexa/kernels/quant.py (8 bits: its grouped int8 layout).

Per quantised linear the checkpoint holds (N outputs, K inputs, G groups, b bits):
- ``qweight`` int32 [K * b / 32, N]: 32 / b values a word along K, lowest bits first;
- ``qzeros`` int32 [G, N * b / 32]: the zero points, packed the same way along N, stored
  minus one (the v1 format; a stored -1 reads back as 2^b, as AutoGPTQ reads it);
- ``scales`` [G, N]; ``g_idx`` int32 [K]: the group of each input.
Its float weight is ``W[n, k] = (q[k, n] - (qzeros[g_idx[k], n] + 1)) * scales[g_idx[k], n]``.

With ``desc_act`` (act-order) an input's group is ``g_idx[k]``, not ``k // group_size``:
the layer then sorts its inputs by group (``perm``) so groups are contiguous, as the
op needs, and gathers its input columns by ``perm`` before the product. Layers sharing
an input (q/k/v, gate/up) share one order (GPTQ orders by the input's Hessian); a
row-parallel layer whose order mixes ranks' columns is refused.

AWQ (AutoAWQ's GEMM layout, below) loads through the same method with its own unpacking.
"""

from __future__ import annotations

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
from helexa.neuron.formats.compressed_tensors import unpack_int32
from helexa.neuron.formats.methods import (
    PackAsLoaded,
    QuantConfigError,
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
class GptqScheme:
    group_size: int  # -1 in the file (one group): K
    desc_act: bool
    sym: bool
    awq: bool = False  # AutoAWQ's GEMM layout (below) rather than GPTQ's
    bits: int = 4  # GPTQ: 4 or 8


# AutoAWQ GEMM: qweight int32 [K, N / 8] and qzeros [G, N / 8] packed along N, nibble i of
# a word holding column 8c + AWQ_ORDER[i]; zeros stored as they are; w = (q - z) * s.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def parse_awq_config(qc: dict[str, Any]) -> GptqScheme:
    bits, version = int(qc.get("bits", qc.get("w_bit", 0))), str(qc.get("version", "gemm"))
    if bits != 4 or version.lower() != "gemm":
        raise UnsupportedQuantization(
            f"AWQ: expected bits 4 in the GEMM layout, got bits {bits}, version {version!r}")
    return GptqScheme(int(qc.get("group_size", qc.get("q_group_size", 128))), False,
                      not qc.get("zero_point", True), awq=True)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C / 8] -> values 0..15 uint8 [R, C] in column order."""
    cols = packed.shape[1] * 8
    nib = unpack_int32(packed, 4, cols)
    dest = torch.tensor([(j // 8) * 8 + AWQ_ORDER[j % 8] for j in range(cols)])
    return nib[:, torch.argsort(dest)].contiguous()


def parse_gptq_config(qc: dict[str, Any]) -> GptqScheme:
    bits, fmt = int(qc.get("bits", 0)), qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8) or fmt != "gptq":
        raise UnsupportedQuantization(
            f"GPTQ: expected bits 4 or 8 in checkpoint_format gptq, got bits {bits} in {fmt!r}")
    return GptqScheme(int(qc.get("group_size", 128)), bool(qc.get("desc_act", False)),
                      bool(qc.get("sym", True)), bits=bits)


def unpack_rows(packed: torch.Tensor, rows: int, bits: int = 4) -> torch.Tensor:
    """int32 [R * bits / 32, C] packed along dim 0 -> values 0..2^bits-1 uint8 [rows, C]."""
    return unpack_int32(packed.t(), bits, rows).t().contiguous()


def dequantize_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """The format's float weight [N, K] from unpacked q [K, N], zeros+1 [G, N], scales
    [G, N] and g_idx [K], as the format computes it (in scales' dtype)."""
    g = g_idx.long()
    return (scales[g] * (q.to(scales.dtype) - zeros[g].to(scales.dtype))).t()


class Gptq(SafetensorsFormat):
    """quantization_config.quant_method = "gptq" or "awq"; the LM head stays float."""

    packed = True  # its layers' float weights are built on meta (loader.py)

    describes = "gptq and awq"

    def __init__(self, ckpt: Checkpoint, scheme: GptqScheme) -> None:
        super().__init__(ckpt)
        self.scheme = scheme

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> Gptq | None:
        qc = ckpt.quantization_config
        method = qc.get("quant_method")
        if ckpt.gguf is not None or method not in ("gptq", "awq"):
            return None
        if asks_quantize(quantize):
            assert quantize is not None
            raise UnsupportedQuantization(f"{ckpt.path}: already quantised ({method}); "
                                          f"quantize = {quantize.kind!r} applies to float checkpoints")
        return cls(ckpt, (parse_gptq_config if method == "gptq" else parse_awq_config)(qc))

    def attach(self, model: nn.Module) -> None:
        set_aside_mtp(model)
        self.as_loaded = PackAsLoaded()
        super().attach(model)
        self.as_loaded.count(model, self.ckpt.config.tie_word_embeddings, _PARTS)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        return GptqMethod(self.scheme, self) if isinstance(layer, ParallelLinearBase) else None


_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a GPTQ layer's tensors in the file


class GptqMethod(LinearMethod):
    """A GPTQ (or AWQ) linear: qweight, qzeros, scales and g_idx in place of its float
    weight, unpacked by its own loaders into one byte a value, split by rank."""

    def __init__(self, scheme: GptqScheme, fmt: Gptq) -> None:
        self.scheme, self.fmt = scheme, fmt

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        scheme = self.scheme
        n, k = layer.weight.shape
        row = isinstance(layer, RowParallelLinear)
        full_k = k * (layer.tp_size if row else 1)
        group = full_k if scheme.group_size == -1 else scheme.group_size
        if k % group and not (scheme.group_size == -1 and row):
            raise UnsupportedQuantization(
                f"{prefix}: GPTQ groups of {group} would straddle ranks: {full_k} input "
                f"features / tp={layer.tp_size} = {k} per rank")
        groups = full_k // group if row and scheme.group_size == -1 else k // group
        dtype, device = drop_float_weight(layer)

        def zeros_fn(t: torch.Tensor) -> torch.Tensor:  # [G, N*b/32] -> zero points [N, G]
            if scheme.awq:
                return unpack_awq(t).to(torch.int16).t().contiguous()
            cols = t.shape[1] * 32 // scheme.bits
            return (unpack_int32(t, scheme.bits, cols).to(torch.int16) + 1).t().contiguous()

        def qweight_fn(t: torch.Tensor, c: int = full_k) -> torch.Tensor:  # -> [N, K]
            return unpack_awq(t).t() if scheme.awq else unpack_rows(t, c, scheme.bits).t()

        whole = replicated_loader if row and scheme.group_size == -1 else None
        specs = {
            "qweight": (torch.uint8, (n, k), qweight_fn, None),
            "qzeros": (torch.int16, (n, groups), zeros_fn, whole),
            "scales": (dtype, (n, groups), lambda t: t.t(), whole),
            "g_idx": (torch.int32, (full_k,), lambda t: t, replicated_loader),
        }
        if scheme.awq:  # no g_idx in the file: inputs are in group order
            del specs["g_idx"]
            layer.register_buffer("g_idx", torch.arange(full_k, dtype=torch.int32) // group,
                                  persistent=False)
        for pname, (pdtype, shape, fn, loader) in specs.items():
            self.fmt.as_loaded.part(layer, pname, shape, pdtype, device,
                                    _loader(loader or layer.weight_loader, fn))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Into the int4 op: inputs in group order, ``zero = (8 - z) * scale``; 8 bits into
        the grouped int8 op: ``q - 128`` with ``zero = (128 - z) * scale``, none when every
        zero is 128 (symmetric)."""
        if "qzeros" not in layer._parameters:
            return  # done already
        perm, g_sorted = group_order(layer, self.scheme)
        q, z, s = layer.qweight.data, layer.qzeros.data, layer.scales.data
        if perm is not None:
            q = q[:, perm].contiguous()
        sizes = torch.bincount(g_sorted - g_sorted.min())
        if not bool((sizes == sizes[0]).all()) or sizes.numel() != s.shape[1]:
            raise QuantConfigError(f"GPTQ g_idx: groups of unequal sizes {sizes.tolist()[:8]}")
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            layer._parameters.pop(name, None)
            layer._buffers.pop(name, None)
        dtype = self.fmt.dtype
        if self.scheme.bits == 8:
            q8 = (q.to(torch.int16) - 128).to(torch.int8)
            zeros8 = None if bool((z == 128).all()) else (128 - z.float()) * s.float()
            install_int8g(layer, q8, s, zeros8, dtype, perm)
            return
        install_int4(layer, q, s, (8 - z.float()) * s.float(), dtype, perm)


def _loader(inner: Any, fn: Any) -> Any:
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1 and shard_id is not None:  # fused layers: each part's g_idx
            got = fn(loaded[:]).to(param.dtype)
            if getattr(param, "filled", False) and not torch.equal(param.data, got):
                raise UnsupportedQuantization(
                    f"GPTQ act-order: fused parts ({shard_id}) order their inputs differently")
            param.data.copy_(got)
            param.filled = True  # type: ignore[attr-defined]
            return
        inner(param, UnpackedSlice(loaded, fn), shard_id)

    return load


def group_order(mod: nn.Module, scheme: GptqScheme) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(input order that makes groups contiguous or None when they already are, this
    rank's g_idx in that order)."""
    g_idx = mod.g_idx.data.long()
    k = mod.qweight.shape[1]
    if g_idx.numel() != k:  # row-parallel: this rank's inputs
        start = mod.tp_rank * k
        g_idx = g_idx[start : start + k]
        g_idx = g_idx - g_idx.min()
        if scheme.desc_act and not torch.equal(g_idx.sort().values, g_idx):
            raise UnsupportedQuantization(
                "GPTQ act-order with tensor parallelism: a row-parallel layer's input order "
                "mixes ranks' columns (load it at tp = 1, or a checkpoint without desc_act)")
    if torch.equal(g_idx.sort().values, g_idx):
        return None, g_idx
    perm = torch.argsort(g_idx, stable=True)
    return perm, g_idx[perm]
