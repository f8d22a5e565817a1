"""The CUDA graph executor's bookkeeping, with the CUDA calls stood in by a CPU runtime:
every decode size captured at load, largest first, into one pool; replays read each
step's own inputs (the KV layout its plan filled, and state slots for hybrids); nothing is
captured mid-serving; a new pool drops the graphs. No GPU runs here: what a real capture
costs is unmeasured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.graphs import StandInRuntime

from helexa.kernels.backends.cuda import CudaMetadata, KvAppend
from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor
from helexa.kernels.backends.executor import CAPTURE, EAGER, REPLAY
from helexa.kernels.backends.gdn import GdnMetadata
from helexa.kernels.backends.torch_ref import TorchBackend

VOCAB = 5


class StandInAttention:
    """As CudaAttention: a b-row decode step's plan fills that size's static KV-append
    buffers (one per size, which its graph reads) with the step's layout."""

    def __init__(self, graph_rows: int) -> None:
        self.graph_rows = graph_rows
        self.torch_path = ""  # a pool FlashInfer reads
        self.reference = TorchBackend(torch.device("cpu"))  # the torch path, here unused
        self.static: dict[int, KvAppend] = {}

    def static_meta(self, b: int) -> CudaMetadata:
        if b not in self.static:
            z = torch.zeros(b, dtype=torch.int32)
            self.static[b] = KvAppend(torch.arange(b, dtype=torch.int32), z.clone(), z.clone(),
                                      torch.zeros(b + 1, dtype=torch.int32), z.clone())
        return CudaMetadata(backend=self, append=self.static[b], num_decode=b, graph_rows=b)  # type: ignore[arg-type]

    def plan(self, b: int, positions: torch.Tensor, pages: torch.Tensor) -> CudaMetadata:
        meta = self.static_meta(b)
        meta.append.positions.copy_(positions)
        meta.append.indices[:b].copy_(pages)
        return meta


class Model(torch.nn.Module):
    """Logits that depend on every static input: ids, positions, KV slots, state slots."""

    keep_hidden = False

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: CudaMetadata,
                logits_rows: torch.Tensor | None, state: GdnMetadata | None = None
                ) -> torch.Tensor:
        row = ids * 1000 + positions * 100 + meta.append.indices[:len(ids)] * 10
        if state is not None:
            row = row + state.decode_slots
            if state.decode_slots32 is not None:  # FlashInfer's pool decode reads these
                row = row + 10000 * state.decode_slots32
        return row[:, None].float() + torch.arange(VOCAB)


class HiddenModel(Model):
    """A model with an MTP head: with keep_hidden, its forward keeps its final hidden
    states (here: a function of every static input, as its logits)."""

    def __init__(self, mtp: bool = True) -> None:
        super().__init__()
        self.mtp = torch.nn.Identity() if mtp else None
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def forward(self, *args: Any) -> torch.Tensor:
        logits = super().forward(*args)
        if self.keep_hidden:
            self.last_hidden = logits[:, :3] * -2
        return logits


def executor(rows: int = 4) -> tuple[CudaGraphExecutor, StandInRuntime]:
    runtime = StandInRuntime()
    return CudaGraphExecutor(StandInAttention(rows), runtime), runtime  # type: ignore[arg-type]


def decode(ex: CudaGraphExecutor, b: int, seed: int, state: bool = False,
           pool: bool = False, model: Model | None = None) -> torch.Tensor:
    """pool: the state metadata carries the int32 slots FlashInfer's pool decode reads."""
    ids = torch.arange(b) + seed
    positions, pages = torch.arange(b) * 2 + seed, torch.arange(b) + 3 * seed
    meta = ex.attention.plan(b, positions, pages)  # type: ignore[attr-defined]
    slots = torch.arange(b) + 7 * seed
    gdn = GdnMetadata(backend=None, decode_slots=slots,  # type: ignore[arg-type]
                      decode_slots32=(slots + 1).to(torch.int32) if pool else None)
    return ex.run(model or Model(), ids, positions, meta, None, gdn if state else None)


