"""Qwen3-Next, Qwen3.5 (dense and MoE) and Qwen3-MoE: decoders whose layers mix
full attention with Gated DeltaNet linear attention and dense with expert MLPs.

One model class serves the four families; the config says which layer is which
(``layer_types``, ``is_moe_layer``) and how the full attention looks: Qwen3-Next
and Qwen3.5 gate its output (q_proj yields [q | gate] per head), rotate only the
leading ``rotary_dim`` of each head and scale every RMSNorm by (1 + w); Qwen3-MoE
is Qwen3's attention with expert MLPs. Full-attention layers use the paged KV
pool like the dense models; linear-attention layers (gated_deltanet.py) declare a
per-request state whose slots the Gated DeltaNet state backend keeps; the runner passes
its per-step metadata to ``forward``.

Checkpoint names are mapped in ``checkpoint_map`` (hybrid_weights.py): the text model of
``*ForConditionalGeneration`` lives under ``model.language_model.``, its
``model.visual.*`` tensors load into the vision tower (vision.py) when config.json
declares one (a checkpoint without them loads text only, said once in the log), and
multi-token-prediction weights (``mtp.*``) load into the MTP head (mtp.py) when
config.json declares one (``mtp_num_hidden_layers``), else are kept whole in
``extra_tensors``. A checkpoint that declares a head but lacks its tensors loads
without it (speculative decoding then refuses "mtp").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from helexa.kernels.backends.base import StepMeta, attention
from helexa.kernels.backends.gdn import GdnMetadata
from helexa.kernels.rotary import RotaryTable, Rotation
from helexa.log import get_logger
from helexa.neuron.models import hybrid_weights
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.gated_deltanet import GatedDeltaNet
from helexa.neuron.models.layers import (
    HotModule,
    MergedColumnParallelLinear,
    ParallelLinearBase,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SliceGetter,
    VocabParallelEmbedding,
    _copy_checked,
    _split_rows,
    decoder_stack,
    silu_and_mul,
)
from helexa.neuron.models.moe import SparseMoeBlock
from helexa.neuron.models.mrope import MmStep, axis_of_columns, mrope_cos_sin
from helexa.neuron.models.mtp import MtpHead
from helexa.neuron.models.vision import VisionTower

log = get_logger("neuron")


class GatedQKVParallelLinear(QKVParallelLinear):
    """QKV whose q part carries [q | gate] per head (2 × head_dim rows a head), or plain q."""

    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, *, gated: bool,
                 **kw: Any) -> None:
        super().__init__(hidden, head_dim, heads, kv_heads, **kw)
        self.q_factor = 2 if gated else 1
        if gated:  # re-make the weight with room for the gate rows
            rows = (self.q_factor * self.num_heads + 2 * self.num_kv_heads) * head_dim
            ParallelLinearBase.__init__(self, hidden, rows, False, tp_rank=self.tp_rank,
                                        tp_size=self.tp_size, dtype=kw["dtype"],
                                        device=kw["device"])

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        if shard_id != "q" or self.q_factor == 1:
            return self._load_kv(param, loaded, shard_id)
        q_size = self.q_factor * self.num_heads * self.head_dim
        _copy_checked(param.data.narrow(0, 0, q_size),
                      _split_rows(loaded, self.tp_rank * q_size, q_size), "gated q shard")

    def _load_kv(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any) -> None:
        d = self.head_dim
        q_size, kv_size = self.q_factor * self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            dst, src = 0, self.tp_rank * q_size
            size = q_size
        else:
            kv_head = (self.tp_rank * self.num_kv_heads if self.tp_size <= self.total_kv_heads
                       else self.tp_rank * self.total_kv_heads // self.tp_size)
            dst = q_size + (0 if shard_id == "k" else kv_size)
            src, size = kv_head * d, kv_size
        _copy_checked(param.data.narrow(0, dst, size), _split_rows(loaded, src, size),
                      f"qkv shard {shard_id}")


class Attention(HotModule):
    """Full attention over the paged KV pool: q/k RMSNorm, (partial) rotary, optional gate."""

    def __init__(self, cfg: ModelConfig, layer: int, **kw: Any) -> None:
        super().__init__()
        self.layer = layer  # index among the model's attention layers: its KV pool
        self.gated = cfg.attn_output_gate
        self.qkv_proj = GatedQKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                               cfg.num_kv_heads, gated=self.gated, **kw)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        defer=True, **kw)
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"]}
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm_kw)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, **norm_kw)

    def forward(self, x: torch.Tensor, rot: Rotation, meta: StepMeta) -> torch.Tensor:
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([self.qkv_proj.q_factor * h * d, kvh * d, kvh * d], -1)
        if self.gated:
            q, gate = qg.view(n, h, 2 * d).chunk(2, dim=-1)
        else:
            q, gate = qg.view(n, h, d), None
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, kvh, d))
        q, k = rot.pair(q, k)  # partial rotary: the trailing dims pass through
        o = attention(q, k, v.view(n, kvh, d), self.layer, meta).reshape(n, h * d)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(n, h * d))
        return self.o_proj(o)


class MLP(HotModule):
    def __init__(self, cfg: ModelConfig, **kw: Any) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2, **kw)
        self.silu_and_mul = silu_and_mul  # a device's executor may give a one-kernel form
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, defer=True,
                                           **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(HotModule):
    def __init__(self, cfg: ModelConfig, index: int, attention_index: int, **kw: Any) -> None:
        super().__init__()
        # each norm's add reduces the deferred product before it (layers.py)
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"], "reduce": kw["tp_size"] > 1}
        self.linear = cfg.layer_types[index] == "linear_attention" if cfg.layer_types else False
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        if self.linear:
            # its state: its index among the linear-attention layers
            self.linear_attn = GatedDeltaNet(cfg, index - attention_index, **kw)
        else:
            self.self_attn = Attention(cfg, attention_index, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        self.mlp: HotModule = (SparseMoeBlock(cfg, defer=True, **kw) if cfg.is_moe_layer(index)
                               else MLP(cfg, **kw))

    def forward(self, h: torch.Tensor, x: torch.Tensor, rot: Rotation,
                meta: StepMeta, state: GdnMetadata | None) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the normed input, x: the residual stream -> (MLP output, stream after
        attention); partial sums at tp > 1 (layers.decoder_stack)."""
        if self.linear:
            assert state is not None, "a hybrid model's step needs its state metadata"
            y = self.linear_attn(h, state)
        else:
            y = self.self_attn(h, rot, meta)
        h, x = self.post_attention_layernorm.add(y, x)
        return self.mlp(h), x


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        kinds = cfg.layer_types or ("full_attention",) * cfg.num_layers
        # a full-attention layer's KV pool is its index among the full-attention layers
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, sum(1 for t in kinds[:i] if t == "full_attention"), **kw)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=kw["dtype"],
                            device=kw["device"], reduce=kw["tp_size"] > 1)


