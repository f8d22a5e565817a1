"""The dense Llama family: Llama, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm).

Reads like single-device code; the parallel-layer classes carry the sharding.
A forward step takes the flat batch of new tokens (all sequences
concatenated, decode rows first), their positions, and the step's attention
metadata, which each attention layer hands to the one attention op
(helexa/kernels/backends/base.py): the backend behind it owns the KV pool and the
kernels. Nothing here knows which device it runs on.
"""

from __future__ import annotations

import torch
from torch import nn

from helexa.kernels.backends.base import StepMeta, attention
from helexa.kernels.norm import rms_norm
from helexa.kernels.rotary import RotaryTable, Rotation
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.layers import (
    HotModule,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    decoder_stack,
    silu_and_mul,
)


class Attention(HotModule):
    def __init__(self, cfg: ModelConfig, layer: int, **kw) -> None:
        super().__init__()
        self.layer = layer  # index among the model's attention layers: its KV pool
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.qkv_bias, **kw)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias, defer=True, **kw)
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=kw["dtype"], device=kw["device"])
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=kw["dtype"], device=kw["device"])
        self.qk_norm_weight: torch.Tensor | None = None

    def finalize(self) -> None:
        """After loading: one [q_heads + kv_heads, head_dim] weight so q and k norm in one op."""
        if self.qk_norm:
            self.qk_norm_weight = torch.cat([
                self.q_norm.weight.expand(self.num_heads, -1),
                self.k_norm.weight.expand(self.num_kv_heads, -1),
            ])

    def forward(self, x: torch.Tensor, rot: Rotation, meta: StepMeta) -> torch.Tensor:
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).view(n, h + 2 * kvh, d).split_with_sizes([h + kvh, kvh], 1)
        if self.qk_norm_weight is not None and self.q_norm.kernel is not None:
            # a device's norm kernel, q's heads and k's written side by side for the rotary
            out = qk.new_empty(n, h + kvh, d)
            self.q_norm(qk[:, :h], out[:, :h])
            self.k_norm(qk[:, h:], out[:, h:])
            qk = out
        elif self.qk_norm_weight is not None:  # q and k heads normed in one go
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        q, k = rot.joint(qk, h)  # q and k rotated at once
        o = attention(q, k, v, self.layer, meta)
        return self.o_proj(o.reshape(n, h * d))


class MLP(HotModule):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias, **kw)
        self.silu_and_mul = silu_and_mul  # a device's executor may give a one-kernel form
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, defer=True,
                                           bias=cfg.mlp_bias, **kw)
        self.inter = self.gate_up_proj.weight.shape[0] // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(HotModule):
    def __init__(self, cfg: ModelConfig, layer: int, **kw) -> None:
        super().__init__()
        # each norm's add reduces the deferred product before it (layers.py)
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"], "reduce": kw["tp_size"] > 1}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.self_attn = Attention(cfg, layer, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.mlp = MLP(cfg, **kw)

    def forward(self, h: torch.Tensor, x: torch.Tensor, rot: Rotation,
                meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the normed input, x: the residual stream -> (MLP output, stream after
        attention); partial sums at tp > 1 (layers.decoder_stack)."""
        h, x = self.post_attention_layernorm.add(self.self_attn(h, rot, meta), x)
        return self.mlp(h), x


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **kw) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=kw["dtype"],
                            device=kw["device"], reduce=kw["tp_size"] > 1)


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder with a paged KV cache."""

    # checkpoint projection name -> (our fused module, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.model = Backbone(cfg, **kw)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope.rope_type, cfg.rope.theta, cfg.head_dim,
                                  cfg.rope.params, dtype=dtype, device=device,
                                  initial_len=min(cfg.max_position_embeddings, 4096))

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def finalize(self) -> None:
        """After loading: fuse what the checkpoint keeps apart (norm scales into matmuls,
        q/k norm weights into one) so a decode step runs fewer ops."""
        for layer in self.model.layers:
            layer.self_attn.finalize()
            layer.input_layernorm.fold_into(layer.self_attn.qkv_proj)
            layer.post_attention_layernorm.fold_into(layer.mlp.gate_up_proj)
        if not self.cfg.tie_word_embeddings:  # a tied head is the embedding: leave it be
            self.model.norm.fold_into(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> fp32 logits [M, vocab] for rows logits_indices (all if None)."""
        rot = self.rotary.rotation(positions)  # gathered once: every layer rotates with it
        h = decoder_stack(self.model.layers, self.model.norm, self.model.embed_tokens(input_ids),
                          rot, meta)
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        return self.lm_head(h).float()