def eager(b: int, seed: int, state: bool = False, pool: bool = False,
          model: Model | None = None) -> torch.Tensor:
    ex, _ = executor(0)  # no graphs
    return decode(ex, b, seed, state, pool, model)


def load(ex: CudaGraphExecutor, state: bool = False, pool: bool = False,
         model: Model | None = None) -> None:
    """What the model runner does at load (model_runner._capture_graphs)."""
    with ex.capturing():
        for b in ex.graph_sizes():
            decode(ex, b, seed=0, state=state, pool=pool, model=model)


def test_every_size_is_captured_at_load_largest_first_into_one_pool():
    ex, runtime = executor(4)
    assert ex.graph_sizes() == [4, 3, 2, 1]
    load(ex)
    assert list(ex._graphs) == [4, 3, 2, 1]  # in capture order
    assert len(runtime.captured) == 4 and len(runtime.pools) == 1
    assert set(runtime.captured) == {runtime.pools[0]}
    assert "captured at load" in ex.describe()


def test_a_replay_answers_each_steps_own_inputs():
    ex, runtime = executor(4)
    load(ex)
    at_load = runtime.replays  # each capture step is also replayed once
    first = decode(ex, 3, seed=1)
    second = decode(ex, 2, seed=2)
    assert runtime.replays == at_load + 2 and len(runtime.captured) == 4  # not captured
    torch.testing.assert_close(first, eager(3, 1))  # kept: a clone of the shared output
    torch.testing.assert_close(second, eager(2, 2))


def test_a_hybrids_state_slots_reach_the_replay():
    ex, _ = executor(2)
    load(ex, state=True)
    torch.testing.assert_close(decode(ex, 2, seed=3, state=True), eager(2, 3, state=True))


def test_the_int32_slots_of_flashinfers_pool_decode_reach_the_replay():
    ex, _ = executor(2)
    load(ex, state=True, pool=True)
    got = decode(ex, 2, seed=5, state=True, pool=True)
    torch.testing.assert_close(got, eager(2, 5, state=True, pool=True))
    assert not torch.equal(got, eager(2, 5, state=True))  # the twin counts in the logits


def test_nothing_is_captured_mid_serving():
    ex, runtime = executor(4)
    load(ex)
    at_load = runtime.replays
    ex.kv_allocated([])  # a new pool drops the graphs
    got = decode(ex, 3, seed=4)  # a serving step before the runner captured again
    assert runtime.replays == at_load and len(runtime.captured) == 4
    torch.testing.assert_close(got, eager(3, 4))  # ran layer by layer
    load(ex)  # captured again over the new KV pool: into a memory pool of their own
    assert len(runtime.pools) == 2 and set(runtime.captured[4:]) == {runtime.pools[1]}


def test_a_step_carrying_image_inputs_runs_eagerly():
    """A step whose model holds image inputs (a vision model's MmStep: the tower's
    embeddings, M-RoPE positions) never replays a graph, which reads ids and 1-D positions
    alone; the next step without them replays again."""
    ex, runtime = executor(4)
    model = Model()
    load(ex, model=model)
    at_load = runtime.replays
    model.mm = object()  # the vision step's inputs for this step
    got = decode(ex, 2, seed=5, model=model)
    assert runtime.replays == at_load
    torch.testing.assert_close(got, eager(2, 5))
    model.mm = None
    decode(ex, 2, seed=6, model=model)
    assert runtime.replays == at_load + 1


def decide(ex: CudaGraphExecutor, b: int, model: Model | None = None,
           images: bool = False) -> str:
    """How the executor would run a b-row decode step (rank 0's decision at tp > 1)."""
    meta = ex.attention.plan(b, torch.arange(b), torch.arange(b))  # type: ignore[attr-defined]
    return ex.decide(model or Model(), meta, None, images)


