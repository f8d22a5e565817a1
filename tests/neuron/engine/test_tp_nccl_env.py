"""The environment a GPU (NCCL) tensor-parallel group forms with, and its health check's
last resort, checked on CPU."""

from __future__ import annotations

import threading

from helexa.neuron.engine import tp_worker
from helexa.neuron.engine.tp_rank import nccl_environment
from helexa.neuron.engine.tp_worker import TpWorkers


def test_a_gpu_group_has_no_blocking_wait_and_the_watchdog_aborts_without_killing() -> None:
    env = nccl_environment({})
    # Blocking wait would make every collective a host sync plus a >= 1 ms sleep.
    assert "TORCH_NCCL_BLOCKING_WAIT" not in env
    assert "NCCL_BLOCKING_WAIT" not in env
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort comms
                   "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def test_an_operators_own_value_wins() -> None:
    env = nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PATH": "/bin"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "PATH" not in env  # only NCCL's own variables are set


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive, self.exitcode = alive, None if alive else -9

    def is_alive(self) -> bool:
        return self.alive


def _health(monkeypatch, close_after: float | None) -> tuple[TpWorkers, list[int]]:
    """Run the NCCL health check over a dead rank 2 (its group aborted, stood in), the
    runner closed ``close_after`` seconds later (None: never: a step spins on)."""
    exits: list[int] = []
    monkeypatch.setattr(tp_worker, "_abort_group", lambda: None)
    monkeypatch.setattr(tp_worker, "_exit", exits.append)
    workers = TpWorkers([_Proc(True), _Proc(False)], [], None)
    if close_after is not None:
        threading.Timer(close_after, workers._stop_watch.set).start()
    workers.watch(nccl=True, interval_secs=0.01, grace_secs=0.5)
    return workers, exits


def test_a_dead_rank_whose_step_never_returns_ends_the_engine(monkeypatch) -> None:
    """A kernel spinning on the dead rank's data (FlashInfer's fused all-reduce) never gives
    the step loop back its error: after the grace period the health check ends the engine
    process itself, as the step loop would have (the daemon reports the model failed)."""
    workers, exits = _health(monkeypatch, None)
    assert workers.failed == "tensor-parallel rank 2 died (exit code -9)"
    assert exits == [tp_worker.EXIT_RANK_LOST]


def test_a_dead_rank_whose_step_fails_leaves_ending_to_the_engine(monkeypatch) -> None:
    workers, exits = _health(monkeypatch, 0.05)  # the step raised; the runner was closed
    assert workers.failed and exits == []
