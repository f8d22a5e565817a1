"""GPTQ (checkpoint_format gptq, 4 and 8 bits) written from the format's spec, as AutoGPTQ's
pack() lays it out (auto-gptq needs CUDA to install): min/max quantisation per group
(act-order: groups over a permuted input order), packed, and the float dequantised weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """0..2^bits-1 values [R, C] -> int32 [R, C * bits / 32]: value j of a word at bits
    bits*j..bits*(j+1)-1."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, group: int, g_idx: torch.Tensor, sym: bool, bits: int = 4):
    """w [N, K] -> (q [K, N], zeros [G, N], scales fp16 [G, N]); AutoGPTQ's Quantizer:
    symmetric scale 2 * absmax / maxq about zero (maxq + 1) / 2, else min/max."""
    maxq = (1 << bits) - 1
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    q = torch.empty(k, n, dtype=torch.int64)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].float()
        if sym:
            s = (2 * wg.abs().amax(1) / maxq).clamp_min(1e-6)
            z = torch.full((n,), (maxq + 1) // 2)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp_min(1e-6)
            z = torch.round(-lo / s).clamp(0, maxq).long()
        scales[g] = s.half()
        zeros[g] = z
        q[cols] = (torch.round(wg / scales[g].float()[:, None]) + z[:, None]).clamp(0, maxq).long().t()
    return q, zeros, scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor) -> torch.Tensor:
    """W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n], in fp16, input by input."""
    out = torch.empty(q.shape[1], q.shape[0], dtype=scales.dtype)
    for k in range(q.shape[0]):
        g = int(g_idx[k])
        out[:, k] = (q[k].to(scales.dtype) - zeros[g].to(scales.dtype)) * scales[g]
    return out


def layer_tensors(w: torch.Tensor, group: int, g_idx: torch.Tensor, sym: bool, bits: int = 4):
    """(the checkpoint's tensors for one linear, its dequantised weight)."""
    q, zeros, scales = quantize(w, group, g_idx, sym, bits)
    tensors = {"qweight": pack_words(q.t(), bits).t().contiguous(),  # packed along K
               "qzeros": pack_words(zeros - 1, bits), "scales": scales,
               "g_idx": g_idx.to(torch.int32)}
    return tensors, dequantize(q, zeros, scales, g_idx)


def gptq_checkpoint(src: Path, dst: Path, ref: Path, group: int, desc_act: bool,
                    sym: bool, bits: int = 4) -> tuple[Path, Path]:
    """``dst``: ``src``'s linears in GPTQ; ``ref``: their dequantised weights, in float.
    Act-order draws one input order per input (shared by q/k/v and by gate/up)."""
    for d in (dst, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    packed, floats = {}, {}
    orders: dict[tuple[str, int], torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        for name, t in sorted(load_file(str(f)).items()):
            part = name.split(".")[-2] if name.endswith(".weight") else ""
            if part not in QUANTISED:
                packed[name] = floats[name] = t
                continue
            k = t.shape[1]
            if desc_act:
                key = (name.rsplit(".", 2)[0] + ("qkv" if part in QUANTISED[:3] else
                                                 "gu" if part in ("gate_proj", "up_proj") else part), k)
                perm = orders.setdefault(key, torch.randperm(k, generator=torch.Generator()
                                                              .manual_seed(len(orders))))
                g_idx = torch.empty(k, dtype=torch.long)
                g_idx[perm] = torch.arange(k) // group
            else:
                g_idx = torch.arange(k) // group
            tensors, deq = layer_tensors(t, group, g_idx, sym, bits)
            base = name[: -len("weight")]
            packed.update({base + key: v for key, v in tensors.items()})
            floats[name] = deq.to(t.dtype)
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                  "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref


# AutoAWQ's GEMM pack(): nibble i of word c holds column 8c + ORDER[i] (autoawq needs CUDA).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """0..15 values [R, C] -> int32 [R, C / 8] in AWQ's interleaved order."""
    v = values.to(torch.int64)
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for c in range(v.shape[1] // 8):
        for i in range(8):
            words[:, c] |= v[:, 8 * c + AWQ_ORDER[i]] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_checkpoint(src: Path, dst: Path, ref: Path, group: int) -> tuple[Path, Path]:
    """``dst``: ``src``'s linears in AWQ GEMM (zero points); ``ref``: dequantised, in float."""
    for d in (dst, ref):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    packed, floats = {}, {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            part = name.split(".")[-2] if name.endswith(".weight") else ""
            if part not in QUANTISED:
                packed[name] = floats[name] = t
                continue
            g_idx = torch.arange(t.shape[1]) // group
            q, zeros, scales = quantize(t, group, g_idx, sym=False)
            base = name[: -len("weight")]
            packed.update({base + "qweight": pack_awq(q), base + "qzeros": pack_awq(zeros),
                           base + "scales": scales})
            floats[name] = dequantize(q, zeros, scales, g_idx).to(t.dtype)
    save_file(packed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref
