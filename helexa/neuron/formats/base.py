"""The checkpoint-format seam: one interface for every way a checkpoint stores its weights.

The loader (loader.py) reads every checkpoint the same way and never names a format:

1. open: the checkpoint's config read once (config.json, or a GGUF file's metadata)
   into a :class:`Checkpoint`;
2. detect: the first format that claims it (each format's :meth:`CheckpointFormat.detect`;
   one that cannot take the request refuses it, naming why);
3. build: the model, float layers at their final per-rank size;
4. attach: the format gives each linear layer (and embedding) its :class:`LinearMethod`,
   which creates the parameters the checkpoint fills in place of the float weight;
5. load: the tensors streamed into those parameters through each one's weight loader;
6. finish: each method turns what was loaded into its op's layout (helexa/kernels/quant.py)
   and installs the layer's ``kernel`` (x -> x @ W^T + b); the model's finalize follows.

As vLLM's QuantizationConfig (``get_quant_method(layer, prefix)``) and QuantizeMethodBase
(``create_weights``, ``apply``, ``process_weights_after_loading``); here ``apply`` is the
kernel a method installs, so a model calls its layers as it always does.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from helexa.checkpoint.gguf import find_gguf, read_config
from helexa.checkpoint.mmproj import find_mmproj
from helexa.checkpoint.vision_shape import processor_settings
from helexa.kernels import quant as qk
from helexa.neuron.models.config import ModelConfig, parse_model_config
from helexa.neuron.models.layers import ParallelLinearBase, VocabParallelEmbedding

if TYPE_CHECKING:
    from helexa.neuron.formats.quantise import QuantSpec

# progress(loaded_bytes, total_bytes), called after each tensor.
ProgressFn = Callable[[int, int], None]


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantisation (or a quantize request on it) this loader does not run."""


@dataclass(frozen=True)
class Checkpoint:
    """A model path opened once: its config as read, and as our models take it."""

    path: Path  # as given: a checkpoint folder, or a .gguf file (or a folder holding one)
    raw: dict[str, Any]  # config.json, or the dict a GGUF file's metadata builds
    config: ModelConfig
    gguf: Path | None  # the GGUF file; None for safetensors
    mmproj: Path | None = None  # a GGUF model's vision tower (llama.cpp's mmproj file)
    # Only the first this-many decoder layers' tensors load (None: all): the truncated
    # model helexa/neuron/formats/gguf/activation.py times.
    first_layers: int | None = None

    @property
    def quantization_config(self) -> dict[str, Any]:
        return self.raw.get("quantization_config") or {}


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a model path's config, the one read of it for a load: an HF config.json (beside
    a GGUF file too), else the GGUF file's metadata (helexa/checkpoint/gguf.py)."""
    p = Path(path)
    gguf = find_gguf(p)
    if gguf is not None:
        raw = read_config(p)
    else:
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path}: no config.json in the model folder")
        raw = json.loads(cfg_path.read_text())
    cfg = parse_model_config(raw)
    if cfg.vision is not None and processor_settings(p) is None:
        # a tower without its image processor cannot take images: the model loads text only
        cfg = replace(cfg, vision=None)
    mmproj = find_mmproj(gguf) if gguf is not None and cfg.vision is not None else None
    return Checkpoint(p, raw, cfg, gguf, mmproj)


def asks_quantize(quantize: QuantSpec | None) -> bool:
    """Whether the model entry asks for quantisation at load (int8 or int4)."""
    return quantize is not None and quantize.kind != "none"


class LinearMethod(ABC):
    """How one layer holds its checkpoint's weight and runs its product; set as the
    layer's ``quant`` (layers.py), which also keeps its norm from folding into it."""

    def create_weights(self, layer: nn.Module, prefix: str) -> None:  # noqa: B027
        """Before loading: the parameters the checkpoint fills (each with its
        ``weight_loader``), in place of the float weight. Default: the float weight."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After loading: what was loaded into the op's layout, ``layer.kernel`` installed
        (an embedding's ``lookup``). Runs once a layer's parts are all in; may run again."""


class CheckpointFormat(ABC):
    """One way a checkpoint stores its weights: found by :meth:`detect`, it gives each
    layer its method (:meth:`get_linear_method`), loads the tensors, finishes the layers."""

    # How a refusal of an unknown quant_method names this format ("" for none).
    describes = ""
    # The checkpoint holds packed tensors in place of most linear weights: the model is
    # built with them on meta and the float ones made real after attach (deferred.py).
    packed = False
    # It reads float weights to pack them itself (quantize at load): on a GPU they are
    # staged in host memory and each is packed onto the card as its layer is done.
    stages_float = False

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.dtype = torch.float32  # the dtype the ops run in: the model's, set in attach

    @classmethod
    @abstractmethod
    def detect(cls, ckpt: Checkpoint, quantize: QuantSpec | None) -> CheckpointFormat | None:
        """This format for ``ckpt`` (and the quantize request), or None if it is not one;
        UnsupportedQuantization (GgufError) when it is one this loader cannot serve."""

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the layer named ``prefix``; None: it stays float."""
        return None

    def attach(self, model: nn.Module) -> None:
        """Before loading: every linear (and embedding) the format quantises gets its
        method, which creates the parameters the checkpoint fills."""
        self.dtype = qk.compute_dtype(next(model.parameters()).dtype)
        for name, mod in model.named_modules():
            if name.startswith("visual."):  # the vision tower stays float (its weights are few)
                continue
            if isinstance(mod, ParallelLinearBase | VocabParallelEmbedding):
                method = self.get_linear_method(mod, name)
                if method is not None:
                    mod.quant = method  # before create_weights: its loaders record into it
                    method.create_weights(mod, name)

    @abstractmethod
    def load(self, model: nn.Module, progress: ProgressFn | None = None) -> None:
        """Stream the checkpoint's tensors into the model; MissingTensor if any is absent."""

    def finish(self, model: nn.Module) -> None:
        """After loading, before the model's finalize: each method's layer into its op."""
        for mod in list(model.modules()):
            method = getattr(mod, "quant", None)
            if isinstance(method, LinearMethod):
                method.process_weights_after_loading(mod)


def set_aside_mtp(model: nn.Module) -> None:
    """A file quantised by a scheme that may or may not cover ``mtp.*``: the MTP head is
    kept aside, not run (speculative decoding then refuses "mtp")."""
    if getattr(model, "mtp", None) is not None:
        model.mtp = None
