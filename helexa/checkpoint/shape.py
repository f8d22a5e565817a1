"""The one parse of a checkpoint's config.json: the numbers that decide its memory (ModelShape).

The plan, the neuron's model config and the GGUF reader all start from this; multimodal
checkpoints keep the language model under `text_config`, which is what is read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.checkpoint.vision_shape import VisionShape, read_vision_shape

ELT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


_DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "fp32": "fp32", "bfloat16": "bf16",
                "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16"}


# Sliding-window layers are counted as full: a conservative figure (they
# need at most the window), and no model served here has them.
_ATTENTION_LAYERS = {"full_attention", "attention", "sliding_attention"}


def dtype_name(name: str) -> str:
    """`bfloat16`, `torch.bfloat16`, `bf16` → `bf16` (fp32, bf16, fp16)."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPE_NAMES[key]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a checkpoint that decide its memory, from config.json."""

    architecture: str
    model_type: str
    num_layers: int
    full_attention_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str  # fp32 | bf16 | fp16
    tie_word_embeddings: bool
    param_count: int
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0  # linear-attention (gated delta-rule) fields, 0 = dense
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top_k: the experts each token's router picks
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers config.json declares
    rotary_dim: int = 0  # rotated leading dims of each head (partial rotary); 0 = head_dim
    vision: VisionShape | None = None  # a vision-language checkpoint's tower (vision_config)

    @property
    def linear_attention_layers(self) -> int:
        return self.num_layers - self.full_attention_layers


def read_model_shape(config_json: Path | str | dict) -> ModelShape:
    """Shape of a model from its config.json (a path or the parsed dict).

    Multimodal checkpoints keep the language model under `text_config`, and a vision
    tower, if they declare one, under `vision_config` (counted in the parameters).
    """
    raw = config_json if isinstance(config_json, dict) else json.loads(Path(config_json).read_text())
    c = {**raw, **raw.get("text_config", {})}
    layers = _layer_count(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    if c.get("layer_types"):
        full = sum(1 for t in c["layer_types"] if t in _ATTENTION_LAYERS)
    elif c.get("full_attention_interval"):  # layer i is full attention when (i+1) % k == 0
        full = layers // int(c["full_attention_interval"])
    else:
        full = layers
    dtype = c.get("dtype") or c.get("torch_dtype") or raw.get("torch_dtype") or "float32"
    linear = full < layers
    max_pos = int(c.get("max_position_embeddings") or 0)
    shape = ModelShape(
        architecture=(raw.get("architectures") or [c.get("model_type", "?")])[0],
        model_type=str(raw.get("model_type", "?")),
        num_layers=layers, full_attention_layers=full, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, hidden_size=hidden, intermediate_size=int(c.get("intermediate_size") or 0),
        vocab_size=int(c["vocab_size"]), max_position_embeddings=max_pos,
        torch_dtype=dtype_name(dtype),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        param_count=0,
        attn_output_gate=bool(c.get("attn_output_gate", c.get("model_type", "").startswith(
            ("qwen3_next", "qwen3_5")))),
        linear_num_key_heads=int(c.get("linear_num_key_heads", 0)) if linear else 0,
        linear_num_value_heads=int(c.get("linear_num_value_heads", 0)) if linear else 0,
        linear_key_head_dim=int(c.get("linear_key_head_dim", 0)) if linear else 0,
        linear_value_head_dim=int(c.get("linear_value_head_dim", 0)) if linear else 0,
        linear_conv_kernel_dim=int(c.get("linear_conv_kernel_dim", 0)) if linear else 0,
        num_experts=int(c.get("num_experts") or c.get("num_local_experts") or 0),
        num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
        # Mixtral names the expert width intermediate_size; Qwen-MoE has its own key.
        moe_intermediate_size=int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
        mtp_layers=int(c.get("mtp_num_hidden_layers") or 0),
        rotary_dim=_rotary_dim(c, head_dim),
        vision=read_vision_shape(raw),
    )
    sharded, replicated = param_split(shape, tp=1)
    return _replace(shape, param_count=sharded + replicated)


# Far past any published model (the largest have a few hundred): a config.json asking for
# more is corrupt or hostile, and planning or building it took minutes and gigabytes.
MAX_LAYERS = 4096


def _layer_count(value: Any) -> int:
    """config.json's num_hidden_layers as a count; ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 1 <= value <= MAX_LAYERS or value != int(value):
        raise ValueError(f"config.json num_hidden_layers: expected a whole number from 1 to "
                         f"{MAX_LAYERS}, got {value!r}")
    return int(value)


def _rotary_dim(c: dict, head_dim: int) -> int:
    """Each head's rotated dims where the rotary is partial (partial_rotary_factor, in the
    rope parameters or beside them, as models/config.py reads it); 0 = all of head_dim."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    partial = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
        or c.get("partial_rotary_factor") or 1.0
    return int(head_dim * float(partial)) if float(partial) != 1.0 else 0


def _replace(shape: ModelShape, **kw: Any) -> ModelShape:
    from dataclasses import replace
    return replace(shape, **kw)


def param_split(s: ModelShape, tp: int) -> tuple[int, int]:
    """(parameters split over tp cards, parameters every card holds) — per card for the second."""
    h, hd = s.hidden_size, s.head_dim
    kv_card = math.ceil(s.num_kv_heads / tp)
    q_out = s.num_heads * hd * (2 if s.attn_output_gate else 1)  # the gate doubles q_proj
    attn = h * q_out + s.num_heads * hd * h  # q, o: split over cards
    attn_kv_card = 2 * h * kv_card * hd  # k, v: per card (replicated when tp > kv heads)
    if s.num_experts:
        mlp = (s.num_experts * 3 * h * s.moe_intermediate_size + h * s.num_experts  # + router
               + 3 * h * s.shared_expert_intermediate_size)
    else:
        mlp = 3 * h * s.intermediate_size
    k_dim = s.linear_num_key_heads * s.linear_key_head_dim
    v_dim = s.linear_num_value_heads * s.linear_value_head_dim
    conv_dim = 2 * k_dim + v_dim
    lin = (h * (conv_dim + v_dim + 2 * s.linear_num_value_heads)  # in_proj qkv, z, b, a
           + conv_dim * s.linear_conv_kernel_dim + v_dim * h + 2 * s.linear_num_value_heads)
    heads = s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    sharded = (heads + s.num_layers * mlp + s.full_attention_layers * attn
               + s.linear_attention_layers * lin)
    replicated = (s.full_attention_layers * (attn_kv_card + 2 * hd)  # + q/k norms
                  + s.num_layers * 2 * h + h + s.linear_attention_layers * s.linear_value_head_dim)
    if s.vision is not None:
        tower_sharded, tower_whole = s.vision.param_split(tp)
        sharded, replicated = sharded + tower_sharded, replicated + tower_whole
    return sharded, replicated


def max_positions(config_json: dict) -> int:
    """Positions the model can address: max_position_embeddings, or its rope-scaled reach."""
    c = {**config_json, **config_json.get("text_config", {})}
    mpe = int(c.get("max_position_embeddings") or 0)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if factor and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        orig = int(rope.get("original_max_position_embeddings") or mpe)
        return max(mpe, int(orig * float(factor)))
    return mpe
