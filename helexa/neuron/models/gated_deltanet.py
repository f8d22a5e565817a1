"""The Gated DeltaNet linear-attention layer of Qwen3-Next / Qwen3.5, tensor parallel,
and the per-request state it keeps in place of a KV cache.

One in-projection per rank yields [q | k | v | z | b | a] for this rank's heads:
tensor parallelism splits the linear-attention key heads (and with them their
value heads) across ranks, the conv channels with them, and all-reduces after
out_proj like any row-parallel layer. Checkpoints spell the projection two
ways: Qwen3.5 as in_proj_qkv ([all q | all k | all v]), in_proj_z, in_proj_b,
in_proj_a; Qwen3-Next as in_proj_qkvz and in_proj_ba, grouped per key head
([q, k, v, z] of key head 0, then key head 1, ...). Both load into one layout.

The state (helexa/kernels/gated_delta.py) lives in a ``LinearState`` per layer with
one slot per request the model runner may hold at once; ``StateMeta`` says,
per step, which slot each row of the flat batch reads and writes
(linear_state.py, which also rolls the state back past rejected drafts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import gated_delta as gd
from helexa.kernels.norm import rms_norm
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
from helexa.neuron.models.linear_state import LinearState, StateMeta


class GatedDeltaNet(HotModule):
    def __init__(self, cfg: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:
        super().__init__()
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
        self.out_proj = RowParallelLinear(vh * self.dv, cfg.hidden_size, **kw)

        def param(*shape: int, loader: Any) -> nn.Parameter:
            return _set_loader(nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                            requires_grad=False), loader)

        self.conv_weight = param(self.conv_dim, self.kernel, loader=self._load_conv)
        self.dt_bias = param(self.vh, loader=self._load_heads)
        self.A_log = param(self.vh, loader=self._load_heads)
        self.norm_weight = param(self.dv, loader=replicated_loader)
        self.state: LinearState | None = None  # attached by the model runner

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

    def new_state(self, num_slots: int) -> LinearState:
        return LinearState(num_slots, self.conv_dim, self.kernel, self.vh, self.dk, self.dv,
                           dtype=self.conv_weight.dtype, device=self.conv_weight.device)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, meta: StateMeta) -> torch.Tensor:
        """x [N, hidden] (decode rows first, then prefill chunks and verification rows)
        -> [N, hidden]."""
        n = x.shape[0]
        state = self.state
        assert state is not None, "the model runner attaches the state before a step"
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.vh * self.dv, self.vh,
                                                self.vh], dim=-1)
        nd = meta.decode_slots.numel()
        conv = torch.empty_like(mixed)
        if nd:
            windows = state.conv.index_select(0, meta.decode_slots)
            conv[:nd] = gd.conv1d_decode(mixed[:nd], self.conv_weight, windows)
            state.conv.index_copy_(0, meta.decode_slots, windows)
        for start, end, slot in meta.prefills:
            conv[start:end], window = gd.conv1d_prefill(mixed[start:end], self.conv_weight,
                                                        state.conv[slot])
            state.conv[slot] = window
        rows = meta.verify  # token by token as decode, the slots left as they are (held)
        if rows is not None:
            mixed_rows = mixed[rows.index]  # [B, T, channels]
            windows = state.conv.index_select(0, rows.slots)
            conv[rows.flat] = gd.conv1d_steps(mixed_rows, self.conv_weight, windows)[rows.valid]
        q, k, v = conv.split([self.kh * self.dk, self.kh * self.dk, self.vh * self.dv], dim=-1)
        q = gd.l2norm(q.reshape(n, self.kh, self.dk).float()) * self.dk ** -0.5
        k = key_heads = gd.l2norm(k.reshape(n, self.kh, self.dk).float())
        if self.ratio > 1:  # each key head serves `ratio` consecutive value heads
            q, k = q.repeat_interleave(self.ratio, 1), k.repeat_interleave(self.ratio, 1)
        v = v.reshape(n, self.vh, self.dv)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = torch.empty(n, self.vh, self.dv, dtype=torch.float32, device=x.device)
        if nd:
            states = state.recurrent.index_select(0, meta.decode_slots).float()
            o[:nd] = gd.delta_rule_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states)
            state.recurrent.index_copy_(0, meta.decode_slots, states.to(state.recurrent.dtype))
        fla = gd.fla_available(x.device, x.dtype)
        for start, end, slot in meta.prefills:
            args = (q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
                    state.recurrent[slot])
            o[start:end], final = gd.fla_chunked(*args, x.dtype) if fla else \
                gd.delta_rule_chunked(*args)
            state.recurrent[slot] = final.to(state.recurrent.dtype)
        if rows is not None:
            states = state.recurrent.index_select(0, rows.slots).float()
            at = rows.index
            o[rows.flat] = gd.delta_rule_steps(q[at], k[at], v[at], g[at], beta[at], states,
                                               state.recurrent.dtype)[rows.valid]
            state.hold(rows, mixed_rows, key_heads[at], v[at], g[at], beta[at])
        # Gated RMSNorm per value head: norm(o) * w * silu(z), the norm in fp32 as the reference.
        o = rms_norm(o, None, self.eps).to(x.dtype) * self.norm_weight
        o = (o.float() * F.silu(z.reshape(n, self.vh, self.dv).float())).to(x.dtype)
        return self.out_proj(o.reshape(n, self.vh * self.dv))