def test_rank_0_decides_each_step_capture_replay_or_eager():
    """What rank 0 sends with each step (TpStep.graph): a capture step inside capturing,
    a replay where its size has a graph, eager where not, for image inputs, and where a
    drafter asks a headless model's step for hidden states."""
    ex, _ = executor(2)
    assert decide(ex, 2) == EAGER  # no graph yet, not capturing: never captured mid-serving
    with ex.capturing():
        assert decide(ex, 2) == CAPTURE
        decode(ex, 2, seed=0)
    assert decide(ex, 2) == REPLAY and decide(ex, 1) == EAGER
    assert decide(ex, 2, images=True) == EAGER
    headless = HiddenModel(mtp=False)
    headless.keep_hidden = True
    assert decide(ex, 2, model=headless) == EAGER


def test_a_worker_rank_runs_each_step_as_rank_0_decided():
    """A worker rank captures exactly the steps rank 0 says are captures (never in a
    capturing mode of its own), replays where rank 0 replays and runs eagerly where rank 0
    does, even a size it holds a graph for: its graphs' collectives stay in step with
    rank 0's. A replay of a size it never captured fails the step, naming why."""
    ex, runtime = executor(2)

    def step(b: int, seed: int, graph: str) -> torch.Tensor:
        ids, positions = torch.arange(b) + seed, torch.arange(b) * 2 + seed
        meta = ex.attention.plan(b, positions, torch.arange(b) + 3 * seed)  # type: ignore[attr-defined]
        return ex.run(Model(), ids, positions, meta, None, None, graph)

    torch.testing.assert_close(step(2, 0, EAGER), eager(2, 0))
    assert runtime.captured == [] and runtime.replays == 0
    step(2, 0, CAPTURE)  # rank 0's capture step at load
    assert len(runtime.captured) == 1 and runtime.replays == 1
    torch.testing.assert_close(step(2, 3, REPLAY), eager(2, 3))
    assert runtime.replays == 2
    torch.testing.assert_close(step(2, 4, EAGER), eager(2, 4))  # as rank 0 runs it
    assert runtime.replays == 2 and len(runtime.captured) == 1
    step(1, 5, EAGER)  # a size without a graph: eager, as rank 0's
    assert len(runtime.captured) == 1
    with pytest.raises(RuntimeError, match=r"rank 0 replays .* never captured \(1 rows\)"):
        step(1, 6, REPLAY)


def test_where_another_rank_cannot_run_graphs_rank_0_runs_none():
    """At tp > 1 rank 0 learns before capturing that another rank's graphs cannot run over
    its pool (group_graphs): it captures no size and decides every step eager (which the
    other ranks then run so), and its backend line says which rank and why, until a new
    pool, over which the group is asked again. A rank whose own quantised pool runs the
    torch path eagerly says so when asked (graphs_refused)."""
    ex, runtime = executor(2)
    load(ex)
    assert ex.graphs_refused() == "" and decide(ex, 2) == REPLAY
    ex.kv_allocated([])
    ex.group_graphs("tensor-parallel rank 1: quantised KV: torch path, eager")
    assert ex.graph_sizes() == []
    with ex.capturing():
        assert decide(ex, 2) == EAGER
    assert ex.describe() == "no graphs (tensor-parallel rank 1: quantised KV: torch path, eager)"
    ex.kv_allocated([])  # a new pool: asked again
    assert ex.graph_sizes() == [2, 1]
    ex.attention.torch_path = "quantised KV"  # type: ignore[misc]
    assert ex.graphs_refused() == "quantised KV: torch path, eager"  # its kernels refused


def test_without_graphs_nothing_is_captured():
    ex, runtime = executor(0)
    assert ex.graph_sizes() == [] and ex.describe() == "no graphs"
    load(ex)
    assert runtime.captured == [] and runtime.pools == []


