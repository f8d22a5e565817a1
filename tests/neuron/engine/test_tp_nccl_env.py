"""The environment a GPU (NCCL) tensor-parallel group forms with, and its health check's
last resort, checked on CPU."""

from __future__ import annotations

import threading
import time

from helexa.neuron.engine import tp_worker
from helexa.neuron.engine.tp_rank import nccl_environment
from helexa.neuron.engine.tp_worker import TpWorkers


def test_a_gpu_group_has_no_blocking_wait_and_the_watchdog_aborts_without_killing() -> None:
    env = nccl_environment({})
    # Blocking wait would make every collective a host sync plus a >= 1 ms sleep.
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort comms
                   "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                   "TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "0"}


def test_an_operators_own_value_wins_but_blocking_wait_stays_off() -> None:
    # torch reads both blocking-wait names: a host's stale legacy one would turn it on
    env = nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PATH": "/bin",
                            "NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_BLOCKING_WAIT"] == env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert "PATH" not in env  # only NCCL's own variables are set


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive, self.exitcode = alive, None if alive else -9

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        return None

    def kill(self) -> None:
        self.alive = False


def _workers(monkeypatch) -> tuple[TpWorkers, list[int], list[str]]:
    """An NCCL group's handle over a dead rank 2, its abort and process exit stood in."""
    exits: list[int] = []
    aborts: list[str] = []
    monkeypatch.setattr(tp_worker, "_abort_group", lambda: aborts.append("abort"))
    monkeypatch.setattr(tp_worker, "_exit", exits.append)
    workers = TpWorkers([_Proc(True), _Proc(False)], [], None, give_up_secs=0.5)
    workers._nccl = True
    return workers, exits, aborts


def _health(monkeypatch, close_after: float | None) -> tuple[TpWorkers, list[int]]:
    """Run the NCCL health check over a dead rank 2, the runner closed ``close_after``
    seconds later (None: never: a step spins on)."""
    workers, exits, aborts = _workers(monkeypatch)
    if close_after is not None:
        threading.Timer(close_after, workers.close).start()
    workers.watch(nccl=True, interval_secs=0.01)
    assert aborts == ["abort"]
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


def test_the_step_thread_finding_a_dead_rank_first_aborts_and_arms_the_last_resort(
        monkeypatch) -> None:
    """Lookahead sends step N+1 while step N still runs: the step thread's check finds a
    dead rank before the health check's next poll. It must do what the health check would
    (abort the group, so what waits on the rank returns; end the process if the runner is
    not closed in time), not merely stop the health check, which left a step waiting on
    the lost rank for good."""
    import pytest

    workers, exits, aborts = _workers(monkeypatch)
    with pytest.raises(tp_worker.TpError, match="rank 2 died"):
        workers.check()
    assert aborts == ["abort"] and workers._stop_watch.is_set()
    with pytest.raises(tp_worker.TpError):
        workers.check()  # a second call: no second abort or timer
    assert aborts == ["abort"]
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [tp_worker.EXIT_RANK_LOST]  # never closed: the step spun on


def test_a_step_thread_failure_whose_runner_closes_ends_nothing_more(monkeypatch) -> None:
    import pytest

    workers, exits, aborts = _workers(monkeypatch)
    with pytest.raises(tp_worker.TpError):
        workers.check()
    workers.close()  # the engine ended it (EngineGaveUp)
    time.sleep(0.8)
    assert aborts == ["abort"] and exits == []
