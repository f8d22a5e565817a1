"""The environment a GPU (NCCL) tensor-parallel group forms with, checked on CPU."""

from __future__ import annotations

from helexa.neuron.engine.tp_rank import nccl_environment


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