def test_a_step_whose_drafter_reads_the_hidden_states_replays_a_model_with_an_mtp_head():
    """The MTP drafter asks a step for its hidden states (keep_hidden): a model with a head
    was captured writing them, so the step replays and they are the step's own; a model
    without one runs that step layer by layer."""
    ex, runtime = executor(4)
    model = HiddenModel()
    load(ex, state=True, model=model)
    assert model.last_hidden is None and not model.keep_hidden  # as the load found them
    at_load = runtime.replays
    kept = []
    for seed in (1, 2):
        model.keep_hidden = True
        logits = decode(ex, 3, seed, state=True, model=model)
        kept.append(model.last_hidden)
        want = HiddenModel()
        want.keep_hidden = True
        torch.testing.assert_close(logits, eager(3, seed, state=True, model=want))
        torch.testing.assert_close(model.last_hidden, want.last_hidden)
    assert runtime.replays == at_load + 2
    assert not torch.equal(kept[0], kept[1])  # each a copy: the next replay left it alone
    model.keep_hidden = False
    decode(ex, 2, 3, state=True, model=model)
    assert runtime.replays == at_load + 3
    headless = HiddenModel(mtp=False)
    ex, runtime = executor(4)
    load(ex, model=headless)
    at_load = runtime.replays
    headless.keep_hidden = True
    decode(ex, 2, 4, model=headless)
    assert runtime.replays == at_load and headless.last_hidden is not None  # eagerly


