"""GGUF files of the hybrid and MoE families: their config from metadata, and which of
our layers each llama.cpp tensor fills (how a rank splits it), for ``helexa plan``.

llama.cpp's architectures ``qwen3moe`` (Qwen3-MoE), ``qwen3next`` (Qwen3-Next),
``qwen35`` and ``qwen35moe`` (Qwen3.5, text only) load into HybridForCausalLM. Their
converter (convert_hf_to_gguf.py) writes the Gated DeltaNet shape as ``ssm.*`` keys:
``ssm.group_count`` = linear key heads, ``ssm.time_step_rank`` = linear value heads,
``ssm.state_size`` = key head dim, ``ssm.inner_size`` = value heads x value head dim,
``ssm.conv_kernel``; ``rope.dimension_count`` the rotated dims of a head (partial
rotary); ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length`` the experts (docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# llama.cpp's architecture name -> (the transformers class our loader builds, model_type)
HYBRID_ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}


def family_config(path: Path, arch: str, key: Callable[..., Any], meta: Callable[..., Any],
                  tensors: dict[str, tuple[str, tuple[int, ...]]], head_dim: int) -> dict[str, Any]:
    """The hybrid / MoE keys of a config.json dict, from ``<arch>.*`` metadata and the
    tensors present (which layers are linear attention, which have experts)."""
    layers = int(key("block_count"))
    cfg: dict[str, Any] = {}
    if arch != "qwen3moe":  # Gated DeltaNet layers: those with an ssm_a tensor
        vh = int(key("ssm.time_step_rank"))
        cfg.update(
            layer_types=["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention"
                         for i in range(layers)],
            full_attention_interval=int(meta("full_attention_interval", 4)),
            linear_num_key_heads=int(key("ssm.group_count")), linear_num_value_heads=vh,
            linear_key_head_dim=int(key("ssm.state_size")),
            linear_value_head_dim=int(key("ssm.inner_size")) // vh,
            linear_conv_kernel_dim=int(key("ssm.conv_kernel")), attn_output_gate=True)
        rotary = meta("rope.dimension_count")
        if rotary and int(rotary) != head_dim:
            cfg["partial_rotary_factor"] = int(rotary) / head_dim
    experts = meta("expert_count")
    if experts:
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")),
                   # llama.cpp renormalises the top k for all four families
                   norm_topk_prob=bool(meta("expert_weights_norm", True)),
                   decoder_sparse_step=1, mlp_only_layers=dense)
        shared = meta("expert_shared_feed_forward_length")
        if shared is None:
            shared = next((shape[0] for name, (_, shape) in tensors.items()
                           if name.endswith("ffn_up_shexp.weight")), 0)
        if shared:
            cfg["shared_expert_intermediate_size"] = int(shared)
    return cfg


# ---------------------------------------------------------------- planning: a rank's share

# Parts fused into one of our layers (the layout is chosen over all of them together).
FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up",
         "ffn_up": "gate_up", "attn_qkv": "in_proj", "attn_gate": "in_proj",
         "ssm_beta": "in_proj", "ssm_alpha": "in_proj", "ssm_ba": "in_proj",
         "ffn_gate_shexp": "shared_gate_up", "ffn_up_shexp": "shared_gate_up"}
ROW_PARALLEL = ("attn_output", "ffn_down", "ssm_out", "ffn_down_shexp")  # inputs split
# Float parameters split by rank along their first dim (the linear-attention heads').
SPLIT_PARAMS = ("ssm_conv1d", "ssm_a", "ssm_dt")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")


def part_of(name: str) -> tuple[int, str] | None:
    """(layer, part) of ``blk.N.part.weight`` (or ``blk.N.ssm_a``); None for top tensors."""
    pieces = name.split(".")
    if pieces[0] != "blk":
        return None
    return int(pieces[1]), pieces[2]


def reorders_value_heads(arch: str, cfg: dict[str, Any]) -> bool:
    """Whether llama.cpp's converter reordered this file's linear-attention value heads
    from grouped by key head to tiled (Qwen3.5, where value heads outnumber key heads)."""
    return (arch in ("qwen35", "qwen35moe")
            and int(cfg["linear_num_key_heads"]) != int(cfg["linear_num_value_heads"]))


def stays_quantised(arch: str, part: str, typ: str, cfg: dict[str, Any]) -> bool:
    """Whether a quantised tensor keeps its values on an op. Qwen3.5's ``ssm_out`` has its
    input columns reordered by value head: put back in the unpacked form when a value
    head's columns are whole sub-blocks of the type, else dequantised and float."""
    from helexa.checkpoint.gguf import QUANT_TYPES

    if typ not in QUANT_TYPES or part != "ssm_out" or not reorders_value_heads(arch, cfg):
        return True
    return int(cfg["linear_value_head_dim"]) % QUANT_TYPES[typ][1] == 0
