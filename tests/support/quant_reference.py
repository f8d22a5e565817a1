"""A float checkpoint holding the weights our quantised load computes with, dequantised:
what transformers runs as the reference for a quantised model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helexa.kernels import quant as qk
from helexa.neuron.formats.quantise import QuantSpec, quantize_int4, quantize_int8


def dequantized_weight(name: str, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The float weight that ``name`` computes with under ``spec`` (as helexa/neuron/formats/quantise.py)."""
    if w.dim() != 2 or not (name.endswith("proj.weight") or "embed_tokens" in name
                            or name.startswith("lm_head")):
        return w
    if spec.kind == "int4" and name.endswith("proj.weight"):
        q, s, z = quantize_int4(w, spec.group_size, w.dtype)
        return qk.dequantize_int4(q, s, z, spec.group_size).to(w.dtype)
    return qk.dequantize_int8(*quantize_int8(w, dtype=w.dtype)).to(w.dtype)


def dequantized_checkpoint(src: Path, dst: Path, spec: QuantSpec) -> Path:
    """Copy of the checkpoint folder ``src`` whose quantised tensors are replaced by their
    dequantised values (config and tokenizer unchanged)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({n: dequantized_weight(n, t, spec).contiguous() for n, t in tensors.items()},
                  str(dst / f.name), metadata={"format": "pt"})
    return dst