class HybridForCausalLM(nn.Module):
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE / Qwen3-MoE with a paged KV pool and linear state."""

    # The CPU backend's fused decode step knows the dense Llama layer only.
    native_decode = False

    def __init__(self, cfg: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.model = Backbone(cfg, **kw)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rope.rope_type, cfg.rope.theta, cfg.rotary_dim or cfg.head_dim,
                                  cfg.rope.params, dtype=dtype, device=device,
                                  initial_len=min(cfg.max_position_embeddings, 4096))
        self.extra_tensors: dict[str, torch.Tensor] = {}  # mtp.* of a head config.json omits
        # The MTP head (speculative decoding's drafter); its attention's KV is the pool's
        # layer after the target's. None when config.json declares none, or its tensors
        # are missing (finalize).
        self.mtp: MtpHead | None = None
        if cfg.mtp_num_layers == 1:
            self.mtp = MtpHead(cfg, len(self.attention_layers), **kw)
        # The MTP drafter sets keep_hidden: forward then keeps every row's final normed
        # hidden state [N, H] in last_hidden (the head's input).
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self._skipped_visual = False
        # The vision tower, when config.json declares one (dropped at finalize if the
        # checkpoint has none of its tensors), and a step's images and M-RoPE positions
        # (the runner sets mm before each step: None for text-only steps).
        self.visual: VisionTower | None = None
        self.visual_loaded: set[str] = set()
        self.missing_tensors: list[str] = []  # set at finalize (the loader checks it)
        self.mm: MmStep | None = None
        if cfg.vision is not None:
            self.visual = VisionTower(cfg.vision, **kw)
            self.mrope_axes = axis_of_columns(cfg.rotary_dim or cfg.head_dim,
                                              cfg.mrope_section, device)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.decoder_layers if not layer.linear]

    @property
    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.decoder_layers if layer.linear]

    # ---- checkpoint names ------------------------------------------------------------------

    def checkpoint_map(self, name: str) -> tuple[str, Any] | None:
        """(our parameter, shard id) for a checkpoint tensor; ("", None) to keep it in
        extra_tensors; None to skip it (hybrid_weights.py maps the rest)."""
        if name.startswith("mtp."):
            if self.mtp is None:
                return "", None
            target = self.mtp.parameter_of(name)
            self.mtp.loaded.add(target)
            return target
        if self.visual is not None and (target := VisionTower.parameter_of(name)) is not None:
            self.visual_loaded.add(target)
            return "visual." + target, None
        if name.startswith(("model.visual.", "visual.")):
            if not self._skipped_visual:
                log.info("model.vision_skipped", reason="text only: model.visual.* not loaded")
                self._skipped_visual = True
            return None
        return hybrid_weights.parameter_of(name, self.cfg.weight_prefix)

    def expected_shards(self) -> dict[tuple[str, Any], str]:
        """Every (parameter, shard) loading must fill, with a checkpoint name for messages."""
        return hybrid_weights.expected_shards(self.cfg, self.decoder_layers)


    def finalize(self) -> None:
        """After loading: (1 + w) norms become plain w norms, so one RMSNorm serves all."""
        if self.mtp is not None and self.mtp.missing:
            log.warning("model.mtp_missing", missing=self.mtp.missing[:4],
                        reason="config.json declares an MTP head the checkpoint lacks")
            self.mtp = None
        if self.visual is not None:
            self._check_visual()
        if not self.cfg.norm_offset:
            return
        norms = [self.model.norm, *(self.mtp.norms() if self.mtp is not None else [])]
        for layer in self.decoder_layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            if not layer.linear:
                norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        with torch.no_grad():
            for norm in norms:
                norm.weight.add_(1.0)

    def _check_visual(self) -> None:
        """A tower loads whole or not at all (a text-only copy of a VL checkpoint)."""
        assert self.visual is not None
        missing = sorted(set(dict(self.visual.named_parameters())) - self.visual_loaded)
        if missing and not self.visual_loaded:
            log.info("model.vision_skipped", reason="config.json declares a vision tower "
                     "the checkpoint lacks: text only")
            self.visual = None
        else:  # half a tower: the loader refuses the checkpoint, naming them
            self.missing_tensors = [f"model.visual.{m}" for m in missing]

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta,
                logits_indices: torch.Tensor | None = None,
                state: GdnMetadata | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> fp32 logits [M, vocab] for rows logits_indices (all if
        None); ``state``: the step's linear-attention state metadata (helexa/kernels/backends/
        gdn.py), which the model runner builds and passes in."""
        mm = self.mm
        if mm is not None and mm.positions is not None:  # (t, h, w) per row: the torch form
            cos, sin = mrope_cos_sin(self.rotary, mm.positions, self.mrope_axes)
            rot = Rotation(cos.unsqueeze(1), sin.unsqueeze(1))  # [N, 1, rotary_dim]
        else:
            rot = self.rotary.rotation(positions)
        # the embeddings handed on, no reference kept here: freed once the stream moves on
        h = decoder_stack(self.model.layers, self.model.norm, self._embeddings(input_ids, mm),
                          rot, meta, state)
        if self.keep_hidden:
            self.last_hidden = h
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        return self.lm_head(h).float()

    def _embeddings(self, input_ids: torch.Tensor, mm: Any) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if mm is not None and mm.rows is not None and mm.embeds is not None:
            x = x.index_copy(0, mm.rows, mm.embeds.to(x.dtype))  # image tokens: the tower's
        return x

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    meta: StepMeta, logits_indices: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over rows (token t + 1 in input_ids, the target's hidden at t in
        hidden [N, H], position t): (fp32 logits of rows logits_indices, output [N, H])."""
        assert self.mtp is not None, "no MTP head"
        y = self.mtp(self.model.embed_tokens(input_ids), hidden,
                     self.rotary.rotation(positions), meta)
        rows = y if logits_indices is None else y.index_select(0, logits_indices)
        return self.lm_head(rows).float(), y
