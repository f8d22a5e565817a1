"""Parse a Hugging Face ``config.json`` dict into the typed config our models need.

Reading the file (or a GGUF file's metadata) is the loader's, once per load
(helexa/neuron/formats/base.py: open_checkpoint). Handles both rope formats
transformers has written: today's ``rope_parameters`` dict and the older
top-level ``rope_theta`` plus optional ``rope_scaling``.
Anything we cannot run faithfully is refused here, naming the offending key,
so that a wrong model never loads silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.checkpoint.shape import read_model_shape
from helexa.checkpoint.vision_shape import VisionShape

# Architectures (config.json "architectures"[0]) this package implements, and
# the per-family switches that distinguish them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
)
# Gated DeltaNet + gated full attention, (1 + w) norms, partial rotary (helexa/neuron/models/hybrid.py).
HYBRID_ARCHITECTURES = SUPPORTED_ARCHITECTURES[4:]
_DEFAULT_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class UnsupportedArchitecture(Exception):
    """The checkpoint's architecture (or one of its features) is not implemented here."""


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name as configs spell it ("bfloat16", "bf16", "float32", …) to torch."""
    try:
        return _DTYPES[name.removeprefix("torch.").lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; expected one of {sorted(set(_DTYPES))}"
        ) from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised across config formats."""

    rope_type: str = "default"
    theta: float = 10000.0
    # Type-specific parameters (factor, low_freq_factor, beta_fast, …) as the config gives them.
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the dense Llama/Qwen family model needs from config.json."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool  # Llama/Qwen3 attention_bias also biases o_proj
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rotary
    torch_dtype: str
    rope: RopeConfig
    # Hybrid and MoE families (defaults: a dense model).
    layer_types: tuple[str, ...] = ()  # "full_attention" | "linear_attention" per layer
    rotary_dim: int = 0  # rotated leading dims of each head (partial rotary); 0 = head_dim
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output
    norm_offset: bool = False  # RMSNorm scales by (1 + w), not w
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    weight_prefix: str = "model."  # where the language model's tensors live in the checkpoint
    # Multi-token-prediction layers the checkpoint carries (mtp.*: speculative decoding's
    # drafter, helexa/neuron/models/mtp.py); their KV is one more full-attention layer each.
    mtp_num_layers: int = 0
    # A vision-language checkpoint's tower (vision_config), and how M-RoPE deals the
    # rotary frequencies to (t, h, w) (helexa/neuron/models/mrope.py).
    vision: VisionShape | None = None
    mrope_section: tuple[int, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def num_params(self) -> int:
        """Parameter count (weights only), for progress and benchmark labels."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + emb + h


def _rope_from_config(raw: dict[str, Any], allow_partial: bool = False) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:
        # Older format: rope_theta at top level, rope_scaling optional ("type" or "rope_type").
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        params = dict(params)
    # Multimodal rope (Qwen3.5): text tokens carry one position on every axis, which is
    # plain rope; the section (ModelConfig.mrope_section) matters for image tokens only.
    params.pop("mrope_section", None)
    if params.pop("mrope_interleaved", True) is False:
        raise UnsupportedArchitecture("mrope_interleaved=false (Qwen2-VL's M-RoPE layout) is "
                                      "not supported")
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedArchitecture("per-layer-type rope_parameters are not supported")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitecture(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not allow_partial:
        raise UnsupportedArchitecture(f"partial_rotary_factor={partial} is not supported")
    return RopeConfig(rope_type=rope_type, theta=theta, params=params)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a config.json dict; UnsupportedArchitecture names what is wrong.

    The numbers that decide memory come from the one torch-free parse the plan uses
    (helexa/checkpoint/shape.py); what only the model needs (rope, biases, norms, which
    layer is which) is read here."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    arch = archs[0] if archs else _DEFAULT_ARCH.get(model_type, f"<model_type {model_type!r}>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    multimodal = arch.endswith("ForConditionalGeneration")
    if multimodal:  # the language model's settings live under text_config
        raw = {**raw, **raw.get("text_config", {})}
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{arch}: hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise UnsupportedArchitecture(f"{arch}: use_sliding_window=true is not supported")
    if "intermediate_size" not in raw:  # shape.py reads a missing one as 0; a model needs it
        raise UnsupportedArchitecture(f"{arch}: config.json has no intermediate_size")
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    hybrid = arch in HYBRID_ARCHITECTURES
    rope = _rope_from_config(raw, allow_partial=hybrid)
    mrope = (raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("mrope_section")
    partial = float(rope.params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    layer_types = tuple(raw.get("layer_types") or ())
    if hybrid and not layer_types:  # every full_attention_interval-th layer is full attention
        interval = int(raw.get("full_attention_interval", 4))
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(int(raw["num_hidden_layers"])))
    unknown = set(layer_types) - {"full_attention", "linear_attention"}
    if unknown:
        raise UnsupportedArchitecture(f"{arch}: layer types {sorted(unknown)} are not supported")
    # shape.py reads the linear-attention numbers only where it sees linear layers: it is
    # given the layer types decided here, so both agree on which layers those are.
    shape = read_model_shape({**raw, "layer_types": list(layer_types)} if hybrid else raw)
    vision = shape.vision if multimodal else None
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        # an absent (or 0) max_position_embeddings: the rotary table's first size
        max_position_embeddings=shape.max_position_embeddings or 4096,
        tie_word_embeddings=shape.tie_word_embeddings,
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch.startswith("Qwen3"),
        # torch_dtype before dtype, as the neuron always read it (shape.py, for the plan,
        # reads dtype first: they differ only for a config.json giving both, differently)
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        rope=rope,
        layer_types=layer_types if hybrid else (),
        rotary_dim=int(shape.head_dim * partial) if partial != 1.0 else 0,
        attn_output_gate=hybrid and shape.attn_output_gate,
        norm_offset=hybrid,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        num_experts=shape.num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
        moe_intermediate_size=shape.moe_intermediate_size if shape.num_experts else 0,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        # Qwen3.5-MoE always renormalises the top k; the others say so in the config.
        norm_topk_prob=bool(raw.get("norm_topk_prob", arch.startswith("Qwen3_5Moe"))),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        weight_prefix="model.language_model." if multimodal else "model.",
        mtp_num_layers=shape.mtp_layers,
        vision=vision,
        # transformers' default section where a multimodal config gives none
        mrope_section=tuple(int(x) for x in (mrope or ([11, 11, 10] if vision else []))),
    )
