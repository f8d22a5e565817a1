"""The Gated DeltaNet linear-attention layer of Qwen3-Next / Qwen3.5, tensor parallel,
and the per-request state it keeps in place of a KV cache.

One in-projection per rank yields [q | k | v | z | b | a] for this rank's heads:
tensor parallelism splits the linear-attention key heads (and with them their
value heads) across ranks, the conv channels with them, and out_proj's partial sums
are reduced by the norm that follows, as for every decoder layer's output (layers.py).
Checkpoints spell the projection two ways: Qwen3.5 as in_proj_qkv ([all q | all k |
all v]), in_proj_z, in_proj_b, in_proj_a; Qwen3-Next as in_proj_qkvz and in_proj_ba,
grouped per key head ([q, k, v, z] of key head 0, then key head 1, ...). Both load into
one layout.

The layer declares the state it needs per request (``state_spec``, a
LinearAttentionSpec: helexa plan counts it, the state backend allocates it) and hands
its conv inputs and gates to one op, ``gated_delta``: the state backend
(helexa/kernels/backends/gdn.py) keeps the slots, runs the conv and the delta rule over
them and rolls them back past rejected drafts. The layer does no bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.checkpoint.shape import dtype_name
from helexa.kernels.backends.gdn import GdnMetadata, gated_delta
from helexa.kernels.fla_norm import gated_rms_norm
from helexa.kernels.gated_delta import GateInputs
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.layers import (
    ColumnParallelLinear,
    HotModule,
    RowParallelLinear,
    SliceGetter,
    _copy_checked,
    _set_loader,
    replicated_loader,
)


class GatedDeltaNet(HotModule):
    def __init__(self, cfg: ModelConfig, layer: int = 0, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
        self.layer = layer  # index among the model's linear-attention layers: its state
        kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if kh % tp_size or vh % kh:
            raise ValueError(f"{kh} linear key heads / {vh} value heads: expected key heads "
                             f"divisible by tp={tp_size} and value heads a multiple of them")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kh, self.vh = kh // tp_size, vh // tp_size  # per rank
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = vh // kh  # value heads per key head
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.conv_dim = 2 * self.kh * self.dk + self.vh * self.dv  # per rank: [q | k | v]
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        out = self.conv_dim + self.vh * self.dv + 2 * self.vh
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, out * tp_size, **kw)
        self.in_proj.weight.weight_loader = self._load_in_proj  # type: ignore[attr-defined]
        self.out_proj = RowParallelLinear(vh * self.dv, cfg.hidden_size, defer=True, **kw)

        def param(*shape: int, loader: Any) -> nn.Parameter:
            return _set_loader(nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                            requires_grad=False), loader)

        self.conv_weight = param(self.conv_dim, self.kernel, loader=self._load_conv)
        self.dt_bias = param(self.vh, loader=self._load_heads)
        self.A_log = param(self.vh, loader=self._load_heads)
        self.norm_weight = param(self.dv, loader=replicated_loader)

    @property
    def state_spec(self) -> LinearAttentionSpec:
        """What one request's state takes on this rank, in the model's dtype."""
        return LinearAttentionSpec(key_heads=self.kh, value_heads=self.vh, key_dim=self.dk,
                                   value_dim=self.dv, conv_channels=self.conv_dim,
                                   conv_kernel=self.kernel,
                                   dtype=dtype_name(str(self.conv_weight.dtype)))

    # ---- loading: every checkpoint spelling into [q | k | v | z | b | a] of this rank ----

    def _segments(self) -> dict[str, tuple[int, int]]:
        """(offset, rows) of each part in this rank's in_proj output."""
        sizes = {"q": self.kh * self.dk, "k": self.kh * self.dk, "v": self.vh * self.dv,
                 "z": self.vh * self.dv, "b": self.vh, "a": self.vh}
        out, at = {}, 0
        for name, n in sizes.items():
            out[name] = (at, n)
            at += n
        return out

    def _load_in_proj(self, param: nn.Parameter, loaded: SliceGetter, shard: Any) -> None:
        seg, r = self._segments(), self.tp_rank
        full_kh = self.kh * self.tp_size
        if shard == "qkv":  # [all q | all k | all v]
            parts = {"q": r * self.kh * self.dk, "k": (full_kh + r * self.kh) * self.dk,
                     "v": 2 * full_kh * self.dk + r * self.vh * self.dv}
        elif shard in ("z", "b", "a"):
            per_head = self.dv if shard == "z" else 1
            parts = {shard: r * self.vh * per_head}
        elif shard in ("qkvz", "ba"):  # grouped per key head: this rank's groups are contiguous
            names = ("q", "k", "v", "z") if shard == "qkvz" else ("b", "a")
            sizes = ([self.dk, self.dk, self.ratio * self.dv, self.ratio * self.dv]
                     if shard == "qkvz" else [self.ratio, self.ratio])
            group = sum(sizes)
            rows = loaded[r * self.kh * group:(r + 1) * self.kh * group]
            rows = rows.reshape(self.kh, group, -1).split(sizes, dim=1)
            for name, part in zip(names, rows, strict=True):
                off, n = seg[name]
                _copy_checked(param.data[off:off + n], part.reshape(n, -1), f"in_proj {name}")
            return
        else:
            raise ValueError(f"unknown linear-attention projection {shard!r}")
        for name, src in parts.items():
            off, n = seg[name]
            _copy_checked(param.data[off:off + n], loaded[src:src + n], f"in_proj {name}")

    def _load_conv(self, param: nn.Parameter, loaded: SliceGetter, shard: Any = None) -> None:
        full = loaded[:]  # [channels, 1, K]: small
        seg, r, full_kh = self._segments(), self.tp_rank, self.kh * self.tp_size
        for name, src in (("q", r * self.kh * self.dk), ("k", (full_kh + r * self.kh) * self.dk),
                          ("v", 2 * full_kh * self.dk + r * self.vh * self.dv)):
            off, n = seg[name]
            _copy_checked(param.data[off:off + n], full[src:src + n, 0], f"conv1d {name}")

    def _load_heads(self, param: nn.Parameter, loaded: SliceGetter, shard: Any = None) -> None:
        _copy_checked(param.data, loaded[self.tp_rank * self.vh:(self.tp_rank + 1) * self.vh],
                      "linear-attention head parameter")

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, meta: GdnMetadata) -> torch.Tensor:
        """x [N, hidden] (decode rows first, then prefill chunks and verification rows)
        -> [N, hidden]."""
        n = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.vh * self.dv, self.vh,
                                                self.vh], dim=-1)
        raw = GateInputs(a, b, self.A_log, self.dt_bias)  # g, beta: gated_delta.gates
        o = gated_delta(mixed, raw, self.conv_weight, self.layer, meta)  # [N, vh, dv] fp32
        # Gated RMSNorm per value head: norm(o) * w * silu(z), the norm in fp32 as the reference.
        o = gated_rms_norm(o, z, self.norm_weight, self.eps, x.dtype)
        return self.out_proj(o.reshape(n, self.vh * self.dv))

