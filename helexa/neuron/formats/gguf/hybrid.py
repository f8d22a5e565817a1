"""GGUF tensors of the hybrid and MoE families, put back into the Hugging Face tensors
HybridForCausalLM loads (docs/quantization.md, "GGUF files").

llama.cpp's converter (convert_hf_to_gguf.py: Qwen2MoeModel, Qwen3NextModel and, for
Qwen3.5, _LinearAttentionVReorderBase) transforms these tensors on the way in; each
is undone here, on the unpacked form ``(q, scale, zero)`` where the transform moves
whole rows (or whole sub-blocks of columns), so quantised layers keep the file's values:

- names: ``attn_qkv`` / ``attn_gate`` are the linear-attention in_proj_qkv / in_proj_z
  (Qwen3-Next's grouped in_proj_qkvz split into [all q | all k | all v] and z, which is
  Qwen3.5's spelling); ``ssm_beta``, ``ssm_alpha`` (Qwen3-Next: ``ssm_ba``), ``ssm_out``,
  ``ssm_norm``, ``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias``; ``post_attention_norm``;
  ``ffn_gate_inp`` the router, ``*_shexp`` the shared expert, ``ffn_*_exps`` the experts
  stacked [experts, rows, cols];
- ``ssm_a`` holds ``-exp(A_log)``: A_log = log(-ssm_a);
- every RMSNorm but the gated one holds ``1 + w`` (the HF weight is ``w``): minus 1;
- ``ssm_conv1d`` was squeezed from [channels, 1, kernel]: unsqueezed;
- Qwen3.5 with more value heads than key heads: the value heads were reordered from
  grouped by key head to tiled (rows of the v part of in_proj_qkv, of in_proj_z, b, a,
  the conv's v channels, A_log, dt_bias; ssm_out's input columns): put back.

Multi-token-prediction weights (``mtp.*``) are dropped by that converter for these
families, so a GGUF file has none to keep in ``extra_tensors``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from helexa.checkpoint.gguf import GgufError
from helexa.checkpoint.gguf_layout import EXPERTS, part_of, reorders_value_heads
from helexa.neuron.formats.gguf.unpack import UNPACKERS, Unpacked, dequantize, float_tensor

Value = Unpacked | torch.Tensor  # a quantised tensor's unpacked form, or a float tensor

_LAYER = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_qkv": "linear_attn.in_proj_qkv",
          "attn_gate": "linear_attn.in_proj_z", "ssm_beta": "linear_attn.in_proj_b",
          "ssm_alpha": "linear_attn.in_proj_a", "ssm_ba": "linear_attn.in_proj_ba",
          "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
          "ssm_out": "linear_attn.out_proj", "ffn_gate_inp": "mlp.gate",
          "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
          "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
          "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_BARE = {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}  # no .weight in HF
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PROJ = {"ffn_gate_exps": ("gate",), "ffn_up_exps": ("up",), "ffn_down_exps": ("down",),
         "ffn_gate_up_exps": ("gate", "up")}


def hf_names(name: str, shape: tuple[int, ...]) -> list[str]:
    """The HF tensor name(s) one llama.cpp tensor becomes (an expert stack: one a expert and
    projection); ``shape`` as torch orders it."""
    where = part_of(name)
    if where is None:
        base, _, kind = name.rpartition(".")
        if base in _TOP:
            return [f"{_TOP[base]}.{kind}"]
    else:
        layer, part = where
        p = f"model.layers.{layer}."
        if part in _BARE:
            return [p + _BARE[part]]
        if part in _PROJ:
            return [f"{p}mlp.experts.{e}.{proj}_proj.weight"
                    for e in range(shape[0]) for proj in _PROJ[part]]
        if part in _LAYER:
            return [f"{p}{_LAYER[part]}.{name.rsplit('.', 1)[1]}"]
    raise GgufError(f"tensor {name!r}: not a tensor of the qwen3moe/qwen3next/qwen35 families")


def text_config(model: Any) -> dict[str, Any]:
    """What the transforms read of the model's config, as config.json names it."""
    c = model.cfg
    return {"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "linear_num_key_heads": c.linear_num_key_heads,
            "linear_num_value_heads": c.linear_num_value_heads,
            "linear_key_head_dim": c.linear_key_head_dim,
            "linear_value_head_dim": c.linear_value_head_dim}


