"""A sparse mixture-of-experts MLP (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE), tensor parallel.

A router (replicated) scores every expert per token; each token runs its top
k experts, weighted by their softmax probabilities (renormalised over the k
when the config says ``norm_topk_prob``), plus, where the config has one, a
shared expert scaled by a sigmoid gate. Tensor parallelism splits every
expert's intermediate dimension across ranks, like a dense MLP's: each rank
computes partial sums for all experts and one all-reduce per layer adds them.

Checkpoints keep one tensor per expert and projection
(``experts.{e}.gate_proj.weight``); they are stacked here as w13 [E, 2 I/tp, H]
and w2 [E, H, I/tp] so a token's expert is one index; the products run in the form
helexa/kernels/moe_experts.py picks for the device and step (on CUDA, decode-sized steps
without a host sync, so a CUDA graph can hold them). A GGUF file's quantised expert
stacks run each expert's product through ``experts_kernel`` instead
(helexa/neuron/formats/gguf/experts.py): one pass per chosen expert, or on CUDA's
decode-sized steps one over every expert, again without a host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels.moe_experts import run_experts, run_quantised_experts
from helexa.neuron.models import deferred
from helexa.neuron.models.config import ModelConfig
from helexa.neuron.models.layers import (
    HotModule,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SliceGetter,
    _copy_checked,
    _set_loader,
    all_reduce,
    replicated_loader,
)


class SparseMoeBlock(HotModule):
    def __init__(self, cfg: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: Any = None,
                 defer: bool = False) -> None:
        """``defer``: return the partial sums at tp > 1, for the RMSNorm.add that follows
        to reduce (helexa/neuron/models/layers.py)."""
        super().__init__()
        self.defer = defer
        e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if inter % tp_size:
            raise ValueError(f"moe_intermediate_size {inter} not divisible by tp={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.inter = inter // tp_size  # per rank

        def param(*shape: int, loader: Any, at: Any = device) -> nn.Parameter:
            return _set_loader(nn.Parameter(torch.empty(*shape, dtype=dtype, device=at),
                                            requires_grad=False), loader)

        self.weight_home = device  # the expert stacks may start on meta (deferred.py)
        self.gate = param(e, h, loader=replicated_loader)  # the router
        self.w13 = param(e, 2 * self.inter, h, loader=self._load_w13, at=deferred.place(device))
        self.w2 = param(e, h, self.inter, loader=self._load_w2, at=deferred.place(device))
        # (which, expert, x) -> x @ W^T for experts kept quantised (helexa/neuron/formats/gguf/experts.py)
        self.experts_kernel: Any = None
        # float stacks on CUDA: the routed kernel (helexa/kernels/cuda/moe_routed.py), set
        # and proved at load by the cuda executor
        self.routed: Any = None
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
            si = cfg.shared_expert_intermediate_size
            self.shared_gate_up = MergedColumnParallelLinear(h, [si, si], **kw)
            self.shared_down = RowParallelLinear(si, h, **kw)
            self.shared_expert_gate = param(1, h, loader=replicated_loader)
            self.shared = True

    def _load_w13(self, param: nn.Parameter, loaded: SliceGetter, shard: Any) -> None:
        expert, which = shard  # which: 0 = gate_proj, 1 = up_proj
        start = self.tp_rank * self.inter
        _copy_checked(param.data[expert, which * self.inter:(which + 1) * self.inter],
                      loaded[start:start + self.inter], f"expert {expert} gate/up")

    def _load_w2(self, param: nn.Parameter, loaded: SliceGetter, shard: Any) -> None:
        cols = param.shape[2]  # this rank's inputs (or their groups, for a quantised stack)
        start = self.tp_rank * cols
        _copy_checked(param.data[shard], loaded[:, start:start + cols], f"expert {shard} down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        probs = F.linear(x, self.gate).float().softmax(dim=-1)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.experts_kernel is None:  # float stacks: routed in place on CUDA where proved
            out = run_experts(x, self.w13, self.w2, chosen, weights, self.routed)
        else:
            out = run_quantised_experts(x, self.experts_kernel, self.gate.shape[0], chosen,
                                        weights)
        if self.shared is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            shared = self.shared_down.linear(F.silu(gate) * up, None)  # partial sum: reduced below
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
        if self.tp_size > 1 and not self.defer:
            all_reduce(out)
        return out
