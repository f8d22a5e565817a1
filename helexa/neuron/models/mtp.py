"""The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5 checkpoints (``mtp.*``).

It predicts the token after next. At position t it reads the target's final
(post-norm) hidden state h_t and the embedding of the token t + 1:

    x = fc([pre_fc_norm_embedding(embed(x_{t+1})) | pre_fc_norm_hidden(h_t)])
    y = norm(decoder_layer(x))          # one full-attention layer, its own KV
    logits(x_{t+2}) = lm_head(y)        # embedding and lm_head shared with the target

Chained for more tokens, y stands in for h and its own greedy token for x_{t+1},
one position further. The decoder layer is the target's full-attention layer
kind (gated attention, partial rotary, q/k norms; an expert MLP where the
target's layer 0 would have one), and every RMSNorm follows the target's
convention ((1 + w) in these families). Its attention writes K/V into the
engine's pool as the attention layer after the target's last, under the
request's own block table (the model runner sizes the pool with it; helexa
plan counts it). At tensor parallel > 1 it is split as the target's layers are
(fc row-parallel over its 2H input, the layer column/row-parallel, the lm_head
vocab-parallel): every rank runs each pass, rank 0 driving (model_runner.py). Speculative decoding's drafter drives it:
helexa/neuron/engine/speculative/mtp.py, docs/speculation.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from helexa.kernels.backends.base import StepMeta
from helexa.kernels.rotary import Rotation
from helexa.neuron.models import hybrid_weights
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.layers import RMSNorm, RowParallelLinear, decoder_stack


def layer_config(cfg: ModelConfig) -> ModelConfig:
    """The target's config as the MTP layer sees it: one full-attention layer, index 0."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=("full_attention",))


class MtpHead(nn.Module):
    """mtp.fc, its two input norms, one decoder layer and mtp.norm (checkpoint names)."""

    def __init__(self, cfg: ModelConfig, attention_index: int, **kw: Any) -> None:
        super().__init__()
        from helexa.neuron.models.hybrid import DecoderLayer  # hybrid.py builds this head

        h = cfg.hidden_size
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"]}
        self.cfg = layer_config(cfg)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, **norm_kw)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, **norm_kw)
        # row-parallel: each rank multiplies its slice of [embedding | hidden] (both
        # replicated), one all-reduce sums them, as the target's o_proj / down_proj do
        self.fc = RowParallelLinear(2 * h, h, **kw)
        self.tp_rank, self.tp_size = kw["tp_rank"], kw["tp_size"]
        self.layers = nn.ModuleList([DecoderLayer(self.cfg, 0, attention_index, **kw)])
        # reduces the layer's deferred output, as the target's norms do (layers.py)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, reduce=kw["tp_size"] > 1, **norm_kw)
        self.loaded: set[tuple[str, Any]] = set()  # (parameter, shard) filled at load

    @property
    def layer(self) -> Any:
        return self.layers[0]

    def parameter_of(self, name: str) -> tuple[str, Any]:
        """(our parameter under `mtp.`, shard id) of a checkpoint tensor `mtp.<rest>`."""
        rest = name[len("mtp."):]
        if rest.startswith("layers.0."):  # the decoder layer's names are the target's
            pname, shard = hybrid_weights.parameter_of("model." + rest, "model.")
            return "mtp." + pname[len("model."):], shard
        return name, None

    def expected_shards(self) -> dict[tuple[str, Any], str]:
        """Every (parameter, shard) of the head a checkpoint must fill, with its name."""
        out = {(f"mtp.{n}.weight", None): f"mtp.{n}.weight"
               for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for (pname, shard), ckpt in hybrid_weights.expected_shards(self.cfg, [self.layer]).items():
            if pname.startswith("model.layers.0."):
                out[("mtp." + pname[len("model."):], shard)] = "mtp." + ckpt[len("model."):]
        return out

    @property
    def missing(self) -> list[str]:
        """Checkpoint names of the head's tensors that loading did not fill."""
        return sorted({ckpt for key, ckpt in self.expected_shards().items()
                       if key not in self.loaded})

    def norms(self) -> list[RMSNorm]:
        """Every RMSNorm of the head (the target's (1 + w) convention applies to all)."""
        attn = self.layer.self_attn
        return [self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm,
                self.layer.input_layernorm, self.layer.post_attention_layernorm,
                attn.q_norm, attn.k_norm]

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rot: Rotation,
                meta: StepMeta) -> torch.Tensor:
        """embeds [N, H] (of tokens t + 1), hidden [N, H] (at t) -> normed output [N, H]."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)],
                      dim=-1)
        if self.tp_size > 1:  # this rank's input columns
            width = x.shape[-1] // self.tp_size
            x = x[:, self.tp_rank * width:(self.tp_rank + 1) * width]
        return decoder_stack(self.layers, self.norm, self.fc(x), rot, meta, None)
