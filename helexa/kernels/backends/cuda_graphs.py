"""The cuda device's step executor: pure-decode steps captured as CUDA graphs and replayed.

Every decode batch size 1..graph_rows is captured at load, largest first
(checkpoint/memory.py graph_capture_sizes), into one shared memory pool: the smaller
graphs reuse what the largest took, which is what ``helexa plan`` counts
(graph_pool_bytes). The model runner drives it: while ``capturing`` it runs one b-row
decode step per size, and a step whose b has no graph is captured then; after load no
graph is ever captured mid-serving (a size without one runs layer by layer).

A pure-decode step of b rows that the cuda attention backend planned on its b-row
cuda-graph wrapper (CudaMetadata.graph_rows, cuda.py), or, over a quantised pool whose
writes and decode rows run Triton kernels, into the torch path's fixed buffers for b rows
(TorchMetadata.graph_rows, torch_ref.py), replays its graph: the step's ids,
positions and, for hybrid models, linear-attention state slots (GdnMetadata.decode_slots,
and their int32 twin for FlashInfer's pool decode) are copied into the graph's static
inputs (the step's ``plan`` already filled the wrapper's index buffers and its KV append's
positions), the graph replayed, and its rows of the one shared output buffer copied out.
A model with an MTP head is captured writing its final hidden states to a second shared
buffer too, so that a step whose drafter reads them (keep_hidden) replays as well.
Graphs hold the pools' addresses, so a new pool drops them (the runner captures again).
A wider decode batch (``set_graph_rows``: a profile with more rows, switched with no
request running) drops them too, their memory pool and the shared outputs with them,
before the attention backend's graph buffers are made at the new width; the runner then
captures every size anew over its next pool. The fused all-reduce's rows (tp > 1) stay
as ``prepare`` installed them: a batch wider than those runs NCCL's all-reduce.
With tensor parallelism every rank runs the same steps
in the same order, and each step as rank 0 decided (``decide``: the step's TpStep.graph):
a worker rank captures exactly the steps rank 0 captures, replays the sizes rank 0
replays and runs eagerly the steps rank 0 runs eagerly, so their graphs hold the same
collectives by construction; a worker asked to replay or capture a step it cannot (its
plan of the step no graph's) fails that step, naming why, rather than run it otherwise.

``prepare`` gives the model's norms and MLPs FlashInfer's one-kernel RMSNorm, residual add
+ RMSNorm and SiLU-and-mul (cuda_fused.py). At tp > 1, once the ranks' group exists
(``grouped``), the model's reducing norms get FlashInfer's fused all-reduce + add + RMSNorm
where every rank can run it (cuda_comm.py); ``describe`` says which runs. Grouped int8
layers (GGUF Q8_0/Q6_K/Q5_K, GPTQ 8-bit) run their decode kernel once in ``prepare``, so
that it proves itself on the card, and Triton compiles it, at load
(helexa/kernels/cuda/int8g.py).

The CUDA calls sit behind :class:`GraphRuntime` so that CPU tests can stand in for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import structlog
import torch

from helexa.checkpoint.memory import fused_allreduce_rows, graph_capture_sizes
from helexa.checkpoint.shape import max_positions
from helexa.kernels.backends import cuda_comm, cuda_fused
from helexa.kernels.backends.cuda import CudaAttention, CudaMetadata
from helexa.kernels.backends.executor import (
    CAPTURE,
    EAGER,
    REPLAY,
    LinearSite,
    StepExecutor,
    measured_at_load,
    model_forward,
)
from helexa.kernels.backends.torch_ref import TorchMetadata
from helexa.kernels.cuda import int4_tiles as int4_cuda
from helexa.kernels.cuda import int8g as int8g_cuda
from helexa.kernels.cuda import moe_routed
from helexa.kernels.paged_kv import PagedKV

log = structlog.get_logger(component="kernels")


def rope_reach(cfg: Any) -> int:
    """The positions a model addresses: max_position_embeddings, or its rope-scaled reach
    (checkpoint/shape.py max_positions, from the model's parsed config)."""
    scaling = {**cfg.rope.params, "rope_type": cfg.rope.rope_type}
    return max_positions({"max_position_embeddings": cfg.max_position_embeddings,
                          "rope_scaling": scaling})


class GraphRuntime:
    """The CUDA calls of capture and replay (a test stands in one that runs on CPU)."""

    def pool(self) -> Any:
        """A memory pool every graph of this executor shares."""
        return torch.cuda.graph_pool_handle()

    def __init__(self) -> None:
        self._warm: dict[torch.device, Any] = {}

    def capture(self, device: torch.device, run: Callable[[], None], pool: Any) -> Any:
        """run once off the capture (allocator, lazy inits), then captured into pool. The
        warm runs and the captures share one side stream of ``device``: each new stream
        would get cuBLAS a workspace of its own, never freed (torch keeps one a (handle,
        stream)), a graph size each; and torch.cuda.graph's own capture stream is made on
        whichever device is current when it is first used, where a capture on another
        device's stream would record none of this device's kernels."""
        stream = self._warm.get(device)
        if stream is None:
            stream = self._warm[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the tensor-parallel health thread may touch CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, stream=stream,
                              capture_error_mode="thread_local"):
            run()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: CudaMetadata | TorchMetadata  # static: the buffers the step's plan fills
    state: Any  # static GdnMetadata (hybrids): its decode_slots filled before replay; or None
    hidden: bool = False  # it also writes the final hidden states (a model with an MTP head)


class CudaGraphExecutor(StepExecutor):
    def __init__(self, attention: CudaAttention, runtime: GraphRuntime | None = None,
                 comm: cuda_comm.CommRuntime | None = None,
                 fused_ops: cuda_fused.FusedOps | None = None,
                 graph_workspace: Callable[[int], int] | None = None) -> None:
        self.attention = attention
        # FlashInfer's graph wrappers' scratch for batches of up to n rows (set_graph_rows)
        self.graph_workspace = graph_workspace
        self.runtime = runtime or GraphRuntime()
        self.comm = comm or cuda_comm.CommRuntime()
        self.fused_ops = fused_ops  # None: FlashInfer's (cuda_fused.FusedOps)
        self.fused = ""  # which norm / SiLU kernels run (cuda_fused.install)
        self.allreduce = ""  # tp > 1: which all-reduce runs (cuda_comm.install)
        self.quantised = ""  # which kernel a grouped int8 layer's decode step runs
        self._kinds = (False, False, False)  # prepare's: int8, int4 and MoE kernels to describe
        self._experts: list[Any] = []  # prepare's MoE stacks on the routed kernel (agreed)
        self._graphs: dict[int, _Graph] = {}
        self._pool: Any = None
        self._out: torch.Tensor | None = None  # [graph_rows, vocab] fp32: every graph's logits
        self._hidden: torch.Tensor | None = None  # [graph_rows, hidden]: with an MTP head
        self._capturing = False
        self._allreduce_rows = 0  # tp > 1: the fused all-reduce's rows, installed in grouped
        self._refused = ""  # tp > 1: why another rank's graphs cannot run over this pool

    def describe(self) -> str:
        rows = self.attention.graph_rows
        graphs = f"graphs for 1..{rows} rows, captured at load" if rows else "no graphs"
        if rows and self.attention.torch_path:  # its steps are planned for the torch path
            graphs = (f"{graphs} (the torch path's Triton kernels)"
                      if self.attention.reference.graph_ready() else
                      f"no graphs ({self.attention.torch_path}: torch path, eager)")
        if rows and self._refused:
            graphs = f"no graphs ({self._refused})"
        return "; ".join(p for p in (graphs, self.fused, self.quantised, self.allreduce) if p)

    def graph_sizes(self) -> list[int]:
        return [] if self._refused else graph_capture_sizes(self.attention.graph_rows)

    def set_graph_rows(self, rows: int) -> None:
        if not self.attention.graph_rows:  # engine.cuda_graphs off: none, at any width
            return
        # the old graphs and their memory pool go first (kv_allocated's), and the shared
        # outputs sized for the old rows; nothing of theirs runs: no request is in flight
        self.kv_allocated([])
        self._out = self._hidden = None
        a = self.attention  # its graph wrappers, their page indices and scratch (the old
        # freed first) are made at the new width with the next pool (CudaAttention.allocate_kv)
        a.graph_rows = a.reference.graph_rows = rows
        if self.graph_workspace is not None:
            a.graph_workspace_bytes = self.graph_workspace(rows)

    def graphs_refused(self) -> str:
        a = self.attention
        if a.graph_rows and a.torch_path and not a.reference.graph_ready():
            return f"{a.torch_path}: torch path, eager"  # its Triton kernels refused here
        return ""

    def group_graphs(self, refused: str) -> None:
        self._refused = refused

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def prepare(self, model: torch.nn.Module, linears: list[LinearSite], *, max_num_seqs: int,
                max_batched_tokens: int, tp_size: int) -> None:
        # Any: the model families share no typed base (helexa/neuron/models/)
        loaded: Any = model
        self.attention.heads = loaded.attention_layers[0].num_heads  # FlashInfer plans with it
        if self.attention.graph_rows:  # a captured graph holds the rotary table's address:
            # sized for every position the model addresses (rope scaling's reach included,
            # as helexa plan caps the context), then never grown
            loaded.rotary.ensure(rope_reach(loaded.cfg))
            loaded.rotary.frozen = True
            # a quantised pool's graphs: each row's pages and the decode's splits for as
            # many positions (torch_ref.py static_meta)
            self.attention.reference.reach = rope_reach(loaded.cfg)
        dtype = loaded.model.embed_tokens.weight.dtype
        self.fused = cuda_fused.install(model, dtype, self.fused_ops)
        rope = cuda_fused.install_rope(model, dtype, self.fused_ops)
        self.fused = "; ".join(p for p in (self.fused, rope) if p)
        self._allreduce_rows = fused_allreduce_rows(max_num_seqs) if tp_size > 1 else 0
        # grouped int8 layers: their decode kernel proves itself (and Triton compiles it for
        # each shape) now, not in the first request's step (helexa/kernels/cuda/int8g.py)
        measured = measured_at_load(model, linears)  # a MoE block's quantised experts too
        for block in model.modules():  # a MoE block's float stacks: read in place where proved
            if hasattr(block, "routed") and getattr(block, "experts_kernel", 0) is None:
                block.routed = moe_routed.FloatExperts(block)
                measured.append(block.routed)
        for kernel in measured:
            kernel.prepare(max_num_seqs)
        kinds = {getattr(k, "kind", "int8") for k in measured} - {"float"}
        experts = any(hasattr(k, "routed_experts") or isinstance(k, moe_routed.FloatExperts)
                      for k in measured)  # a MoE block's stacks
        self._kinds = (bool(kinds - {"int4"}), "int4" in kinds, experts)
        self._experts = [k for k in measured if hasattr(k, "agreed")]  # a MoE block's stacks
        self.agreed()

    def agreed(self) -> None:
        for kernel in self._experts:  # proved stacks of a kind refused since step back
            kernel.agreed()
        int8, int4, experts = self._kinds
        self.quantised = "; ".join(p for p in (
            int8g_cuda.describe(self.attention.device) if int8 else "",
            int4_cuda.describe(self.attention.device) if int4 else "",
            moe_routed.describe(self.attention.device) if experts else "") if p)

    def grouped(self, model: torch.nn.Module) -> None:
        # at tp > 1: the norms whose add reduces a deferred product (models/layers.py) get
        # FlashInfer's fused all-reduce + add + RMSNorm where every rank can run it; install
        # asks the other ranks, so it runs once the group exists (never in prepare)
        if not self._allreduce_rows:
            return
        loaded: Any = model
        norms = [m for m in model.modules()
                 if getattr(m, "reduce", False) is True and hasattr(m, "fused")]
        self.allreduce = cuda_comm.install(
            norms, hidden=loaded.cfg.hidden_size, dtype=norms[0].weight.dtype,
            device=self.attention.device, rows=self._allreduce_rows, runtime=self.comm)

    def kv_allocated(self, pools: list[PagedKV]) -> None:
        self._graphs = {}  # graphs hold the old pools' addresses
        self._refused = ""  # the group is asked again over the new pool (group_graphs)
        # and a fresh memory pool for the next captures: torch reuses a pool id only while
        # something still holds it (its use count), and a block a library left in the old
        # one would make the recapture after a KV switch stop on that check
        self._pool = None

    def decide(self, model: torch.nn.Module, meta: Any, logits_rows: torch.Tensor | None,
               images: bool) -> str:
        b = meta.graph_rows if isinstance(meta, CudaMetadata | TorchMetadata) else 0
        if self._refused:  # another rank's graphs cannot run over its pool: none here
            return EAGER
        # a step carrying image inputs (a vision model's MmStep: M-RoPE positions, the
        # tower's embeddings) runs eagerly: a graph reads ids and 1-D positions alone
        if not b or logits_rows is not None or images:
            return EAGER
        g = self._graphs.get(b)
        if g is None:  # never captured mid-serving: this size runs eagerly
            return CAPTURE if self._capturing else EAGER
        # keep_hidden: a drafter reads the step's hidden states (the MTP head's input)
        if getattr(model, "keep_hidden", False) and not g.hidden:
            return EAGER  # captured without them: this step runs eagerly
        return REPLAY

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None, state: Any = None,
            graph: str | None = None) -> torch.Tensor:
        if graph is None:
            graph = self.decide(model, meta, logits_rows, getattr(model, "mm", None) is not None)
        if graph == EAGER:
            return model_forward(model, input_ids, positions, meta, logits_rows, state)
        b = meta.graph_rows if isinstance(meta, CudaMetadata | TorchMetadata) else 0
        g = self._graphs.get(b)
        if not b or (graph == REPLAY and g is None):  # out of step with rank 0's graphs
            raise RuntimeError(f"tensor-parallel rank 0 {graph}s this step's graph, which this "
                               "rank " + (f"never captured ({b} rows)" if b else
                                          "planned to run eagerly"))
        if graph == CAPTURE:
            g = self._graphs[b] = self._capture(model, b, input_ids, positions, meta, state)
        assert g is not None
        keep = getattr(model, "keep_hidden", False) and g.hidden
        g.ids.copy_(input_ids)
        g.positions.copy_(positions)
        if g.state is not None:
            g.state.decode_slots.copy_(state.decode_slots)
            if g.state.decode_slots32 is not None:
                g.state.decode_slots32.copy_(state.decode_slots32)
        self.runtime.replay(g.graph)
        assert self._out is not None
        if keep:
            assert self._hidden is not None
            loaded: Any = model
            loaded.last_hidden = self._hidden[:b].clone()
        return self._out[:b].clone()  # the shared output is overwritten by the next replay

    def _capture(self, model: torch.nn.Module, b: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, meta: CudaMetadata | TorchMetadata,
                 state: Any) -> _Graph:
        """Capture a b-row decode step over this step's (already planned) inputs."""
        static = self.attention.static_meta(b)
        ids, pos = input_ids.clone(), positions.clone()
        # a pure-decode step's state metadata is its slots alone: a fixed buffer of them
        static_state = None if state is None else replace(
            state, decode_slots=state.decode_slots.clone(),
            decode_slots32=None if state.decode_slots32 is None else state.decode_slots32.clone())
        if self._pool is None:
            self._pool = self.runtime.pool()
        out_rows = max(b, self.attention.graph_rows)
        loaded: Any = model
        # a model with an MTP head: its drafter may ask any step for the hidden states
        hidden = getattr(loaded, "mtp", None) is not None

        def step() -> None:
            keep = getattr(loaded, "keep_hidden", False)
            loaded.keep_hidden = keep or hidden
            try:
                logits = model_forward(model, ids, pos, static, None, static_state)
                h = loaded.last_hidden if hidden else None
            finally:
                loaded.keep_hidden = keep
                if hidden and not keep:  # the runner did not ask: nothing left behind
                    loaded.last_hidden = None
            if self._out is None or self._out.shape[0] < out_rows:
                self._out = logits.new_empty(out_rows, logits.shape[-1])  # outside any graph
            self._out[:b].copy_(logits)
            if h is not None:
                if self._hidden is None or self._hidden.shape[0] < out_rows:
                    self._hidden = h.new_empty(out_rows, h.shape[-1])  # outside any graph
                self._hidden[:b].copy_(h)

        if self._out is None:  # allocate the shared output before capture, not inside it
            step()
        graph = self.runtime.capture(input_ids.device, step, self._pool)
        log.info("kernels.cuda_graph_captured", rows=b)
        return _Graph(graph, ids, pos, static, static_state, hidden)
