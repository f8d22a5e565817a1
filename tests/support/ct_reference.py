"""compressed-tensors checkpoints made with the library itself (test-only dependency), and
the float checkpoint of their dequantised weights for transformers to run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scheme(bits: int, symmetric: bool, group: int | None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def qparams(w: torch.Tensor, bits: int, symmetric: bool, group: int | None):
    """Min/max scales and zero points (int8, the library's convention q = round(w/s) + zp)."""
    n, k = w.shape
    g = w.float().view(n, k // (group or k), -1)
    qmax = (1 << (bits - 1)) - 1
    if symmetric:
        scale = (g.abs().amax(-1) / qmax).to(w.dtype)
        return scale, torch.zeros_like(scale, dtype=torch.int8)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (2 * qmax + 1)).to(w.dtype)
    zp = (torch.round(-lo / scale.float()) - (qmax + 1)).clamp(-qmax - 1, qmax).to(torch.int8)
    return scale, zp


def compress(w: torch.Tensor, bits: int, symmetric: bool, group: int | None):
    """(the checkpoint's tensors for this weight, the library's own dequantised weight)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    sc = scheme(bits, symmetric, group)
    scale, zp = qparams(w, bits, symmetric, group)
    out = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, sc)
    return out, PackedQuantizationCompressor.decompress(dict(out), sc)["weight"]


def ct_checkpoint(src: Path, dst: Path, ref: Path, bits: int, symmetric: bool,
                  group: int | None) -> tuple[Path, Path]:
    """``dst``: ``src`` compressed (lm_head ignored, as llm-compressor recipes do);
    ``ref``: the same model with the library's dequantised weights, in float."""
    for d in (dst, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    packed: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            if name.endswith(".weight") and name.split(".")[-2] in QUANTISED:
                out, deq = compress(t, bits, symmetric, group)
                base = name[: -len("weight")]
                packed.update({base + k: v.contiguous() for k, v in out.items()})
                floats[name] = deq.contiguous()
            else:
                packed[name] = floats[name] = t
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": scheme(bits, symmetric, group).weights.model_dump(),
                                      "input_activations": None, "output_activations": None}}}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref
