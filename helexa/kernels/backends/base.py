"""The attention-backend interface: how a model's attention reaches the KV pool.

A model calls one op, :func:`attention`, with its layer's rotated q and new k, v;
it knows nothing of devices, pools or kernels. Everything device-specific about
attention sits behind :class:`AttentionBackend`, one instance per model runner:

- ``allocate_kv`` lays out each layer's K/V pool (as its memory statement,
  helexa/checkpoint/layer_memory.py AttentionSpec, counts it) in the shape its kernels read;
- per step, ``plan`` turns the runner's :class:`StepPlan` (the flat batch: decode
  rows first, then prefill chunks, with their block tables) into the backend's
  own metadata type, built once and shared by every layer;
- per layer, ``forward`` writes the new K/V into the pool and attends: decode
  rows over their whole context, prefill chunks causally over cached context
  plus themselves.

A backend that covers only some steps composes the ``torch`` one (the plain
reference every other is tested against) and hands it the rest: its ``plan``
returns the reference's metadata, whose ``backend`` is the reference, so
:func:`attention` reaches it directly (as mini-sglang's HybridBackend composes two).
Weight kernels and whole-step execution (fused CPU decode, CUDA graph replay) are a
separate hook (executor.py); the Gated DeltaNet state is its own backend (gdn.py).
``select`` (backends/__init__.py) builds a device's pair; see docs/architecture.md.

A new model family needs nothing from here but :func:`attention`: give each
attention layer its index among the model's attention layers (``layer``), and
list the layers' (kv_heads, head_dim) through ``attention_layers`` so the
runner sizes the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels.paged_kv import PagedKV


@dataclass
class PrefillRow:
    """One sequence's prefill chunk: flat rows [start, end), ``num_computed`` tokens of it
    already cached, its block table covering num_computed + (end - start) tokens."""

    start: int
    end: int
    num_computed: int
    block_table: list[int]
    state_slot: int = -1  # hybrid models: the sequence's linear-attention state slot
    # A speculative verification row (its last token and drafts, logits at each): the
    # linear-attention state runs it token by token and holds it (helexa/kernels/linear_state.py)
    verify: bool = False


@dataclass
class StepPlan:
    """What a step is, as the runner laid it out (independent of any backend)."""

    slot_mapping: torch.Tensor  # [N] on the device: where each new token's K/V go
    decode_positions: list[int] = field(default_factory=list)  # one new token per row
    # The engine's own block-table lists (the same objects from step to step while a
    # request runs: backends may key state on their identity).
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_state_slots: list[int] = field(default_factory=list)  # hybrid models, per decode row
    prefills: list[PrefillRow] = field(default_factory=list)
    # Hybrid models' prefix snapshots (helexa/kernels/backends/gdn.py): (snapshot slot,
    # state slot) copied in before the step, (state slot, snapshot slot) copied out after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    block_size: int = 16
    num_blocks: int = 0

    @property
    def num_decode(self) -> int:
        return len(self.decode_positions)


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention as a kernel library sees it: the whole model's heads as the
    runner gives it, one rank's once ``per_rank`` (backends.select does)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype (FlashInfer's q dtype)

    @property
    def group(self) -> int:
        return self.heads // max(1, self.kv_heads)

    def per_rank(self, tp: int) -> AttentionShape:
        """On one of ``tp`` ranks: the query heads split, the KV heads split or, fewer than
        the ranks, one on each (the plan's kv_heads_per_card)."""
        return AttentionShape(self.heads // tp, -(-self.kv_heads // tp), self.head_dim,
                              self.dtype)


class AttentionBackend(ABC):
    """One model runner's attention kernels and KV pools (see the module docstring)."""

    name = "?"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pools: list[PagedKV] = []

    def describe(self) -> str:
        """What this backend chose, for the load log and status ("" when nothing to say)."""
        return ""

    @abstractmethod
    def allocate_kv(self, layers: list[AttentionSpec], num_blocks: int, block_size: int, *,
                    storage: torch.dtype | None, compute: torch.dtype) -> list[PagedKV]:
        """Drop the old pools and allocate one per attention layer, as its spec states;
        returns them (also kept as ``self.pools``). ``storage``: the plain kv dtype's
        torch dtype (None for the quantised ones, which kernels.kv_quant lays out)."""

    @abstractmethod
    def plan(self, step: StepPlan) -> StepMeta:
        """This step's metadata (the backend's own type), handed to every ``forward``."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """Write k, v [N, kv_heads, d] at the step's slots of pool ``layer``, then attend:
        q [N, heads, d] -> [N, heads, d]."""

    def plan_side(self, step: StepPlan) -> StepMeta:
        """Metadata for a pass between steps that attends over its own pool layer only
        (the MTP head); it must leave state a backend keeps from step to step alone.
        Backends without such state plan as for a step."""
        return self.plan(step)

    def step_failed(self) -> None:
        """A step raised part way: drop any state that assumed it would finish."""
        return None


class StepMeta:
    """Base of every backend's per-step metadata: it knows its backend, so a layer needs
    only the metadata it was handed to reach the right kernels and pools."""

    backend: AttentionBackend


def used_blocks(table: list[int], length: int, block_size: int, num_blocks: int) -> list[int]:
    """The blocks of ``table`` that hold a sequence's first ``length`` tokens (ValueError
    when the table is too short)."""
    used = -(-length // block_size)
    if len(table) < used:
        raise ValueError(f"block table of {len(table)} blocks × {block_size} cannot hold "
                         f"{length} tokens")
    return table[:used]


def pinned(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of ``values``, pinned where ``device`` is a CUDA device: a copy to it
    from there need not wait, where one from pageable memory holds the host until the
    device has run everything queued before it (a host sync, which the GPU check counts).
    PyTorch's pinned allocator keeps the buffer until a copy from it has run."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
    """A step's small index list on ``device``, copied from pinned memory without waiting."""
    return pinned(values, dtype, device).to(device, non_blocking=True)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, through pinned memory where that is a CUDA device
    (as ``pinned``: no wait); ``t`` itself elsewhere."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of device tensor ``t`` in pinned host memory, made without waiting: read it
    once an event recorded after this call has passed."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class CopiesDone:
    """A CUDA event that ``record`` places after the work queued so far on its device's
    current stream (a plan's copies, ``to_host``'s). It names that stream itself:
    ``Event.record()`` alone takes the calling thread's current device's, and a wait on
    cuda:0's stream for copies queued on cuda:1 would pass before they land."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.event = device, torch.cuda.Event()

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return bool(self.event.query())


def copies_done_event(device: torch.device) -> CopiesDone | None:
    """An event to record after copies queued on ``device`` (a plan's, ``to_host``'s): None
    off a GPU, where nothing is queued."""
    return CopiesDone(device) if device.type == "cuda" else None


def token_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence, a block run at a time."""
    out: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = table[block] * block_size + offset
        out.extend(range(base, base + take))
        pos += take
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
              meta: StepMeta) -> torch.Tensor:
    """The one attention op models call: store this step's k, v [N, kv_heads, d] for
    attention layer ``layer`` and return attention of q [N, heads, d] over each row's
    context (decode rows: everything cached; prefill rows: causal), [N, heads, d]."""
    return meta.backend.forward(layer, q, k, v, meta)
