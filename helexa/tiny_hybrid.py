"""Tiny hybrid and MoE checkpoints: Qwen3-Next, Qwen3.5, Qwen3-MoE and Qwen3.5-MoE.

helexa/tiny.py writes the folder (tokenizer, chat template, generation config);
this file supplies these families' config.json and weights in the layouts the
hub's checkpoints use: Qwen3.5 as the multimodal wrapper
(``Qwen3_5ForConditionalGeneration``, the text model under
``model.language_model.``, as Qwen/Qwen3.5-27B ships; no vision weights, the
engine serves text only), experts one tensor per expert and projection.
Every fourth layer of a hybrid is full attention, the rest Gated DeltaNet.
``mtp=True`` adds a multi-token-prediction head as the hub's checkpoints carry
it (``mtp_num_hidden_layers = 1``, tensors ``mtp.*``; neuron/models/mtp.py).
Scaling follows tiny.py: O(1) activations, residual branches damped, the
head scaled so greedy choices are rarely near-ties.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_moe", "qwen3_5_moe")
_CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
           "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
           "temporal_patch_size": 2, "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}


def hybrid_config(arch: str, *, hidden_size: int, num_layers: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate_size: int, vocab_size: int,
                  max_position_embeddings: int, dtype: str, tie: bool, rope_theta: float,
                  special: dict[str, int], eos: str, pad: str, version: str,
                  mtp: bool = False) -> dict:
    """config.json of a tiny `arch` (one of HYBRID_ARCHS)."""
    text: dict[str, Any] = {
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": hidden_size, "head_dim": head_dim, "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings, "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers, "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": tie, "use_cache": True,
        "vocab_size": vocab_size, "dtype": dtype,
        "bos_token_id": special[pad], "eos_token_id": special[eos], "pad_token_id": special[pad],
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
    }
    if arch != "qwen3_moe":  # Gated DeltaNet every layer but each fourth
        text.update(
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                         for i in range(num_layers)],
            full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4)
        text["rope_parameters"]["partial_rotary_factor"] = 0.25
    if mtp:
        text["mtp_num_hidden_layers"] = 1
    if arch != "qwen3_5":
        text.update(num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=True)
        if arch != "qwen3_moe":
            text["shared_expert_intermediate_size"] = intermediate_size // 2
    cfg: dict[str, Any] = {"architectures": [_CLASSES[arch]], "model_type": arch,
                           "transformers_version": version}
    if arch in ("qwen3_5", "qwen3_5_moe"):
        text["model_type"] = f"{arch}_text"
        cfg.update(text_config=dict(sorted(text.items())), tie_word_embeddings=tie, dtype=dtype,
                   vision_config={**_VISION, "model_type": f"{arch}_vision",
                                  "out_hidden_size": hidden_size})
    else:
        cfg.update(text)
    return dict(sorted(cfg.items()))


def hybrid_weights(arch: str, cfg: dict, seed: int, logit_std: float) -> dict[str, Any]:
    """Named tensors in the hub's layout, drawn in a fixed order from one generator."""
    import torch

    c = cfg.get("text_config", cfg)
    g = torch.Generator().manual_seed(seed)
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    nq, nkv, layers = c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    residual = 1.0 / math.sqrt(2 * layers)
    offset = arch != "qwen3_moe"  # (1 + w) norms store w around 0

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (scale / math.sqrt(in_f))

    def norm(n: int, zero_centred: bool = offset) -> torch.Tensor:
        return (0.0 if zero_centred else 1.0) + 0.1 * torch.randn(n, generator=g)

    def mlp(prefix: str, width: int) -> None:
        t[prefix + "gate_proj.weight"] = linear(width, h)
        t[prefix + "up_proj.weight"] = linear(width, h)
        t[prefix + "down_proj.weight"] = linear(h, width, residual)

    root = "model.language_model." if "text_config" in cfg else "model."
    head_std = logit_std / math.sqrt(h)
    t: dict[str, torch.Tensor] = {root + "embed_tokens.weight":
                                  torch.randn(c["vocab_size"], h, generator=g) * head_std}

    def layer(p: str, kind: str, moe: bool) -> None:
        t[p + "input_layernorm.weight"] = norm(h)
        if kind == "linear_attention":
            kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
            dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
            a = p + "linear_attn."
            if arch == "qwen3_next":  # grouped per key head: [q, k, v, z] and [b, a]
                t[a + "in_proj_qkvz.weight"] = linear(2 * kh * dk + 2 * vh * dv, h)
                t[a + "in_proj_ba.weight"] = linear(2 * vh, h)
            else:
                t[a + "in_proj_qkv.weight"] = linear(2 * kh * dk + vh * dv, h)
                t[a + "in_proj_z.weight"] = linear(vh * dv, h)
                t[a + "in_proj_b.weight"] = linear(vh, h)
                t[a + "in_proj_a.weight"] = linear(vh, h)
            k = c["linear_conv_kernel_dim"]
            t[a + "conv1d.weight"] = torch.randn(2 * kh * dk + vh * dv, 1, k, generator=g) / math.sqrt(k)
            t[a + "dt_bias"] = torch.ones(vh) + 0.1 * torch.randn(vh, generator=g)
            t[a + "A_log"] = torch.log(torch.empty(vh).uniform_(1.0, 16.0, generator=g))
            t[a + "norm.weight"] = norm(dv, zero_centred=False)  # the gated norm: plain w
            t[a + "out_proj.weight"] = linear(h, vh * dv, residual)
        else:
            s = p + "self_attn."
            t[s + "q_proj.weight"] = linear(nq * hd * (2 if offset else 1), h)
            t[s + "k_proj.weight"] = linear(nkv * hd, h)
            t[s + "v_proj.weight"] = linear(nkv * hd, h)
            t[s + "q_norm.weight"] = norm(hd)
            t[s + "k_norm.weight"] = norm(hd)
            t[s + "o_proj.weight"] = linear(h, nq * hd, residual)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        if moe:
            m = p + "mlp."
            t[m + "gate.weight"] = linear(c["num_experts"], h, 4.0)  # decisive routing
            for e in range(c["num_experts"]):
                mlp(f"{m}experts.{e}.", c["moe_intermediate_size"])
            if c.get("shared_expert_intermediate_size"):
                mlp(m + "shared_expert.", c["shared_expert_intermediate_size"])
                t[m + "shared_expert_gate.weight"] = linear(1, h)
        else:
            mlp(p + "mlp.", inter)

    kinds = c.get("layer_types", ["full_attention"] * layers)
    for i in range(layers):
        layer(f"{root}layers.{i}.", kinds[i], bool(c.get("num_experts")))
    t[root + "norm.weight"] = norm(h)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = torch.randn(c["vocab_size"], h, generator=g) * head_std
    if c.get("mtp_num_hidden_layers"):  # drawn last: the target's weights stay as without
        t["mtp.fc.weight"] = linear(h, 2 * h)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t[f"mtp.{n}.weight"] = norm(h)
        layer("mtp.layers.0.", "full_attention", bool(c.get("num_experts")))
    dtype = getattr(torch, c["dtype"])
    return {k: v.to(dtype).contiguous() for k, v in t.items()}


def craft_right_mtp_head(src: Path, out: Path) -> Path:
    """``src`` (a tiny checkpoint with an MTP head) made predictable: every residual branch
    of the target and of the head writes zero, so the target's next token is a fixed
    function of the current one, f(x) = argmax lm_head(norm(embed(x))); the head's fc
    passes the normed embedding through and its norm is the target's, so at position t
    it predicts f(x_{t+1}): the target's own next token. Its drafts are right."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    t = load_file(str(out / "model.safetensors"))
    for name in t:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    h = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # (1 + w) = 1
    root = "model.language_model." if "model.language_model.norm.weight" in t else "model."
    t["mtp.norm.weight"] = t[root + "norm.weight"].clone()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
