"""GGUF weights (llama.cpp's format) loaded into our layers: names, sharding, the op.

Each llama.cpp tensor name maps to the Hugging Face name our models load
(:func:`hf_name`); llama-architecture ``attn_q`` / ``attn_k`` rows, which
llama.cpp's converter permutes for its rotary layout, are put back (:func:`unpermute`).
Before loading, every layer whose tensors are quantised gets, in place of its float
weight, the unpacked form of gguf_unpack.py (``gguf_q`` int8, ``gguf_scale`` and
``gguf_zero`` fp32 per group) in the layout :func:`helexa.checkpoint.gguf.layout_of` picks;
these go through the layer's own weight loader, so each rank reads its rows or
columns and its groups (a split that would cut a group is refused with the numbers).
Once a layer's parts are all in, :func:`install` hands them to the op (docs/quantization.md): grouped
int8 (``quant._install_int8g``) or tinygemm int4 (``quant._install_int4``, ``zero =
8 * scale + zero``); a quantised embedding gathers int8 rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helexa.checkpoint.gguf import (
    FLOAT,
    FLOAT_TYPES,
    QUANT_TYPES,
    GgufError,
    Layout,
    layout_of,
    metadata,
    reader,
)
from helexa.checkpoint.gguf_families import EXPERTS, HYBRID_ARCHITECTURES, part_of, stays_quantised
from helexa.kernels.cpu import kquant
from helexa.neuron.models import gguf_hybrid as hyb
from helexa.neuron.models.gguf_experts import attach_experts, load_piece, stack_of
from helexa.neuron.models.gguf_unpack import Unpacked
from helexa.neuron.models.layers import TensorSlice

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = ("rope_freqs.weight",)  # rope comes from the config


def hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> the checkpoint name our models load (None: not a weight)."""
    if name in _SKIPPED:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    raise GgufError(f"tensor {name!r}: not a tensor of the dense llama/qwen families")


def unpermute(rows: torch.Tensor | np.ndarray, heads: int) -> Any:
    """Undo llama.cpp's ``permute`` of attn_q / attn_k rows (convert_hf_to_gguf.py:
    ``w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)``): per head, rows
    back from interleaved pairs to the two rotary halves. Any row-wise data (raw blocks)."""
    n = rows.shape[0]
    rest = tuple(rows.shape[1:])
    return rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2).reshape(n, *rest)


@dataclass
class GgufLinear:
    """A layer's marker (as quant.LinearQuant): its layout and the model's dtype."""

    layout: Layout
    dtype: torch.dtype
    kind: str = "gguf"
    absmax: None = None
    parts: set[str] = field(default_factory=set)  # GGUF tensors still to load into the layer


def tensor_pieces(name: str, type_name: str, raw: np.ndarray, arch: str,
                  cfg: dict[str, Any]) -> Iterator[tuple[str, hyb.Value]]:
    """(HF name, value in the HF layout) of each tensor one GGUF tensor holds: the dense
    families here, the hybrid and MoE ones in gguf_hybrid.py."""
    if arch in HYBRID_ARCHITECTURES:
        yield from hyb.hybrid_pieces(name, type_name, raw, arch, cfg)
        return
    hf = hf_name(name)
    if hf is None:
        return
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                          "attn_k.bias")):
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        raw = unpermute(np.asarray(raw), heads)
    yield hf, hyb.value_of(name, type_name, raw)


def names_of(name: str, shape: tuple[int, ...], arch: str) -> list[str]:
    """The HF names a GGUF tensor fills (its data not read)."""
    if arch in HYBRID_ARCHITECTURES:
        return hyb.hf_names(name, shape)
    hf = hf_name(name)
    return [] if hf is None else [hf]


def _layer_tensors(model: nn.Module, path: Path, arch: str) -> dict[str, list[str]]:
    """Our linear (and embedding) layer -> the GGUF tensors that fill its weight."""
    from helexa.neuron.models.loader import _target

    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, list[str]] = {}
    for t in reader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if (part_of(t.name) or (0, ""))[1] in EXPERTS:
            continue  # expert stacks: float parameters of the MoE block
        for hf in names_of(t.name, shape, arch):
            target = _target(hf, model, params)
            if not target or not target[0] or not target[0].endswith(".weight"):
                continue
            out.setdefault(target[0].rsplit(".", 1)[0], []).append(t.name)
    return out


