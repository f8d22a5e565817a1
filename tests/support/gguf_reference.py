"""A GGUF file written from a tiny HF checkpoint the way llama.cpp's converter writes one,
and the HF folder transformers runs as the reference: the same weights as gguf's own
``dequantize`` gives them.

Q8_0 and BF16 blocks come from ``gguf.quants.quantize``; the package has no quantiser
for the K types, so Q4_K / Q5_K / Q6_K blocks are packed here from the tiny model's
weights (min/max per sub-block, ggml's block layout). Whatever they hold, gguf's
``dequantize`` of them is the reference the tests compare with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, i, sub = base.split(".", 3)
    return f"blk.{i}.{_LAYER[sub]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as it is there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ---------------------------------------------------------------- K-quant packers


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def pack_q6_k(w: np.ndarray) -> np.ndarray:
    n = w.size // 256
    x = w.reshape(n, 16, 16).astype(np.float32)
    s = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0] / -32
    d = (np.abs(s).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(s, d[:, None])), -128, 127).astype(np.int8)
    ds = d[:, None] * sc.astype(np.float32)
    q = (np.clip(np.round(_safe_div(x, ds[..., None])), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 256)
    lo, hi = (q & 0xF).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)


def _pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mm = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([d, mm, md], axis=1).astype(np.uint8)


def _k_quant(w: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    n = w.size // 256
    x = w.reshape(n, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mn = (hi - lo) / qmax, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(mn, dmin[:, None])), 0, 63).astype(np.uint8)
    ds, dm = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.round(_safe_div(x + dm[..., None], ds[..., None])), 0, qmax).astype(np.uint8)
    return q.reshape(n, 256), _f16(d), _f16(dmin), _pack_scale_min(sc, m)


def _nibbles(q: np.ndarray) -> np.ndarray:
    q = (q & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def pack_q4_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _k_quant(w, 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)


def pack_q5_k(w: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _k_quant(w, 31)
    bits = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = sum(bits[:, b] << b for b in range(8)).astype(np.uint8)
    return np.concatenate([d, dmin, scales, qh, _nibbles(q)], axis=1)


_PACK = {"Q4_K": pack_q4_k, "Q5_K": pack_q5_k, "Q6_K": pack_q6_k}


def quantize(w: np.ndarray, typ: str) -> np.ndarray:
    """w fp32 [rows, K] -> the tensor's GGUF data (raw blocks, or F32 / F16)."""
    if typ == "F32":
        return w.astype(np.float32)
    if typ == "F16":
        return w.astype(np.float16)
    if typ in ("Q8_0", "BF16", "Q4_0"):
        return gguf.quants.quantize(w.astype(np.float32), T[typ])
    return _PACK[typ](w.astype(np.float32)).reshape(w.shape[0], -1)


def dequantize(data: np.ndarray, typ: str) -> np.ndarray:
    if typ in ("F32", "F16"):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, T[typ])


# ---------------------------------------------------------------- whole checkpoints


def _tokenizer_metadata(w: gguf.GGUFWriter, src: Path, pre: str = "qwen2") -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    cfg = json.loads((src / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}  # the multimodal wrapper's ids are its text's
    # padded to the embedding's rows, as llama.cpp's converter does (its loader checks them)
    size = max([*vocab.values(), *special.values(), int(cfg.get("vocab_size", 0)) - 1]) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, i in special.items():
        tokens[i], types[i] = text, gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tcfg = json.loads((src / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)  # helexa/fixtures/tiny.py's split pattern is Qwen2's
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(int(cfg["bos_token_id"]))
    w.add_eos_token_id(int(cfg["eos_token_id"]))
    w.add_chat_template(tcfg["chat_template"])


def write_gguf(src: Path, out: Path, type_of, *, tokenizer: bool = True) -> dict[str, np.ndarray]:
    """Write ``src`` (an HF tiny checkpoint) as GGUF at ``out``, each tensor in the type
    ``type_of(gguf_name)`` (1-D tensors: F32, as llama.cpp keeps norms); returns the
    weights as gguf dequantises them, by HF name (rows in HF order)."""
    cfg = json.loads((src / "config.json").read_text())
    arch = cfg["model_type"]
    tensors = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if tokenizer:
        _tokenizer_metadata(w, src)
    deq: dict[str, np.ndarray] = {}
    for hf, t in tensors.items():
        name = gguf_name(hf)
        x = t.float().numpy()
        typ = "F32" if x.ndim == 1 else type_of(name)
        data = quantize(x, typ)
        deq[hf] = dequantize(data, typ).reshape(x.shape)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, heads, None if ".attn_q." in name else kv)
        w.add_tensor(name, data, raw_dtype=None if typ in ("F32", "F16") else T[typ])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


def reference_dir(src: Path, out: Path, deq: dict[str, np.ndarray]) -> Path:
    """``src`` with its weights replaced by ``deq`` (fp32): what transformers runs."""
    shutil.copytree(src, out)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in deq.items()},
              str(out / "model.safetensors"))
    return out
