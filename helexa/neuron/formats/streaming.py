"""Safetensors checkpoints, streamed tensor by tensor: the base of every format stored in them.

Parameters are allocated once at their final (per-rank) size and dtype; each
checkpoint tensor is then opened lazily with ``safe_open(...).get_slice`` and
handed to its parameter's ``weight_loader``, which reads only this rank's
rows or columns. Peak memory is therefore about the model's size plus one
tensor, never twice the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from helexa.neuron.formats.base import Checkpoint, CheckpointFormat, ProgressFn
from helexa.neuron.formats.tensor_map import MissingTensor, check_loaded, expected_tensors, target
from helexa.neuron.models.config import UnsupportedArchitecture

# Checkpoint tensors that carry no weights we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".weight_shape")  # shape: the layer knows its own


class SafetensorsFormat(CheckpointFormat):
    """A format whose tensors are in ``*.safetensors`` files (found when it is detected,
    so a folder without them is refused before the model is built)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt)
        self.files = checkpoint_files(ckpt.path)

    def load(self, model: nn.Module, progress: ProgressFn | None = None) -> None:
        load_weights(model, self.files, tie_word_embeddings=self.ckpt.config.tie_word_embeddings,
                     progress=progress)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files: from model.safetensors.index.json when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise MissingTensor(f"{model_dir}: shard files listed in {index.name} are missing: {missing}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise MissingTensor(f"{model_dir}: no *.safetensors weights (only safetensors are supported)")
    return found


def load_weights(model: nn.Module, files: list[Path], *, tie_word_embeddings: bool,
                 progress: ProgressFn | None = None) -> None:
    """Stream every checkpoint tensor into its parameter; MissingTensor if any is absent."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = expected_tensors(model, tie_word_embeddings=tie_word_embeddings)
    total = sum(_tensor_bytes(f) for f in files)
    done_bytes = 0
    loaded: set[tuple[str, object]] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if tie_word_embeddings and name == "lm_head.weight":
                    continue  # tied: the embedding is the head
                where = target(name, model)
                if where is None:
                    continue
                pname, shard = where
                if pname == "":  # kept whole, unsharded (multi-token-prediction weights)
                    model.extra_tensors[name] = f.get_tensor(name)
                    continue
                param = params.get(pname)
                if param is None:
                    raise UnsupportedArchitecture(f"{path.name}: unexpected tensor {name!r}")
                sl = f.get_slice(name)
                with torch.no_grad():
                    param.weight_loader(param, sl, shard)
                loaded.add((pname, shard))
                done_bytes += _slice_bytes(sl)
                if progress is not None:
                    progress(min(done_bytes, total), total)
    check_loaded(expected, loaded)


def _slice_bytes(sl) -> int:
    numel = 1
    for dim in sl.get_shape():
        numel *= dim
    return numel * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4}.get(sl.get_dtype(), 1)


def _tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in one safetensors file (headers only are read)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return sum(_slice_bytes(f.get_slice(name)) for name in f.keys())
