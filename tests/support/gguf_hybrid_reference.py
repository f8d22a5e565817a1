"""A GGUF file of the hybrid / MoE families written from a tiny HF checkpoint as llama.cpp's
converter writes one, and the inverse of its transforms: what transformers runs.

Written from convert_hf_to_gguf.py's Qwen2MoeModel (experts stacked into 3-D
``ffn_*_exps``, shared expert ``*_shexp``, router ``ffn_gate_inp``), Qwen3NextModel
(``mtp.*`` dropped, A_log stored as ``-exp(A_log)``, dt_bias as ``ssm_dt.bias``, conv1d
squeezed, every norm but the gated one stored as ``1 + w``, in_proj_qkvz split into
[all q | all k | all v] and z) and _LinearAttentionVReorderBase (Qwen3.5: value heads
reordered from grouped by key head to tiled), and from gguf-py's tensor names for
these architectures. Each tensor is quantised as ``type_of(gguf name)`` says (1-D,
``ssm_conv1d`` and ``ffn_gate_inp`` stay F32, as llama.cpp's quantize keeps them); an
expert stack is quantised one expert's [rows, cols] at a time, row by row.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from support.gguf_reference import _tokenizer_metadata, dequantize, quantize

ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe",
        "qwen3_moe": "qwen3moe"}
# HF name (after model.layers.N.) -> gguf part, as gguf-py's tensor_mapping has it.
_NAMES = {"input_layernorm.weight": "attn_norm",
          "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
          "mlp.down_proj.weight": "ffn_down", "linear_attn.in_proj_qkv.weight": "attn_qkv",
          "linear_attn.in_proj_z.weight": "attn_gate", "linear_attn.in_proj_b.weight": "ssm_beta",
          "linear_attn.in_proj_a.weight": "ssm_alpha", "linear_attn.in_proj_ba.weight": "ssm_ba",
          "linear_attn.conv1d.weight": "ssm_conv1d", "linear_attn.norm.weight": "ssm_norm",
          "linear_attn.out_proj.weight": "ssm_out", "linear_attn.A_log": "ssm_a",
          "linear_attn.dt_bias": "ssm_dt.bias", "mlp.gate.weight": "ffn_gate_inp",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _reorder(t: torch.Tensor, dim: int, n_key: int, ratio: int, head: int, *, back: bool = False):
    """The converter's _reorder_v_heads (grouped by key head -> tiled); ``back``: inverse."""
    shape = list(t.shape)
    dim %= t.dim()
    split = [ratio, n_key] if back else [n_key, ratio]
    t = t.reshape(*shape[:dim], *split, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _gguf_name(hf: str, arch: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, i, sub = hf.split(".", 3)
    if sub == "post_attention_layernorm.weight":  # qwen3moe lists FFN_NORM, the others not
        return f"blk.{i}.{'ffn_norm' if arch == 'qwen3moe' else 'post_attention_norm'}.weight"
    part = _NAMES[sub]
    return f"blk.{i}.{part}" + ("" if part in ("ssm_a", "ssm_dt.bias") else ".weight")


def _heads(c: dict) -> tuple[int, int, int, int]:
    return (c.get("linear_num_key_heads", 0), c.get("linear_num_value_heads", 0),
            c.get("linear_key_head_dim", 0), c.get("linear_value_head_dim", 0))


def qkvz_parts(t: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz, per key head [q, k, v, z] -> ([all q | all k | all v], z)."""
    kh, vh, dk, dv = _heads(c)
    cols = t.shape[1]
    q, k, v, z = t.view(kh, 2 * dk + 2 * (vh // kh) * dv, cols).split(
        [dk, dk, vh // kh * dv, vh // kh * dv], dim=1)
    return (torch.cat([q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)]),
            z.reshape(-1, cols))


def forward(hf: dict[str, torch.Tensor], arch: str, c: dict, fuse_gate_up: bool = False
            ) -> dict[str, torch.Tensor]:
    """HF tensors (text model, model.* names) -> GGUF tensors by name, fp32, unquantised;
    ``fuse_gate_up``: the converter's --fuse-gate-up-exps (ffn_gate_up_exps, gate first)."""
    kh, vh, dk, dv = _heads(c)
    tiled = arch in ("qwen35", "qwen35moe") and kh != vh
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in hf.items():
        t = t.float()
        if tiled and "linear_attn." in name:
            qk = 2 * kh * dk
            if ".in_proj_qkv." in name:
                t = torch.cat([t[:qk], _reorder(t[qk:], 0, kh, vh // kh, dv)])
            elif ".in_proj_z." in name:
                t = _reorder(t, 0, kh, vh // kh, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = _reorder(t, 0, kh, vh // kh, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                t = _reorder(t.unsqueeze(-1), 0, kh, vh // kh, 1).squeeze(-1)
            elif ".conv1d." in name:
                t = t.squeeze()
                t = torch.cat([t[:qk], _reorder(t[qk:], 0, kh, vh // kh, dv)])
            elif ".out_proj." in name:
                t = _reorder(t, 1, kh, vh // kh, dv)
        if arch != "qwen3moe":
            if name.endswith(".A_log"):
                t = -torch.exp(t)
            elif "conv1d" in name:
                t = t.squeeze()
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                t = t + 1
        if ".experts." in name:
            _, _, i, _, _, e, proj, _ = name.split(".")
            experts.setdefault((i, proj), {})[int(e)] = t
            continue
        if "in_proj_qkvz" in name:
            i = name.split(".")[2]
            out[f"blk.{i}.attn_qkv.weight"], out[f"blk.{i}.attn_gate.weight"] = qkvz_parts(t, c)
            continue
        out[_gguf_name(name, arch)] = t
    for (i, proj), by_expert in experts.items():
        out[f"blk.{i}.ffn_{proj.removesuffix('_proj')}_exps.weight"] = torch.stack(
            [by_expert[e] for e in range(len(by_expert))])
    for i in {i for i, _ in experts} if fuse_gate_up else ():
        out[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat(
            [out.pop(f"blk.{i}.ffn_gate_exps.weight"), out.pop(f"blk.{i}.ffn_up_exps.weight")], 1)
    return out


def inverse(g: dict[str, torch.Tensor], arch: str, c: dict, src_names: set[str]
            ) -> dict[str, torch.Tensor]:
    """GGUF tensors (dequantised, fp32) -> the HF checkpoint's tensors, by its names."""
    kh, vh, dk, dv = _heads(c)
    tiled = arch in ("qwen35", "qwen35moe") and kh != vh
    wrapped = any(n.startswith("model.language_model.") for n in src_names)
    prefix = "model.language_model." if wrapped else "model."
    by_gguf = {}
    for hf in src_names:
        plain = hf.replace("model.language_model.", "model.")
        if ".experts." in plain or "in_proj_qkvz" in plain or plain.startswith(("mtp.", "model.visual.")):
            continue
        by_gguf[_gguf_name(plain, arch)] = hf
    out: dict[str, torch.Tensor] = {}
    for name, t in g.items():
        hf = by_gguf.get(name, "")
        if name.endswith("_exps.weight"):
            i, proj = name.split(".")[1], name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            halves = t.chunk(2, dim=1) if proj == "gate_up" else (t,)
            for half, name_of in zip(halves, ("gate", "up") if proj == "gate_up" else (proj,),
                                     strict=True):
                for e in range(t.shape[0]):
                    out[f"{prefix}layers.{i}.mlp.experts.{e}.{name_of}_proj.weight"] = half[e]
            continue
        if name.endswith(("attn_qkv.weight", "attn_gate.weight")) and arch == "qwen3next":
            continue  # put back together below
        if arch != "qwen3moe":
            if name.endswith(".ssm_a"):
                t = torch.log(-t)
            elif name.endswith("ssm_conv1d.weight"):
                t = t.unsqueeze(1)
            elif name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
                t = t - 1
        if tiled and any(p in name for p in ("attn_qkv", "attn_gate", "ssm_")):
            qk = 2 * kh * dk
            if "attn_qkv" in name:
                t = torch.cat([t[:qk], _reorder(t[qk:], 0, kh, vh // kh, dv, back=True)])
            elif "ssm_conv1d" in name:
                t = torch.cat([t[:qk], _reorder(t[qk:], 0, kh, vh // kh, dv, back=True)])
            elif "attn_gate" in name:
                t = _reorder(t, 0, kh, vh // kh, dv, back=True)
            elif any(p in name for p in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt")):
                t = _reorder(t.unsqueeze(-1), 0, kh, vh // kh, 1, back=True).squeeze(-1)
            elif "ssm_out" in name:
                t = _reorder(t, 1, kh, vh // kh, dv, back=True)
        out[hf] = t
    if arch == "qwen3next":
        for name in [n for n in g if n.endswith("attn_qkv.weight")]:
            i = name.split(".")[1]
            qkv, z = g[name], g[f"blk.{i}.attn_gate.weight"]
            cols, r = qkv.shape[1], vh // kh
            q, k, v = qkv.split([kh * dk, kh * dk, vh * dv])
            per_head = [q.view(kh, dk, cols), k.view(kh, dk, cols), v.view(kh, r * dv, cols),
                        z.view(kh, r * dv, cols)]
            out[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"] = torch.cat(
                per_head, dim=1).reshape(-1, cols)
    return out


def write_hybrid_gguf(src: Path, out: Path, type_of, *, tokenizer: bool = True,
                      pre: str = "qwen2", fuse_gate_up: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Write ``src`` as GGUF at ``out`` (``pre``: the pre-tokenizer it names); returns the HF tensors (by the checkpoint's names)
    as gguf dequantises the file's tensors, with every transform undone."""
    full = json.loads((src / "config.json").read_text())
    c = {**full, **full.get("text_config", {})}
    arch = ARCH[full["model_type"]]
    tensors = load_file(str(src / "model.safetensors"))
    hf = {n.replace("model.language_model.", "model."): t for n, t in tensors.items()
          if not n.startswith(("mtp.", "model.visual."))}
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(float(c["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if c.get("num_experts"):
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if c.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch != "qwen3moe":
        kh, vh, dk, dv = _heads(c)
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(kh)
        w.add_ssm_time_step_rank(vh)
        w.add_ssm_inner_size(dv * vh)
        w.add_full_attention_interval(c.get("full_attention_interval", 4))
        partial = c["rope_parameters"].get("partial_rotary_factor", 0.25)
        w.add_rope_dimension_count(int(c["head_dim"] * partial))
        sections = c["rope_parameters"].get("mrope_section")
        if sections:  # as the converter writes Qwen-VL text models' M-RoPE, padded to 4
            w.add_rope_dimension_sections([*sections, *[0] * (4 - len(sections))])
    if tokenizer:
        _tokenizer_metadata(w, src, pre)
    deq: dict[str, torch.Tensor] = {}
    for name, t in forward(hf, arch, c, fuse_gate_up).items():
        x = t.numpy()
        keep = x.ndim == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight"))
        typ = "F32" if keep else type_of(name)
        rows = x.reshape(-1, x.shape[-1])  # an expert stack: row by row, as ggml quantises
        data = quantize(rows, typ)
        deq[name] = torch.from_numpy(dequantize(data, typ).reshape(x.shape).copy())
        data = data.reshape(*x.shape[:-1], -1) if typ not in ("F32", "F16") else data.reshape(x.shape)
        w.add_tensor(name, data, raw_dtype=None if typ in ("F32", "F16") else T[typ])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return inverse(deq, arch, c, set(tensors))


def reference_dir(src: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """``src`` with its weights replaced by ``weights`` (fp32): what transformers runs."""
    shutil.copytree(src, out)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    if "text_config" in cfg:
        cfg["text_config"]["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
