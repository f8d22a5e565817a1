"""The device hook beside attention: which kernels the weights run, and how a whole step runs.

Attention backends (base.py) own the KV pool and the attention op; a device may also
give the model's linear layers faster products (same results, other kernels) and run
some steps as a whole instead of layer by layer (fused CPU decode, CUDA graph replay).
That is a :class:`StepExecutor`, one per model runner, built with its attention backend
(backends/__init__.py):

- at load, ``prepare`` gets the model and its linear layers as :class:`LinearSite`s (the
  model code lists them: helexa/neuron/models/layers.py ``linear_sites``), so kernels/
  never imports the model code; the dependency points neuron → kernels only;
- at tp > 1, once the ranks' group exists, ``grouped`` (set-up that asks the other ranks);
- whenever the pools are (re)allocated, ``kv_allocated`` gets them;
- where the runner is rebuilt for wider decode batches (a wider profile, with no request
  running: pool_probe.switch_pool), ``set_graph_rows`` before its next pool;
- per step, ``run`` returns the step's fp32 logits: the model's forward, unless the
  executor has a whole-step path for this step's metadata;
- an executor that captures steps (CUDA graphs) names the decode batch sizes in
  ``graph_sizes``; the runner then runs one decode step of each, in that order, inside
  ``capturing`` once the pools exist (at load, and after each reallocation);
- per step, before it runs, ``decide`` says how ``run`` will run it (EAGER, CAPTURE,
  REPLAY): at tp > 1 rank 0's decision travels in the step (TpStep.graph) and every other
  rank runs the step as it says, so the ranks' graphs hold the same collectives by
  construction (docs/architecture.md, attention backends).

The base class is the plain one (every step through the model's forward, weights left
as loaded): the ``torch`` device's, and the fallback of the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from helexa.kernels.paged_kv import PagedKV

# kernel(x, bias) -> x @ W^T + bias, the product a linear layer runs when one is installed
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

# How a step runs (StepExecutor.decide): layer by layer, captured as a graph, or replayed
EAGER, CAPTURE, REPLAY = "", "capture", "replay"


class LinearModule(Protocol):
    """A linear layer a device may give another kernel: y = x @ weight^T + bias, computed by
    ``kernel(x, bias)`` when set (None: F.linear)."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    kernel: LinearKernel | None


@dataclass
class LinearSite:
    """One of the model's linear products, as the model code describes it to the device."""

    module: LinearModule
    quantised: bool  # its product is a quantised op's (helexa/kernels/quant.py): keep it
    tied: bool  # its weight is also the embedding table: its layout stays as it is


@runtime_checkable
class MeasuredAtLoad(Protocol):
    """A quantised product that picks its kernels by measuring (helexa/kernels/cpu/int8g.py):
    ``prepare`` makes it measure now rather than in the first request's decode step."""

    def prepare(self, max_num_seqs: int) -> None: ...


def measured_at_load(model: torch.nn.Module, linears: list[LinearSite]) -> list[MeasuredAtLoad]:
    """Every product of ``model`` that picks its kernels at its first call: the linears'
    (``linears``), and a MoE block's quantised experts (its ``experts_kernel``)."""
    found: list[MeasuredAtLoad] = [s.module.kernel for s in linears
                                   if isinstance(s.module.kernel, MeasuredAtLoad)]
    found += [m.experts_kernel for m in model.modules()
              if isinstance(getattr(m, "experts_kernel", None), MeasuredAtLoad)]
    return found


class StepExecutor:
    """Every step through the model's forward; the weights keep their kernels."""

    def describe(self) -> str:
        """What this executor chose, for the load log and status ("" when nothing to say)."""
        return ""

    def prepare(self, model: torch.nn.Module, linears: list[LinearSite], *, max_num_seqs: int,
                max_batched_tokens: int, tp_size: int) -> None:
        """After loading (and the model's own finalize): device-specific weight prep."""
        return None

    def grouped(self, model: torch.nn.Module) -> None:
        """Tensor parallel: every rank's group formed (each rank calls this once, in the same
        order, before any step): the set-up that asks the other ranks (none here)."""
        return None

    def agreed(self) -> None:
        """Tensor parallel: the group refused a kernel kind this rank had chosen
        (helexa/neuron/engine/tp_kernels.py): what ``describe`` says, as now chosen."""
        return None

    def kv_allocated(self, pools: list[PagedKV]) -> None:
        """The attention backend (re)allocated its pools (an empty list: freed)."""
        return None

    def graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture once the pools exist, in capture order (none)."""
        return []

    def set_graph_rows(self, rows: int) -> None:
        """Decode batches of up to ``rows`` from the next pool on (the runner rebuilt for a
        wider profile, no request running, its pool about to be made anew): the graphs
        captured for the old width dropped first, their memory with them (none here)."""
        return None

    def graphs_refused(self) -> str:
        """Why this rank's graphs cannot run over its pool ("" where they can, or none)."""
        return ""

    def group_graphs(self, refused: str) -> None:
        """Tensor parallel, rank 0, before capturing over a new pool: why another rank's
        graphs cannot run over its pool ("" where every rank's can): then none are
        captured or replayed here, so every step runs eagerly, as rank 0 says."""
        return None

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """The steps run inside are the capture steps of graph_sizes."""
        yield

    def decide(self, model: torch.nn.Module, meta: Any, logits_rows: torch.Tensor | None,
               images: bool) -> str:
        """How ``run`` runs this step (EAGER, CAPTURE or REPLAY); ``images``: the step
        carries image inputs. Rank 0's decision is every rank's (TpStep.graph)."""
        return EAGER

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None, state: Any = None,
            graph: str | None = None) -> torch.Tensor:
        """The step's fp32 logits; ``state`` is the linear-attention state backend's
        metadata of the step (hybrid models), handed to the model's forward; ``graph``:
        how to run it, as ``decide`` (rank 0's) said (None: decided here)."""
        return model_forward(model, input_ids, positions, meta, logits_rows, state)


def model_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: Any, logits_rows: torch.Tensor | None, state: Any) -> torch.Tensor:
    """The step layer by layer: ``model(input_ids, positions, meta, logits_rows[, state])``
    (a model without linear-attention layers takes no state)."""
    out: torch.Tensor = (model(input_ids, positions, meta, logits_rows) if state is None
                         else model(input_ids, positions, meta, logits_rows, state))
    return out
