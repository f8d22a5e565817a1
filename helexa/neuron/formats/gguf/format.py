"""GGUF files (llama.cpp's format) loaded into our layers: each layer's method, the stream, the op.

Before loading, every layer whose tensors are quantised gets, in place of its float
weight, the unpacked form of unpack.py (``gguf_q`` int8, ``gguf_scale`` and ``gguf_zero``
fp32 per group) in the layout :func:`helexa.checkpoint.gguf_layout.layout_of` picks;
these go through the layer's own weight loader, so each rank reads its rows or columns
and its groups (a split that would cut a group is refused with the numbers). Once a
layer's parts are all in, its method hands them to the op (docs/quantization.md):
grouped int8, or tinygemm int4 with ``zero = 8 * scale + zero``; a quantised embedding
gathers int8 rows, and a tied head runs the embedding's table. The names and the
converter's transforms are names.py and hybrid.py's; expert stacks are experts.py's; a
vision tower from llama.cpp's mmproj file beside the model is mmproj.py's (float).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from helexa.checkpoint.gguf import ARCHITECTURES, GgufError, metadata, reader
from helexa.checkpoint.gguf_layout import (
    EXPERTS,
    FLOAT,
    FLOAT_TYPES,
    QUANT_TYPES,
    Layout,
    layout_of,
    part_of,
    stays_quantised,
)
from helexa.checkpoint.mmproj import mmproj_bytes
from helexa.kernels.cpu import kquant
from helexa.neuron.formats.base import (
    Checkpoint,
    CheckpointFormat,
    LinearMethod,
    ProgressFn,
    UnsupportedQuantization,
    asks_quantize,
)
from helexa.neuron.formats.gguf import hybrid as hyb
from helexa.neuron.formats.gguf.experts import attach_experts, load_piece, stack_of
from helexa.neuron.formats.gguf.mmproj import mmproj_pieces
from helexa.neuron.formats.gguf.names import names_of, tensor_pieces
from helexa.neuron.formats.gguf.unpack import to_layout
from helexa.neuron.formats.methods import (
    Int8gLinear,
    Int8gLookup,
    Int8Linear,
    drop_float_weight,
    install_int4,
    install_int8g,
)
from helexa.neuron.formats.tensor_map import check_loaded, expected_tensors, target
from helexa.neuron.models import deferred
from helexa.neuron.models.config import UnsupportedArchitecture
from helexa.neuron.models.layers import ParallelLMHead, TensorSlice, VocabParallelEmbedding

if TYPE_CHECKING:
    from helexa.neuron.formats.quantise import QuantSpec

# A config.json beside a Qwen3.5 GGUF names the multimodal wrapper: its text model loads.
GGUF_ARCHITECTURES = (*ARCHITECTURES.values(), "Qwen3_5ForConditionalGeneration",
                      "Qwen3_5MoeForConditionalGeneration")


class Gguf(CheckpointFormat):
    """A ``.gguf`` file (or a folder holding one): quantised or not, tensor by tensor."""

    packed = True  # its layers' float weights are built on meta (loader.py)

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        assert ckpt.gguf is not None
        self.path = ckpt.gguf
        self.types = {t.name: t.tensor_type.name for t in reader(self.path).tensors}
        self.arch = metadata(self.path, "general.architecture")
        self.layers: dict[str, list[str]] = {}  # our layer -> the GGUF tensors that fill it
        self.cfg: dict[str, Any] = {}
        self.tied = ckpt.config.tie_word_embeddings

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> Gguf | None:
        if ckpt.gguf is None:
            return None
        if asks_quantize(quantize):
            assert quantize is not None
            raise UnsupportedQuantization(f"{ckpt.gguf}: a GGUF file keeps its own quantisation; "
                                          f"quantize = {quantize.kind!r} applies to float "
                                          "safetensors checkpoints")
        arch = ckpt.config.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedArchitecture(f"{ckpt.gguf}: GGUF loads the architectures "
                                          f"{', '.join(GGUF_ARCHITECTURES)}, not {arch}")
        return cls(ckpt)

    def attach(self, model: nn.Module) -> None:
        """Every layer the file holds quantised gets its unpacked form; then the MoE
        blocks' quantised expert stacks; a tied head the embedding's table."""
        self.cfg = hyb.text_config(model)
        self.layers = self._layer_tensors(model)
        super().attach(model)
        attach_experts(model, self.path)
        head = getattr(model, "lm_head", None)
        if self.tied and isinstance(getattr(head, "quant", None), GgufLinear):
            del head.weight  # the shared float table is gone: the head runs the embedding's
            head.register_buffer("weight", model.model.embed_tokens.weight, persistent=False)

    def _layer_tensors(self, model: nn.Module) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in reader(self.path).tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if (part_of(t.name) or (0, ""))[1] in EXPERTS:
                continue  # expert stacks: float parameters of the MoE block
            for hf in names_of(t.name, shape, self.arch):
                where = target(hf, model)
                if not where or not where[0] or not where[0].endswith(".weight"):
                    continue
                out.setdefault(where[0].rsplit(".", 1)[0], []).append(t.name)
        return out

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        head = isinstance(layer, ParallelLMHead)
        names = self.layers.get("model.embed_tokens" if head and self.tied else prefix, [])
        if not names:
            return None  # the loader's missing-tensor check names it
        types = self.types
        bad = [n for n in names if types[n] not in QUANT_TYPES and types[n] not in FLOAT_TYPES]
        if bad:
            raise GgufError(f"{self.path.name}: tensor {bad[0]!r} has type {types[bad[0]]}, which "
                            f"is not supported (supported: {', '.join([*FLOAT_TYPES, *QUANT_TYPES])})")
        lookup = isinstance(layer, VocabParallelEmbedding) and not head
        rows, k = layer.weight.shape
        kept = [types[n] if stays_quantised(self.arch, (part_of(n) or (0, ""))[1], types[n], self.cfg)
                else "F32" for n in names]
        layout = layout_of(kept, lookup=lookup or (head and self.tied), rows=rows)
        if layout == FLOAT:
            return None
        if k % layout.group:
            raise GgufError(
                f"{prefix}: groups of {layout.group} would straddle ranks: {k * layer.tp_size} "
                f"input features / tp={layer.tp_size} = {k} per rank, not a multiple of "
                f"{layout.group}")
        # a tied head is the embedding's table: nothing of its own to load
        return GgufLinear(self, layout, set() if head and self.tied else set(names))

    def load(self, model: nn.Module, progress: ProgressFn | None = None) -> None:
        expected = _gguf_expected(model, expected_tensors(
            model, tie_word_embeddings=self.tied))
        total = sum(int(t.n_bytes) for t in reader(self.path).tensors)
        mmproj = self.ckpt.mmproj
        total += mmproj_bytes(mmproj) if mmproj is not None else 0
        done = [0]
        loaded: set[tuple[str, object]] = set()

        def on_loaded(name: str | None, key: tuple[str, object] | None, nbytes: int) -> None:
            if key is not None:
                loaded.add(key)
            done[0] += nbytes
            if nbytes and progress is not None:
                progress(min(done[0], total), total)

        self._stream(model, on_loaded)
        if mmproj is not None:
            self._stream_tower(model, mmproj, on_loaded)
        check_loaded(expected, loaded)

    def _stream_tower(self, model: nn.Module, mmproj: Path, on_loaded: Any) -> None:
        """The mmproj's tensors into the vision tower (float: the tower is never quantised)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, value, nbytes in mmproj_pieces(mmproj):
            where = target(name, model) if name else None
            if where is not None:
                pname, shard = where
                param = params.get(pname)
                if param is None:
                    raise GgufError(f"{mmproj.name}: unexpected tensor ({name})")
                with torch.no_grad():
                    param.weight_loader(param, TensorSlice(value.to(param.dtype)), shard)
                on_loaded(name, (pname, shard), 0)
            on_loaded(None, None, nbytes)

    def _stream(self, model: nn.Module, on_loaded: Any) -> None:
        """Each GGUF tensor into its parameter(s); ``on_loaded(hf_name, key, bytes)``
        records what was filled."""
        params = dict(model.named_parameters(remove_duplicate=False))
        keep = self.ckpt.first_layers
        for t in reader(self.path).tensors:
            if keep is not None and (part_of(t.name) or (0, ""))[0] >= keep:
                continue  # a truncated model's: a layer it does not have
            for name, value in tensor_pieces(t.name, t.tensor_type.name, t.data, self.arch,
                                             self.cfg):
                if self.tied and name == "lm_head.weight":
                    continue
                where = target(name, model)
                if where is None:
                    continue
                pname, shard = where
                mod_name, attr = pname.rsplit(".", 1)
                mod = model.get_submodule(mod_name)
                method = getattr(mod, "quant", None)
                if stack_of(mod, attr) is not None:  # an expert of a quantised stack
                    load_piece(mod, mod_name, attr, shard, value, t.name, on_loaded)
                    continue
                if attr == "weight" and isinstance(method, GgufLinear) and "gguf_q" in mod._parameters:
                    method.load_part(mod, mod_name, t.name, value, shard, name, on_loaded)
                    continue
                param = params.get(pname)
                if param is None:
                    raise GgufError(f"{self.path.name}: unexpected tensor {t.name!r} ({name})")
                with torch.no_grad():
                    param.weight_loader(param, TensorSlice(hyb.as_float(value).to(param.dtype)), shard)
                on_loaded(name, (pname, shard), 0)
            on_loaded(None, None, int(t.n_bytes))

    def finish(self, model: nn.Module) -> None:
        super().finish(model)
        share_tied_head(model)


