"""The attention-backend interface: how a model's attention reaches the KV pool.

A model calls one op, :func:`attention`, with its layer's rotated q and new k, v;
it knows nothing of devices, pools or kernels. Everything device-specific sits
behind :class:`AttentionBackend`, one instance per model runner:

- at load, ``prepare_model`` may swap faster products into the model's linear
  layers (``ParallelLinearBase.kernel``) — same results, other kernels;
- ``allocate_kv`` lays out each layer's K/V pool in the shape its kernels read;
- per step, ``plan`` turns the runner's :class:`StepPlan` (the flat batch: decode
  rows first, then prefill chunks, with their block tables) into the backend's
  own metadata, built once and shared by every layer;
- per layer, ``forward`` writes the new K/V into the pool and attends: decode
  rows over their whole context, prefill chunks causally over cached context
  plus themselves;
- ``run`` executes the step: ``model(...)`` unless the backend has a whole-step
  path of its own (fused CPU decode, CUDA graph replay).

Backends (``helexa/kernels/backends/``): ``torch`` (the plain SDPA reference every
other one is tested against), ``cpu`` (native kernels, packed weights), ``cuda``
(FlashInfer paged kernels, CUDA graphs). ``select`` picks one by device and
config; see docs/engine.md.

A new model family needs nothing from here but :func:`attention`: give each
attention layer its index among the model's attention layers (``layer``), and
list the layers' (kv_heads, head_dim) through ``attention_layers`` so the
runner sizes the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.kernels.attention import PagedKV


@dataclass
class PrefillRow:
    """One sequence's prefill chunk: flat rows [start, end), ``num_computed`` tokens of it
    already cached, its block table covering num_computed + (end - start) tokens."""

    start: int
    end: int
    num_computed: int
    block_table: list[int]


@dataclass
class StepPlan:
    """What a step is, as the runner laid it out (independent of any backend)."""

    slot_mapping: torch.Tensor  # [N] on the device: where each new token's K/V go
    decode_positions: list[int] = field(default_factory=list)  # one new token per row
    # The engine's own block-table lists (the same objects from step to step while a
    # request runs: backends may key state on their identity).
    decode_tables: list[list[int]] = field(default_factory=list)
    prefills: list[PrefillRow] = field(default_factory=list)
    block_size: int = 16
    num_blocks: int = 0

    @property
    def num_decode(self) -> int:
        return len(self.decode_positions)


class AttentionBackend(ABC):
    """One model runner's attention kernels and KV pools (see the module docstring)."""

    name = "?"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pools: list[PagedKV] = []

    def describe(self) -> str:
        """One line for the load log and status: the backend and what it chose."""
        return self.name

    def prepare_model(self, model: torch.nn.Module, *, max_num_seqs: int,
                      max_batched_tokens: int, tp_size: int) -> None:
        """After loading (and the model's own finalize): device-specific weight prep."""
        return None

    @abstractmethod
    def allocate_kv(self, layers: list[tuple[int, int]], num_blocks: int, block_size: int, *,
                    kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype
                    ) -> list[PagedKV]:
        """Drop the old pools and allocate one per attention layer ((kv_heads, head_dim)
        each); returns them (also kept as ``self.pools``)."""

    @abstractmethod
    def plan(self, step: StepPlan) -> Any:
        """This step's metadata (backend-specific), handed to every ``forward``."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """Write k, v [N, kv_heads, d] at the step's slots of pool ``layer``, then attend:
        q [N, heads, d] -> [N, heads, d]."""

    def plan_side(self, step: StepPlan) -> Any:
        """Metadata for a pass between steps that attends over its own pool layer only
        (the MTP head: helexa/neuron/models/mtp.py); it must leave state a backend keeps from
        step to step alone. Backends without such state plan as for a step."""
        return self.plan(step)

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None) -> torch.Tensor:
        """The step's fp32 logits; backends with a whole-step path override this."""
        return model(input_ids, positions, meta, logits_rows)

    def step_failed(self) -> None:
        """A step raised part way: drop any state that assumed it would finish."""
        return None


class StepMeta:
    """Base of every backend's per-step metadata: it knows its backend, so a layer needs
    only the metadata it was handed to reach the right kernels and pools."""

    backend: AttentionBackend


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
              meta: StepMeta) -> torch.Tensor:
    """The one attention op models call: store this step's k, v [N, kv_heads, d] for
    attention layer ``layer`` and return attention of q [N, heads, d] over each row's
    context (decode rows: everything cached; prefill rows: causal), [N, heads, d]."""
    return meta.backend.forward(layer, q, k, v, meta)
