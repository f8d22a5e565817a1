"""The dense Llama family: Llama, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm).

Reads like single-device code; the parallel-layer classes carry the sharding.
A forward step takes the flat batch of new tokens (all sequences
concatenated, decode rows first), their positions, and the step's
AttentionMetadata; K/V caches are attached to each attention layer by the
model runner (``attn.k_cache`` / ``attn.v_cache``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels.attention import AttentionMetadata, PagedKV, paged_attention
from helexa.kernels.norm import rms_norm
from helexa.kernels.rotary import RotaryTable, apply_rotary
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.layers import (
    HotModule,
    MergedColumnParallelLinear,
    ParallelLinearBase,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    can_pack_for_cpu,
    can_relayout_for_cpu,
)


class Attention(HotModule):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.qkv_bias, **kw)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias, **kw)
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=kw["dtype"], device=kw["device"])
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=kw["dtype"], device=kw["device"])
        self.kv: PagedKV | None = None  # this layer's KV pool, attached by the model runner
        self._qk_norm_weight: torch.Tensor | None = None

    def finalize(self) -> None:
        """After loading: one [q_heads + kv_heads, head_dim] weight so q and k norm in one op."""
        if self.qk_norm:
            self._qk_norm_weight = torch.cat([
                self.q_norm.weight.expand(self.num_heads, -1),
                self.k_norm.weight.expand(self.num_kv_heads, -1),
            ])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).view(n, h + 2 * kvh, d).split_with_sizes([h + kvh, kvh], 1)
        if self._qk_norm_weight is not None:  # q and k heads normed in one go
            qk = rms_norm(qk, self._qk_norm_weight, self.eps)
        q, k = apply_rotary(qk, cos, sin).split_with_sizes([h, kvh], 1)  # q and k rotated at once
        self.kv.write(meta.slot_mapping, k, v)
        o = paged_attention(q, k, v, self.kv, meta)
        return self.o_proj(o.reshape(n, h * d))


class MLP(HotModule):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias, **kw)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           bias=cfg.mlp_bias, **kw)
        self.inter = self.gate_up_proj.weight.shape[0] // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(HotModule):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"]}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.self_attn = Attention(cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.mlp = MLP(cfg, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, **kw) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=kw["dtype"], device=kw["device"])


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
        self.native = None  # kernels.cpu_native's library, attached by the model runner
        self._native_plan: tuple | None = None  # (library, decode_native's per-layer plan)
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

    def pack_for_cpu(self, batch_hint: int) -> int:
        """Pack every matmul weight for oneDNN (CPU fp32); returns how many were packed."""
        n = 0
        for mod in self.modules():
            if isinstance(mod, ParallelLinearBase) and can_pack_for_cpu(mod.weight):
                mod.pack_for_cpu(batch_hint)
                n += 1
        if can_pack_for_cpu(self.lm_head.weight):
            self.lm_head.pack_for_cpu(batch_hint)
            n += 1
        return n

    def pack_native(self, lib) -> int:
        """Pack every matmul weight for kernels.cpu_native's hx_gemm (CPU fp32, one rank);
        returns how many were packed."""
        n = 0
        for mod in self.modules():
            if isinstance(mod, ParallelLinearBase | ParallelLMHead) and can_pack_for_cpu(mod.weight):
                mod.pack_native(lib)
                n += 1
        return n

    def relayout_for_cpu(self) -> int:
        """Hold every fp32 CPU matmul weight column-major (after packing, which copies from
        the plain weight); returns how many. Tied heads stay as the embedding has them."""
        n = 0
        for mod in self.modules():
            if isinstance(mod, ParallelLinearBase) and can_relayout_for_cpu(mod.weight):
                mod.relayout_for_cpu()
                n += 1
        if not self.cfg.tie_word_embeddings and can_relayout_for_cpu(self.lm_head.weight):
            self.lm_head.relayout_for_cpu()
            n += 1
        return n

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> fp32 logits [M, vocab] for rows logits_indices (all if None)."""
        if meta.decode_tables is not None:
            return self.decode_native(input_ids, positions, meta, logits_indices)
        cos, sin = self.rotary.cos_sin(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, d]: broadcast over heads
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.model.norm(x)).float()

    def decode_native(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, logits_indices: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """A pure-decode step on CPU (fp32 weights and KV, tp = 1) with kernels/cpu_native.c
        doing everything between the matmuls: per layer four matmuls and three native calls
        instead of ~40 eager ops, or, when every matmul is packed for hx_gemm (torch on one
        thread), all layers in one native call. Same contract as forward; the model runner
        decides when (meta.decode_tables set) and has attached the library as
        ``self.native``."""
        lib = self.native
        if self._native_plan is None or self._native_plan[0] is not lib:
            self._native_plan = (lib, self._plan_native())
        first_norm, layers, fused = self._native_plan[1]
        x = self.model.embed_tokens(input_ids)  # [B, hidden], a fresh tensor: updated in place
        b, hidden = x.shape
        normed = torch.empty_like(x)
        attn0 = self.model.layers[0].self_attn
        h, kvh, d = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        tables = meta.decode_tables
        work = torch.empty((h // kvh) * meta.decode_len + d, dtype=torch.float32)
        attn_out = torch.empty(b, h * d, dtype=x.dtype)
        rotary = (self.rotary.cos.data_ptr(), self.rotary.sin_signed.data_ptr(),
                  positions.data_ptr())
        num_slots, block_size = attn0.kv.k_heads.shape[2], attn0.kv.k_cache.shape[1]
        paging = (tables.data_ptr(), tables.shape[1], block_size)
        scale = 1.0 / math.sqrt(d)
        xp, normed_p = x.data_ptr(), normed.data_ptr()
        lib.hx_add_rmsnorm(xp, None, normed_p, first_norm[0], b, hidden, first_norm[1])
        if fused is not None:  # every matmul packed: all layers in one native call
            plan, eps, inter = fused
            qkv, tmp, gate_up, act = (torch.empty(b, n, dtype=x.dtype)
                                      for n in ((h + 2 * kvh) * d, hidden, 2 * inter, inter))
            lib.hx_decode_layers(plan.shape[0], plan.data_ptr(), eps.data_ptr(), xp, normed_p,
                                 b, hidden, h, kvh, d, inter, qkv.data_ptr(),
                                 attn_out.data_ptr(), tmp.data_ptr(), gate_up.data_ptr(),
                                 act.data_ptr(), *rotary, num_slots, *paging, scale,
                                 work.data_ptr())
        else:  # matmuls in torch between the native calls
            context = (num_slots, *paging, attn_out.data_ptr(), scale, work.data_ptr())
            for qkv_proj, qk_norm, pools, o_proj, post, gate_up, inter, down, nxt in layers:
                qkv = qkv_proj(normed)
                lib.hx_attn_decode(qkv.data_ptr(), b, h, kvh, d, *qk_norm, *rotary, *pools,
                                   *context)
                delta = o_proj(attn_out)  # held by name: C reads it after data_ptr()
                lib.hx_add_rmsnorm(xp, delta.data_ptr(), normed_p, post[0], b, hidden, post[1])
                gu = gate_up(normed)
                act = torch.empty(b, inter, dtype=x.dtype)
                lib.hx_silu_mul(gu.data_ptr(), act.data_ptr(), b, inter)
                delta = down(act)
                lib.hx_add_rmsnorm(xp, delta.data_ptr(), normed_p, nxt[0], b, hidden, nxt[1])
        if logits_indices is not None:
            normed = normed.index_select(0, logits_indices)
        return self.lm_head(normed).float()

    def _plan_native(self) -> tuple[tuple, list[tuple], tuple | None]:
        """What decode_native passes that does not change from step to step: the first
        norm's (weight pointer or None, eps), and per layer its matmul modules, (q/k norm
        weight pointer, eps), its KV pool's pointers and the (pointer, eps) of the norms
        after attention and after the MLP (the next layer's input norm, or the final one).
        Rebuilt whenever the runner attaches a library (it does on a KV pool reset). When
        every matmul is packed for hx_gemm, also hx_decode_layers' plan: ([L, 13] words,
        [L, 3] eps, intermediate size), else None."""

        def norm(n: RMSNorm) -> tuple[int | None, float]:
            return (None if n.folded else n.weight.data_ptr()), n.eps

        layers = list(self.model.layers)
        plan = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkn = attn._qk_norm_weight
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            plan.append((attn.qkv_proj, (None if qkn is None else qkn.data_ptr(), attn.eps),
                         (attn.kv.k_heads.data_ptr(), attn.kv.v_heads.data_ptr()), attn.o_proj,
                         norm(layer.post_attention_layernorm), mlp.gate_up_proj, mlp.inter,
                         mlp.down_proj, norm(nxt)))
        return norm(layers[0].input_layernorm), plan, self._plan_fused(plan)

    @staticmethod
    def _plan_fused(plan: list[tuple]) -> tuple | None:
        def packed(mod) -> tuple[int, int] | None:
            if getattr(mod, "native", None) is None:
                return None
            _, weight, bias = mod.native
            return weight.data_ptr(), 0 if bias is None else bias.data_ptr()

        words, eps = [], []
        for qkv, (qkn, qk_eps), (k, v), o, post, gate_up, inter, down, nxt in plan:
            mats = [packed(m) for m in (qkv, o, gate_up, down)]
            if any(m is None for m in mats) or inter != plan[0][6]:
                return None
            words.append([w for m in mats for w in m]
                         + [qkn or 0, post[0] or 0, nxt[0] or 0, k, v])
            eps.append([qk_eps, post[1], nxt[1]])
        return (torch.tensor(words, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32),
                plan[0][6])