def _gguf_expected(model: nn.Module, expected: dict[tuple[str, object], str]
                   ) -> dict[tuple[str, object], str]:
    """What a GGUF file must fill of ``expected``: a quantised layer's (or expert stack's)
    unpacked parts in place of its weight; Qwen3-Next's in_proj_qkvz as the attn_qkv and
    attn_gate the file holds."""
    out: dict[tuple[str, object], str] = {}
    for (pname, shard), ckpt in expected.items():
        keys = [(pname, shard, ckpt)]
        if shard == "qkvz":
            keys = [(pname, "qkv", ckpt.replace("qkvz", "qkv")),
                    (pname, "z", ckpt.replace("qkvz", "z"))]
        mod_name, attr = pname.rsplit(".", 1)
        prefix = "gguf_" if attr == "weight" else f"gguf_{attr}_"  # a layer, or an expert stack
        parts = [c for c in model.get_submodule(mod_name)._parameters if c.startswith(prefix)
                 and (attr != "weight" or c.count("_") == 1)]
        if parts:
            keys = [(f"{mod_name}.{c}", s, n) for _, s, n in keys for c in parts]
        out.update({(p, s): n for p, s, n in keys})
    return out


class GgufLinear(LinearMethod):
    """A layer the file holds quantised: its layout, and the GGUF tensors still to load."""

    def __init__(self, fmt: Gguf, layout: Layout, parts: set[str]) -> None:
        self.fmt, self.layout, self.parts = fmt, layout, parts

    def create_weights(self, layer: nn.Module, prefix: str) -> None:
        if not self.parts:
            return  # a tied head: install shares the embedding's buffers
        rows, k = layer.weight.shape
        loader = getattr(layer.weight, "weight_loader", layer.weight_loader)  # a layer's own split
        _, device = drop_float_weight(layer)
        shapes = {"gguf_q": (torch.int8, k), "gguf_scale": (torch.float32, k // self.layout.group)}
        if self.layout.zeros:
            shapes["gguf_zero"] = (torch.float32, k // self.layout.group)
        for pname, (pdtype, width) in shapes.items():  # memory from the first part on
            p = deferred.until_loaded((rows, width), pdtype, device)
            p.weight_loader = loader  # type: ignore[attr-defined]
            layer.register_parameter(pname, p)

    def load_part(self, layer: nn.Module, mod_name: str, tensor: str, value: Any, shard: Any,
                  name: str, on_loaded: Any) -> None:
        """One GGUF tensor's unpacked form into the layer's parts; the op once all are in."""
        assert isinstance(value, tuple), "attach saw the layer's parts quantised"
        parts = dict(zip(("gguf_q", "gguf_scale", "gguf_zero"),
                         to_layout(value, self.layout), strict=True))
        for comp, v in parts.items():
            if v is not None and comp in layer._parameters:
                p = deferred.real(layer, comp)
                with torch.no_grad():
                    p.weight_loader(p, TensorSlice(v), shard)
                on_loaded(name, (f"{mod_name}.{comp}", shard), 0)
        self.parts.discard(tensor)
        if not self.parts:  # all its parts in: the op's layout now, so the unpacked
            self.process_weights_after_loading(layer)  # form (1.25 bytes a value) never piles up

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "gguf_q" not in layer._parameters:  # done already, or a tied head (share_tied_head)
            return
        q = layer._parameters.pop("gguf_q").data
        scale = layer._parameters.pop("gguf_scale").data
        p_zero = layer._parameters.pop("gguf_zero", None)
        zero = None if p_zero is None else p_zero.data
        lookup = isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
        if not lookup and kquant.install(layer, q, scale, zero, self.fmt.dtype):
            return  # CPU, fp32 activations: helexa/kernels/cpu/kquant.py's integer dot products
        if self.layout.op == "int4":  # tinygemm: w = (q - 8) * scale + zero'
            install_int4(layer, q.to(torch.uint8), scale, 8 * scale + zero, self.fmt.dtype)
        else:
            install_int8g(layer, q, scale, zero, self.fmt.dtype)
        if lookup:
            layer.lookup = Int8gLookup(layer, q.shape[1] // scale.shape[1])


def share_tied_head(model: nn.Module) -> None:
    """A tied head runs the embedding's quantised table through the linear op."""
    head, embd = getattr(model, "lm_head", None), model.model.embed_tokens
    if (not model.cfg.tie_word_embeddings or head is None
            or not isinstance(getattr(head, "quant", None), GgufLinear)):
        return
    for buf in ("qweight", "qscales", "qzeros"):
        if hasattr(embd, buf):
            head.register_buffer(buf, getattr(embd, buf), persistent=False)
    head.kernel = (Int8gLinear(head, embd.lookup.group) if hasattr(embd, "qzeros")
                   or embd.qscales.dim() == 2 else Int8Linear(head))
