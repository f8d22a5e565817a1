"""The model runner captures its executor's decode graphs at load (and after a new pool),
one b-row decode step per size in the executor's order, dense or hybrid, and never while
serving; a wider batch (a profile with more rows) tells the executor before its new pool,
then captures every size anew. The executor is a recording stand-in for the CUDA one (no
GPU here)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch

from helexa.kernels import backends
from helexa.kernels.backends.executor import CAPTURE, EAGER, StepExecutor, model_forward
from helexa.neuron.engine import model_runner
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput


class RecordingExecutor(StepExecutor):
    """Records (rows, captured, has state) of each step it runs, and how it was told to
    run it (``graphs``): a capture inside capturing, else eagerly."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, bool, bool]] = []
        self.graphs: list[str | None] = []
        self._capturing = False
        self.rows = 3
        self.widths: list[int] = []  # each set_graph_rows

    def graph_sizes(self) -> list[int]:
        return list(range(self.rows, 0, -1))

    def set_graph_rows(self, rows: int) -> None:
        self.rows = rows
        self.widths.append(rows)

    @contextmanager
    def capturing(self):
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def decide(self, model: torch.nn.Module, meta: Any, logits_rows: torch.Tensor | None,
               images: bool) -> str:
        return CAPTURE if self._capturing else EAGER

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None, state: Any = None,
            graph: str | None = None) -> torch.Tensor:
        self.steps.append((input_ids.shape[0], graph == CAPTURE, state is not None))
        self.graphs.append(graph)
        return model_forward(model, input_ids, positions, meta, logits_rows, state)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingExecutor]:
    made: list[RecordingExecutor] = []
    real = backends.select

    def select(*args: Any, **kw: Any) -> backends.Device:
        device = real(*args, **kw)
        made.append(RecordingExecutor())
        device.executor = made[-1]
        return device

    monkeypatch.setattr(model_runner.backends, "select", select)
    return made


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_graphs_are_captured_at_load_largest_first_and_not_while_serving(
        tiny_checkpoint, recording, arch):
    hybrid = arch == "qwen3_5"
    runner = ModelRunner(tiny_checkpoint(arch), num_blocks=16, block_size=4, max_num_seqs=3,
                         max_batched_tokens=64, num_state_slots=3 if hybrid else 0)
    ex = recording[0]
    assert ex.steps == [(3, True, hybrid), (2, True, hybrid), (1, True, hybrid)]
    runner.execute([SeqInput([1, 2, 3], 0, [1], True, 0)])  # serving: a prefill, then decode
    runner.execute([SeqInput([4], 3, [1], True, 0)])
    assert ex.steps[3:] == [(3, False, hybrid), (1, False, hybrid)]
    runner.reset_kv(16)  # a new pool: its graphs are captured again, before any request
    assert ex.steps[5:] == [(3, True, hybrid), (2, True, hybrid), (1, True, hybrid)]


def test_a_worker_rank_follows_rank_0s_capture_steps_after_a_new_pool(tiny_checkpoint,
                                                                      recording):
    """At tp > 1 a worker rank captures nothing on its own, at load or after a new pool (a
    kv_dtype switch): rank 0's capture steps reach it as steps, each with the collectives
    rank 0 runs. Capturing on its own there would issue collectives no rank joins."""
    from helexa.neuron.engine.tp_rank import reset_kv_following

    worker = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4,
                         max_num_seqs=3, max_batched_tokens=64, tp_rank=1, tp_size=2)
    reset_kv_following(worker, 12, "auto")
    assert worker.num_blocks == 12 and recording[0].steps == []