def attach_gguf(model: nn.Module, path: Path, dtype: torch.dtype) -> None:
    """Replace the float weight of every layer the GGUF holds quantised by the unpacked
    form, loaded through the layer's own weight loader."""
    from helexa.neuron.models.layers import (
        ParallelLinearBase,
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    arch = metadata(path, "general.architecture")
    cfg = hyb.text_config(model)
    types = {t.name: t.tensor_type.name for t in reader(path).tensors}
    layers = _layer_tensors(model, path, arch)
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    for name, mod in model.named_modules():
        if not isinstance(mod, ParallelLinearBase | VocabParallelEmbedding):
            continue
        head = isinstance(mod, ParallelLMHead)
        names = layers.get("model.embed_tokens" if head and tied else name, [])
        if not names:
            continue  # the loader's missing-tensor check names it
        bad = [n for n in names if types[n] not in QUANT_TYPES and types[n] not in FLOAT_TYPES]
        if bad:
            raise GgufError(f"{path.name}: tensor {bad[0]!r} has type {types[bad[0]]}, which is "
                            f"not supported (supported: {', '.join([*FLOAT_TYPES, *QUANT_TYPES])})")
        lookup = isinstance(mod, VocabParallelEmbedding) and not head
        rows, k = mod.weight.shape
        kept = [types[n] if stays_quantised(arch, (part_of(n) or (0, ""))[1], types[n], cfg)
                else "F32" for n in names]
        layout = layout_of(kept, lookup=lookup or (head and tied), rows=rows)
        if layout == FLOAT:
            continue
        if k % layout.group:
            raise GgufError(
                f"{name}: groups of {layout.group} would straddle ranks: {k * mod.tp_size} input "
                f"features / tp={mod.tp_size} = {k} per rank, not a multiple of {layout.group}")
        if head and tied:  # the head is the embedding's table: install shares its buffers
            mod.quant = GgufLinear(layout, dtype)
            continue
        device = mod.weight.device
        loader = getattr(mod.weight, "weight_loader", mod.weight_loader)  # a layer's own split
        del mod.weight
        mod.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)
        shapes = {"gguf_q": (torch.int8, k), "gguf_scale": (torch.float32, k // layout.group)}
        if layout.zeros:
            shapes["gguf_zero"] = (torch.float32, k // layout.group)
        for pname, (pdtype, width) in shapes.items():
            p = nn.Parameter(torch.zeros(rows, width, dtype=pdtype, device=device),
                             requires_grad=False)
            p.weight_loader = loader  # type: ignore[attr-defined]
            mod.register_parameter(pname, p)
        mod.quant = GgufLinear(layout, dtype, parts=set(names))
    attach_experts(model, path)
    head = getattr(model, "lm_head", None)
    if tied and isinstance(getattr(head, "quant", None), GgufLinear):
        del head.weight  # the shared float table is gone: the head runs the embedding's
        head.register_buffer("weight", model.model.embed_tokens.weight, persistent=False)


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


def load_gguf_weights(model: nn.Module, path: Path, *, on_loaded: Any) -> None:
    """Stream each GGUF tensor into its parameter(s); ``on_loaded(hf_name, key, bytes)``
    records what was filled for the loader's missing-tensor check."""
    from helexa.neuron.models.loader import _target

    params = dict(model.named_parameters(remove_duplicate=False))
    cfg, arch = hyb.text_config(model), metadata(path, "general.architecture")
    for t in reader(path).tensors:
        for name, value in tensor_pieces(t.name, t.tensor_type.name, t.data, arch, cfg):
            if model.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            target = _target(name, model, params)
            if target is None:
                continue
            pname, shard = target
            mod_name, attr = pname.rsplit(".", 1)
            mod = model.get_submodule(mod_name)
            spec = getattr(mod, "quant", None)
            if stack_of(mod, attr) is not None:  # an expert of a quantised stack
                load_piece(mod, mod_name, attr, shard, value, t.name, on_loaded)
                continue
            if attr == "weight" and isinstance(spec, GgufLinear) and "gguf_q" in mod._parameters:
                assert isinstance(value, tuple), "attach_gguf saw the layer's parts quantised"
                parts = dict(zip(("gguf_q", "gguf_scale", "gguf_zero"),
                                 to_layout(value, spec.layout), strict=True))
                for comp, v in parts.items():
                    if v is not None and comp in mod._parameters:
                        p = mod._parameters[comp]
                        with torch.no_grad():
                            p.weight_loader(p, TensorSlice(v), shard)
                        on_loaded(name, (f"{mod_name}.{comp}", shard), 0)
                spec.parts.discard(t.name)
                if not spec.parts:  # all its parts in: the op's layout now, so the unpacked
                    install(mod)  # form (1.25 bytes a value for int4) never piles up
                continue
            param = params.get(pname)
            if param is None:
                raise GgufError(f"{path.name}: unexpected tensor {t.name!r} ({name})")
            with torch.no_grad():
                param.weight_loader(param, TensorSlice(hyb.as_float(value).to(param.dtype)), shard)
            on_loaded(name, (pname, shard), 0)
        on_loaded(None, None, int(t.n_bytes))


# ---------------------------------------------------------------- after loading: the op


def install(mod: nn.Module) -> None:
    """A loaded layer's unpacked form -> its op (called by quant.quantize_model)."""
    from helexa.neuron.models.layers import ParallelLMHead, VocabParallelEmbedding
    from helexa.neuron.models.quant import _install_int4, _install_int8g

    spec: GgufLinear = mod.quant
    if "gguf_q" not in mod._parameters:  # a tied head: the embedding's buffers, same op
        return
    q = mod._parameters.pop("gguf_q").data
    scale = mod._parameters.pop("gguf_scale").data
    p_zero = mod._parameters.pop("gguf_zero", None)
    zero = None if p_zero is None else p_zero.data
    lookup = isinstance(mod, VocabParallelEmbedding) and not isinstance(mod, ParallelLMHead)
    if not lookup and kquant.install(mod, q, scale, zero, spec.dtype):
        return  # CPU, fp32 activations: helexa/kernels/cpu/kquant.py's integer dot products
    if spec.layout.op == "int4":  # tinygemm: w = (q - 8) * scale + zero'
        _install_int4(mod, q.to(torch.uint8), scale, 8 * scale + zero, spec.dtype)
    else:
        _install_int8g(mod, q, scale, zero, spec.dtype)
    if lookup:
        mod.lookup = Int8gLookup(mod, q.shape[1] // scale.shape[1])


def share_tied_head(model: nn.Module) -> None:
    """A tied head runs the embedding's quantised table through the linear op."""
    from helexa.neuron.models.quant import Int8gLinear, Int8Linear

    head, embd = getattr(model, "lm_head", None), model.model.embed_tokens
    if (not model.cfg.tie_word_embeddings or head is None
            or not isinstance(getattr(head, "quant", None), GgufLinear)):
        return
    for buf in ("qweight", "qscales", "qzeros"):
        if hasattr(embd, buf):
            head.register_buffer(buf, getattr(embd, buf), persistent=False)
    head.kernel = (Int8gLinear(head, embd.lookup.group) if hasattr(embd, "qzeros")
                   or embd.qscales.dim() == 2 else Int8Linear(head))


class Int8gLookup:
    """Embedding rows from a grouped int8 table: gathers int8 rows, dequantises only those."""

    def __init__(self, mod: nn.Module, group: int) -> None:
        self.mod, self.group = mod, group

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mod = self.mod
        q = F.embedding(ids, mod.qweight)
        scales = mod.qscales[ids]
        if scales.dim() == ids.dim() + 1 and q.shape[-1] != scales.shape[-1]:
            rows = q.view(*ids.shape, scales.shape[-1], -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
            if hasattr(mod, "qzeros"):
                rows = rows + mod.qzeros[ids].to(dtype).unsqueeze(-1)
            return rows.view(*ids.shape, -1)
        return q.to(dtype) * scales.to(dtype).view(*ids.shape, 1)
