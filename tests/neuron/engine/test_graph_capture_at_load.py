"""The model runner captures its executor's decode graphs at load (and after a new pool),
one b-row decode step per size in the executor's order, dense or hybrid, and never while
serving. The executor is a recording stand-in for the CUDA one (no GPU here)."""

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

    def graph_sizes(self) -> list[int]:
        return [3, 2, 1]

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