def test_rank_0s_steps_say_which_are_captures_and_a_worker_runs_them_so(tiny_checkpoint,
                                                                       recording):
    """At tp > 1 rank 0's executor decides how each step runs and the step says so
    (TpStep.graph): its capture steps after a new pool say capture, serving steps say
    eager; a worker rank's runner runs each step as the message says, whatever its own
    executor would decide (here: never a capture of its own)."""
    import msgspec

    from helexa.neuron.engine.tp_messages import TpStep

    leader = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4,
                         max_num_seqs=3, max_batched_tokens=64)
    sent: list[tuple[TpStep, list[SeqInput]]] = []

    class Ranks:  # rank 0's TpWorkers as far as a step goes: the TpStep it sends, decoded
        failed = ""

        def graphs_refused(self) -> str:
            return ""  # every rank's graphs can run over its pool

        def send_step(self, seqs: list[SeqInput], device_tokens: bool = False,
                      graph: str = "") -> None:
            wire = msgspec.msgpack.encode(TpStep([], [], device_tokens, graph))
            sent.append((msgspec.msgpack.decode(wire, type=TpStep), list(seqs)))

    leader._tp = Ranks()  # type: ignore[assignment]
    try:
        leader._capture_graphs()  # as after a new pool
        leader.execute([SeqInput([1, 2, 3], 0, [1], True, 0)])
        leader.execute([SeqInput([4], 3, [1], True, 0)])
    finally:
        leader._tp = None
    assert [m.graph for m, _ in sent] == [CAPTURE] * 3 + [EAGER] * 2
    worker = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4,
                         max_num_seqs=3, max_batched_tokens=64)
    ex = recording[1]
    before = len(ex.graphs)
    for msg, seqs in sent:  # as the rank loop runs them (tp_rank.worker_main)
        worker.execute(seqs, None, msg.graph)
    assert ex.graphs[before:] == [m.graph for m, _ in sent]
    assert not ex._capturing


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_wider_batch_captures_every_size_anew_over_a_new_pool_weights_kept(
        tiny_checkpoint, recording, arch):
    """A profile with more decode rows and a larger step than the load's, its pool
    re-planned with no request running: the executor is told the new width before the
    new pool, the runner captures every size up to it over that pool, and a batch that
    wide then runs; the weights are the ones loaded."""
    hybrid = arch == "qwen3_5"
    runner = ModelRunner(tiny_checkpoint(arch), num_blocks=16, block_size=4, max_num_seqs=3,
                         max_batched_tokens=64, num_state_slots=6 if hybrid else 0)
    ex, weights = recording[0], runner.model.model.embed_tokens.weight
    runner.reset_kv(16, runner.kv_dtype, max_num_seqs=6, max_batched_tokens=128)
    assert ex.widths == [6] and (runner.max_num_seqs, runner.max_batched_tokens) == (6, 128)
    assert ex.steps[3:] == [(b, True, hybrid) for b in (6, 5, 4, 3, 2, 1)]
    assert runner.model.model.embed_tokens.weight is weights
    prompts = [SeqInput([1 + i, 2], 0, [i], True, i) for i in range(6)]
    runner.execute(prompts)
    logits = runner.execute([SeqInput([3], 2, [i], True, i) for i in range(6)])
    assert logits.shape[0] == 6 and ex.steps[-1] == (6, False, hybrid)
    runner.reset_kv(16, runner.kv_dtype, max_num_seqs=6, max_batched_tokens=256)
    assert ex.widths == [6] and runner.max_batched_tokens == 256  # the rows as they were


def test_a_wider_batch_the_device_cannot_hold_keeps_the_old_width_and_pool(
        tiny_checkpoint, recording):
    """Where the pool measured beside the wider step cannot hold one request of the
    context, the re-plan fails saying so, and the runner is as it was: its width, the
    executor's (graphs captured again at it) and its pool."""
    from support.pool_meter import ScriptedMeters

    from helexa.neuron.engine.memory_plan import MARGIN_MIN_BYTES, KvPlanError

    script = ScriptedMeters({0: [2**40, MARGIN_MIN_BYTES]})  # room at load, none after
    runner = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4,
                         max_num_seqs=3, max_batched_tokens=64, memory_meter=script,
                         context=16)
    ex = recording[0]
    with pytest.raises(KvPlanError, match="KV pool does not fit"):
        runner.reset_kv(16, runner.kv_dtype, 16, max_num_seqs=6, max_batched_tokens=128)
    assert ex.widths == [6, 3]
    assert (runner.max_num_seqs, runner.max_batched_tokens, runner.num_blocks) == (3, 64, 16)
    assert ex.steps[-3:] == [(3, True, False), (2, True, False), (1, True, False)]
    assert runner.execute([SeqInput([1, 2], 0, [0], True)]).shape[0] == 1
