"""Every process that runs a model on a card makes that card its current CUDA device before
anything touches CUDA: the engine process of a tp = 1 model on cuda:1 (nothing else there
would set it), rank 0 of a tensor-parallel model, and a spawned rank r on cuda:r, which
loads its shard, allocates its pool and proves its kernels before it joins the group
(whose join_group sets the device again). FlashInfer's CuTe decode and fused all-reduce
workspace, Triton launches and a pinned buffer's context use the current device; helexa's
own calls name theirs (tests/kernels/test_cuda_device_named.py). Checked on CPU: the first
CUDA allocation fails there, so set_device must have come before it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

import helexa.log as helexa_log
from helexa.neuron.engine import model_runner, tp_rank
from helexa.neuron.engine.runner import load_runners
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.tp_messages import FromRank, RunnerArgs, TpFailed


@pytest.fixture
def current(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """torch.cuda.set_device stood in (CUDA said to be there): the devices made current."""
    made: list[torch.device] = []

    def set_device(device: Any) -> None:
        device = torch.device(device)
        if device.index is None:  # as torch's: "Expected a torch.device with a specified index"
            raise ValueError(f"no index: {device}")
        made.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return made


def test_a_tp1_model_on_cuda1_makes_it_current_before_its_first_cuda_use(
        current: list[torch.device], tiny_model_dir: Path) -> None:
    spec = EngineSpec(model_id="m", model_dir=str(tiny_model_dir), devices=["cuda:1"],
                      num_blocks=8, context=64)
    with pytest.raises((RuntimeError, AssertionError)):  # its first CUDA tensor, on CPU torch
        load_runners(spec, spec.limits)
    assert current == [torch.device("cuda:1")]


def test_rank0_makes_its_own_card_current_before_it_starts_the_other_ranks(
        current: list[torch.device], tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    def start(args: RunnerArgs, world: int) -> Any:
        started.append(list(args.devices))
        raise RuntimeError("stop here")

    monkeypatch.setattr(model_runner.TpWorkers, "start", start)
    spec = EngineSpec(model_id="m", model_dir=str(tiny_model_dir), devices=["cuda:2", "cuda:3"],
                      tp=2, num_blocks=8, context=64)
    with pytest.raises(RuntimeError, match="stop here"):
        load_runners(spec, spec.limits)
    assert current == [torch.device("cuda:2")] and started == [["cuda:2", "cuda:3"]]


class _Pipe:
    """Rank 0's end of the pipe as a spawned rank sees it: what it was sent, and nothing
    to read (rank 0 gone) once it has said how its load went."""

    def __init__(self) -> None:
        self.said: list[Any] = []

    def send_bytes(self, data: bytes) -> None:
        self.said.append(msgspec.msgpack.decode(data, type=FromRank))

    def recv_bytes(self) -> bytes:
        raise EOFError


def test_a_spawned_rank_makes_its_card_current_before_it_loads_its_shard(
        current: list[torch.device], tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of ["cuda:0", "cuda:1"]: cuda:1 is current before its ModelRunner's first
    CUDA use, not only once join_group runs (after the load, the pool and the probes)."""
    monkeypatch.setattr(tp_rank, "_die_with_parent", lambda: None)  # not the test process
    # nor its logging: a rank's JSON lines on stderr would stay configured for later tests
    monkeypatch.setattr(helexa_log, "setup_logging", lambda *a, **kw: None)
    pipe = _Pipe()
    args = RunnerArgs(str(tiny_model_dir), "auto", 8, 16, "auto", 2, 64, ["cuda:0", "cuda:1"])
    tp_rank.worker_main(pipe, args, 1, 2)  # type: ignore[arg-type]
    assert [type(m) for m in pipe.said] == [TpFailed]  # its first CUDA tensor, on CPU torch
    assert current == [torch.device("cuda:1")]
