"""The cuda device's step executor: pure-decode steps captured as CUDA graphs and replayed.

A pure-decode step of b rows that the cuda attention backend planned on its b-row
cuda-graph wrapper (CudaMetadata.graph_rows, cuda.py) is captured the first time that b
is seen and replayed after: the step's ids, positions and slots are copied into the
graph's static inputs (the wrapper itself was re-planned by the step's ``plan``), the
graph replayed, its static output copied out. Graphs hold the pools' addresses, so a new
pool drops them. Every other step runs the model's forward. Only with
``engine.cuda_graphs`` at tp = 1, never for hybrid models (a graph would replay one
step's state slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from helexa.kernels.backends.cuda import CudaAttention, CudaMetadata
from helexa.kernels.backends.executor import LinearSite, StepExecutor, model_forward
from helexa.kernels.paged_kv import PagedKV

log = structlog.get_logger(component="kernels")


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: CudaMetadata  # static: the graph wrapper and its slot mapping
    out: torch.Tensor


class CudaGraphExecutor(StepExecutor):
    def __init__(self, attention: CudaAttention) -> None:
        self.attention = attention
        self._graphs: dict[int, _Graph] = {}

    def describe(self) -> str:
        rows = self.attention.graph_rows
        return f"graphs for 1..{rows} rows" if rows else "no graphs"

    def prepare(self, model: torch.nn.Module, linears: list[LinearSite], *, max_num_seqs: int,
                max_batched_tokens: int, tp_size: int) -> None:
        # Any: the model families share no typed base (helexa/neuron/models/)
        loaded: Any = model
        self.attention.heads = loaded.attention_layers[0].num_heads  # FlashInfer plans with it
        if self.attention.graph_rows:  # a captured graph holds the rotary table's address
            loaded.rotary.ensure(loaded.cfg.max_position_embeddings)  # never grow it

    def kv_allocated(self, pools: list[PagedKV]) -> None:
        self._graphs = {}  # graphs hold the old pools' addresses

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None, state: Any = None) -> torch.Tensor:
        b = meta.graph_rows if isinstance(meta, CudaMetadata) else 0
        if not b or logits_rows is not None or state is not None:
            return model_forward(model, input_ids, positions, meta, logits_rows, state)
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(model, b, input_ids, positions, meta)
        g.ids.copy_(input_ids)
        g.positions.copy_(positions)
        g.meta.slot_mapping.copy_(meta.slot_mapping)
        g.graph.replay()
        return g.out.clone()  # the static output is overwritten by the next replay

    def _capture(self, model: torch.nn.Module, b: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, meta: CudaMetadata) -> _Graph:
        """Capture a b-row decode step over this step's (already planned) inputs."""
        device = input_ids.device
        static = self.attention.static_meta(b)
        ids, pos = input_ids.clone(), positions.clone()
        static.slot_mapping.copy_(meta.slot_mapping)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up off the capture (allocator, lazy inits)
            model(ids, pos, static, None)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, pos, static, None)
        log.info("kernels.cuda_graph_captured", rows=b)
        return _Graph(graph, ids, pos, static, out)