def value_of(name: str, type_name: str, raw: np.ndarray) -> Value:
    """A tensor's unpacked form (quantised) or its float values."""
    if type_name in ("F32", "F16", "BF16"):
        return float_tensor(raw, type_name)
    fn = UNPACKERS.get(type_name)
    if fn is None:
        raise GgufError(f"tensor {name!r} has type {type_name}, which is not supported "
                        f"(supported: F32, F16, BF16, {', '.join(UNPACKERS)})")
    return fn(np.asarray(raw))


def as_float(value: Value) -> torch.Tensor:
    return dequantize(*value) if isinstance(value, tuple) else value


def _rows(value: Value, index: torch.Tensor) -> Value:
    if isinstance(value, tuple):
        return tuple(None if t is None else t[index] for t in value)  # type: ignore[return-value]
    return value[index]


def _grouped(n_key: int, ratio: int, dim: int) -> torch.Tensor:
    """Index that puts tiled value heads ([ratio][key heads][dim]) back grouped by key head
    ([key heads][ratio][dim]): grouped[i] = tiled[index[i]]."""
    return torch.arange(n_key * ratio * dim).view(ratio, n_key, dim).transpose(0, 1).reshape(-1)


def _columns(value: Value, n_key: int, ratio: int, dim: int) -> Value:
    """ssm_out's input columns back to grouped order; on the unpacked form when a head's
    ``dim`` columns are whole sub-blocks, else on the float weight."""
    if isinstance(value, tuple):
        q, scale, zero = value
        group = q.shape[1] // scale.shape[1]
        if dim % group == 0:
            cols = _grouped(n_key, ratio, dim)
            groups = _grouped(n_key, ratio, dim // group)
            return (q[:, cols], scale[:, groups],
                    None if zero is None else zero[:, groups])
        value = as_float(value)
    return value[:, _grouped(n_key, ratio, dim)]


def hybrid_pieces(name: str, type_name: str, raw: np.ndarray, arch: str,
                  cfg: dict[str, Any]) -> Iterator[tuple[str, Value]]:
    """(HF name, value in the HF layout) of one GGUF tensor; ``cfg`` the text config."""
    where = part_of(name)
    part = where[1] if where is not None else ""
    if part in EXPERTS:  # [experts, rows, ...]: each expert's rows unpacked on their own
        names = iter(hf_names(name, (raw.shape[0],)))
        for e in range(raw.shape[0]):
            value = value_of(name, type_name, raw[e])
            rows = (value[0] if isinstance(value, tuple) else value).shape[0]
            halves = (value,) if part != "ffn_gate_up_exps" else (
                _rows(value, torch.arange(rows // 2)), _rows(value, torch.arange(rows // 2, rows)))
            for half in halves:
                yield next(names), half
        return
    value = value_of(name, type_name, raw)
    (hf,) = hf_names(name, ())
    if reorders_value_heads(arch, cfg):
        kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        dk, dv, ratio = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"]), vh // kh
        if part in ("attn_qkv", "ssm_conv1d"):  # [q | k | v]: the v rows / channels
            qk = 2 * kh * dk
            value = _rows(value, torch.cat([torch.arange(qk), qk + _grouped(kh, ratio, dv)]))
        elif part == "attn_gate":
            value = _rows(value, _grouped(kh, ratio, dv))
        elif part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
            value = _rows(value, _grouped(kh, ratio, 1))
        elif part == "ssm_out":
            value = _columns(value, kh, ratio, dv)
    if part == "ssm_a":
        value = torch.log(-as_float(value).float())
    elif part == "ssm_conv1d":
        value = as_float(value).unsqueeze(1)
    elif (arch != "qwen3moe" and name.endswith("norm.weight")
          and not name.endswith("ssm_norm.weight")):
        value = as_float(value).float() - 1.0
    yield hf, value
