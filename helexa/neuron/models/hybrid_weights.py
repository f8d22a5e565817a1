"""Checkpoint tensor names of the hybrid and MoE families, mapped onto HybridForCausalLM.

The hub and transformers' save_pretrained name q/k/v, gate/up and every expert's
projections apart; the model fuses them (qkv_proj, gate_up_proj, the stacked
w13 / w2 of the experts, one in_proj for the linear-attention layer), so each
checkpoint tensor maps to (our parameter, shard id) and each parameter knows the
shards it must receive. The text model of ``*ForConditionalGeneration`` lives
under ``model.language_model.``; it is read as if it were ``model.``.
"""

from __future__ import annotations

import re
from typing import Any

from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.moe import SparseMoeBlock

# checkpoint projection -> (our module, shard id), by the name's last two parts
_PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_gate_up", 0),
    "shared_expert.up_proj": ("shared_gate_up", 1),
    "shared_expert.down_proj": ("shared_down", None),
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", "qkv"),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", "z"),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", "b"),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", "a"),
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj", "qkvz"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj", "ba"),
}
_RENAMED = {"linear_attn.conv1d.weight": "linear_attn.conv_weight",
            "linear_attn.norm.weight": "linear_attn.norm_weight",
            "mlp.gate.weight": "mlp.gate", "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate"}
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def parameter_of(name: str, prefix: str) -> tuple[str, Any]:
    """(our parameter name, shard id) of checkpoint tensor `name`."""
    if name.startswith(prefix):
        name = "model." + name[len(prefix):]
    m = _EXPERT.match(name)
    if m:
        mlp, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            return f"{mlp}.w2", expert
        return f"{mlp}.w13", (expert, 0 if proj == "gate" else 1)
    for src, dst in _RENAMED.items():
        if name.endswith(src):
            return name[: -len(src)] + dst, None
    for src, (dst, shard) in _PACKED.items():
        token = f".{src}."
        if token in name:
            return name.replace(token, f".{dst}."), shard
    return name, None


def expected_shards(cfg: ModelConfig, layers: list[Any]) -> dict[tuple[str, Any], str]:
    """Every (parameter, shard) of a model with these decoder layers that loading must
    fill, with the checkpoint name that fills it (for the missing-tensor message)."""
    out: dict[tuple[str, Any], str] = {}
    # Qwen3-Next groups the projections per key head; Qwen3.5 keeps them apart.
    in_proj = (("qkvz", "ba") if cfg.architecture == "Qwen3NextForCausalLM"
               else ("qkv", "z", "b", "a"))
    for index, layer in enumerate(layers):
        p = f"model.layers.{index}."
        if layer.linear:
            for part in in_proj:
                out[(p + "linear_attn.in_proj.weight", part)] = p + f"linear_attn.in_proj_{part}"
            for q in ("conv_weight", "dt_bias", "A_log", "norm_weight"):
                out[(p + f"linear_attn.{q}", None)] = p + f"linear_attn.{q}"
            out[(p + "linear_attn.out_proj.weight", None)] = p + "linear_attn.out_proj.weight"
        else:
            for qkv in ("q", "k", "v"):
                out[(p + "self_attn.qkv_proj.weight", qkv)] = p + f"self_attn.{qkv}_proj.weight"
            for q in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                out[(p + f"self_attn.{q}", None)] = p + f"self_attn.{q}"
        for q in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[(p + q, None)] = p + q
        if isinstance(layer.mlp, SparseMoeBlock):
            out[(p + "mlp.gate", None)] = p + "mlp.gate.weight"
            for e in range(cfg.num_experts):
                out[(p + "mlp.w13", (e, 0))] = p + f"mlp.experts.{e}.gate_proj.weight"
                out[(p + "mlp.w13", (e, 1))] = p + f"mlp.experts.{e}.up_proj.weight"
                out[(p + "mlp.w2", e)] = p + f"mlp.experts.{e}.down_proj.weight"
            if layer.mlp.shared is not None:
                for half in (0, 1):
                    out[(p + "mlp.shared_gate_up.weight", half)] = p + "mlp.shared_expert.*"
                out[(p + "mlp.shared_down.weight", None)] = p + "mlp.shared_expert.down_proj"
                out[(p + "mlp.shared_expert_gate", None)] = p + "mlp.shared_expert_gate"
        else:
            for half in (0, 1):
                out[(p + "mlp.gate_up_proj.weight", half)] = p + "mlp.gate/up_proj.weight"
            out[(p + "mlp.down_proj.weight", None)] = p + "mlp.down_proj.weight"
    out[("model.embed_tokens.weight", None)] = "model.embed_tokens.weight"
    out[("model.norm.weight", None)] = "model.norm.weight"
    if not cfg.tie_word_embeddings:
        out[("lm_head.weight", None)] = "lm_head.weight"
    return out