def test_graphs_hold_a_rotary_table_for_the_models_whole_reach_never_grown(
        tiny_checkpoint, tmp_path, monkeypatch):
    """Graphs hold the rotary table's address: prepare sizes it for every position the
    model addresses, rope scaling's reach included (yarn x 4 here, as helexa plan caps the
    context), and a later position past it is refused, naming it, where growing the table
    would leave every replay reading freed memory."""
    import json
    import shutil

    from helexa.neuron.formats.base import open_checkpoint
    from helexa.neuron.formats.loader import load_model

    path = tmp_path / "yarn"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(max_position_embeddings=256, rope_parameters={
        "rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 256})
    (path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("HELEXA_CUDA_FUSED", "0")  # the fused kernels: not this test's
    model = load_model(open_checkpoint(path), device=torch.device("cpu"), dtype="float32")
    executor = CudaGraphExecutor(StandInAttention(2), runtime=StandInRuntime())  # type: ignore[arg-type]
    executor.prepare(model, [], max_num_seqs=2, max_batched_tokens=64, tp_size=1)
    assert model.rotary.length >= 1024
    model.rotary.ensure(1024)  # within: nothing to do
    with pytest.raises(ValueError, match="position 1024 is past the rotary table"):
        model.rotary.ensure(1025)


def test_grouped_int8_layers_prove_their_decode_kernel_at_load(tiny_checkpoint, monkeypatch):
    """prepare runs each grouped int8 layer's product once (helexa/kernels/cuda/int8g.py: the
    Triton kernel's probe and compile happen at load, not in the first request's step), and
    describe says which kernel serves them."""
    from helexa.kernels.backends.executor import LinearSite
    from helexa.kernels.cuda import int8g as int8g_cuda
    from helexa.neuron.formats.base import open_checkpoint
    from helexa.neuron.formats.loader import load_model

    class Measured:
        def __init__(self) -> None:
            self.prepared: list[int] = []

        def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return x

        def prepare(self, max_num_seqs: int) -> None:
            self.prepared.append(max_num_seqs)

    monkeypatch.setenv("HELEXA_CUDA_FUSED", "0")  # the fused kernels: not this test's
    model = load_model(open_checkpoint(tiny_checkpoint("qwen3")), device=torch.device("cpu"),
                       dtype="float32")
    seen: list[torch.device] = []
    monkeypatch.setattr(int8g_cuda, "describe",
                        lambda device: seen.append(device) or "grouped int8 decode: Triton kernel")
    kernels = [Measured(), Measured()]
    plain = torch.nn.Linear(2, 2)
    plain.kernel = None  # type: ignore[assignment]
    sites = [LinearSite(module=plain, quantised=False, tied=False)]  # type: ignore[arg-type]
    for k in kernels:
        mod = torch.nn.Linear(2, 2)
        mod.kernel = k  # type: ignore[assignment]
        sites.append(LinearSite(module=mod, quantised=True, tied=False))  # type: ignore[arg-type]
    ex = CudaGraphExecutor(StandInAttention(2), runtime=StandInRuntime())  # type: ignore[arg-type]
    ex.attention.device = torch.device("cuda", 0)  # the stand-in's card
    ex.prepare(model, sites, max_num_seqs=6, max_batched_tokens=64, tp_size=1)
    assert [k.prepared for k in kernels] == [[6], [6]]
    assert seen == [ex.attention.device]
    assert ex.describe().endswith("rope: torch (HELEXA_CUDA_FUSED=0); "
                                  "grouped int8 decode: Triton kernel")
    # a model with no such layer says nothing of them
    ex = CudaGraphExecutor(StandInAttention(2), runtime=StandInRuntime())  # type: ignore[arg-type]
    ex.prepare(model, sites[:1], max_num_seqs=6, max_batched_tokens=64, tp_size=1)
    assert "grouped int8" not in ex.describe()


def test_every_graph_size_warms_up_on_one_side_stream(monkeypatch) -> None:
    """The real runtime's warm run before each capture goes to a side stream: one for all
    sizes, since cuBLAS keeps a workspace for every stream it ever ran on (a new stream a
    size held one each). Torch's CUDA calls are stood in for: this host has no GPU."""
    from contextlib import nullcontext

    from helexa.kernels.backends.cuda_graphs import GraphRuntime

    made: list[object] = []

    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    class SideStream(Stream):
        def __init__(self, device: torch.device) -> None:
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", SideStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: nullcontext())
    runtime, ran = GraphRuntime(), []
    for b in (4, 3, 2, 1):
        runtime.capture(torch.device("cuda", 0), lambda b=b: ran.append(b), pool=None)
    assert ran == [4, 4, 3, 3, 2, 2, 1, 1]  # a warm run, then the captured one
    assert len(made) == 1


def test_a_wider_batch_drops_the_old_graphs_and_their_pool_then_captures_every_size():
    """A profile with more decode rows, switched with no request running: the graphs of
    the old width go first, with their memory pool and the shared outputs, and the next
    capture (over the new pool) takes every size up to the new width into a fresh pool;
    its widest batch then replays, as eager as it ran. Narrower again: the same."""
    ex, runtime = executor(2)
    load(ex)
    old_out = ex._out
    ex.set_graph_rows(4)
    assert ex._graphs == {} and ex._pool is None and ex._out is None
    assert ex.graph_sizes() == [4, 3, 2, 1] and ex.attention.reference.graph_rows == 4
    got = decode(ex, 2, seed=6)  # a step before the runner captured again: eager
    assert len(runtime.captured) == 2
    torch.testing.assert_close(got, eager(2, 6))
    load(ex)
    assert list(ex._graphs) == [4, 3, 2, 1] and len(runtime.pools) == 2
    assert set(runtime.captured[2:]) == {runtime.pools[1]}  # none into the old pool
    assert ex._out is not None and ex._out is not old_out and ex._out.shape[0] == 4
    at = runtime.replays
    torch.testing.assert_close(decode(ex, 4, seed=7), eager(4, 7))
    assert runtime.replays == at + 1
    ex.set_graph_rows(3)
    load(ex)
    assert list(ex._graphs) == [3, 2, 1] and len(runtime.pools) == 3


def test_without_graphs_a_wider_batch_captures_none():
    ex, runtime = executor(0)
    ex.set_graph_rows(6)
    assert ex.graph_sizes() == [] and ex.attention.graph_rows == 0
    load(ex)
    assert runtime.captured == []
