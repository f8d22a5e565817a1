"""Load a model path into our model: open → detect → build → attach → load → finish.

The one orchestration of a load, for every checkpoint format (base.py says what each
step is): the config is read once, the format found by asking each in :data:`FORMATS`
in turn, the model built at its final per-rank size, and the format given each of its
steps. Nothing here names a format or a quantisation scheme.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from helexa.neuron.formats.base import (
    Checkpoint,
    CheckpointFormat,
    ProgressFn,
    UnsupportedQuantization,
    open_checkpoint,
)
from helexa.neuron.formats.compressed_tensors import CompressedTensors
from helexa.neuron.formats.gguf.format import Gguf
from helexa.neuron.formats.gptq import Gptq
from helexa.neuron.formats.quantise import QuantiseAtLoad, QuantSpec
from helexa.neuron.formats.tensor_map import MissingTensor
from helexa.neuron.formats.unquantised import Unquantised
from helexa.neuron.models import deferred
from helexa.neuron.models.config import ModelConfig, parse_dtype
from helexa.neuron.models.registry import build_model

# Asked in this order; the first that claims a checkpoint loads it.
FORMATS: tuple[type[CheckpointFormat], ...] = (Gguf, CompressedTensors, Gptq, QuantiseAtLoad,
                                               Unquantised)


def detect(ckpt: Checkpoint, quantize: QuantSpec | None = None) -> CheckpointFormat:
    """The format of ``ckpt`` (with the entry's ``quantize``), or why none loads it."""
    for cls in FORMATS:
        fmt = cls.detect(ckpt, quantize)
        if fmt is not None:
            return fmt
    method = ckpt.quantization_config.get("quant_method")
    known = ", ".join(cls.describes for cls in FORMATS if cls.describes)
    raise UnsupportedQuantization(f"{ckpt.path}: quantization_config.quant_method {method!r} "
                                  f"is not supported ({known} are)")


def resolve_dtype(cfg: ModelConfig, dtype: str | torch.dtype) -> torch.dtype:
    """"auto" means the checkpoint's own dtype (config torch_dtype / dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return parse_dtype(cfg.torch_dtype if dtype == "auto" else dtype)


def load_model(model_path: str | Path | Checkpoint, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "auto", tp_rank: int = 0, tp_size: int = 1,
               progress: ProgressFn | None = None, quantize: QuantSpec | None = None) -> nn.Module:
    """Build the model for ``model_path`` (or an opened Checkpoint, whose config is not
    read again) and load this rank's weights; ``quantize`` quantises a float checkpoint
    at load (quantise.py)."""
    ckpt = model_path if isinstance(model_path, Checkpoint) else open_checkpoint(model_path)
    fmt = detect(ckpt, quantize)
    torch_dtype = resolve_dtype(ckpt.config, dtype)
    # linear weights built where the format wants them first (models/deferred.py)
    defer = "meta" if fmt.packed else (
        "cpu" if fmt.stages_float and torch.device(device).type != "cpu" else None)
    with torch.device(device), deferred.deferred_weights(defer) if defer else nullcontext():
        model = build_model(ckpt.config, tp_rank=tp_rank, tp_size=tp_size, dtype=torch_dtype,
                            device=device)
    fmt.attach(model)
    deferred.materialise(model, device)  # the float weights the format left: real now
    fmt.load(model, progress)
    fmt.finish(model)  # before finalize: what is quantised is the checkpoint's weight
    deferred.settle(model)  # what was staged on the host and stays float: home now
    model.finalize()
    # a part the model loads whole or not at all (the vision tower) that came in part
    partial: list[str] = getattr(model, "missing_tensors", [])
    if partial:
        raise MissingTensor(f"checkpoint is missing {len(partial)} tensor(s): "
                            + ", ".join(partial[:8]) + (" …" if len(partial) > 8 else ""))
    model.eval()
    return model


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
