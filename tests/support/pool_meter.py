"""Scripted memory readings for the pool's measurement (the interface of
helexa/neuron/engine/device_memory.py), so that its real code path runs on CPU, every
tensor-parallel rank included: ModelRunner's ``memory_meter`` carries the script to each
rank (pickled into its RunnerArgs), and each rank reads its own lines of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ScriptedMeters:
    """Per rank, the free bytes each measurement reads, in order (the last repeats);
    every metered step runs as given (its collectives too) and peaks at ``peak``; a rank
    in ``fail_step`` raises its message at its first step instead (out of memory); a rank
    in ``late`` waits that many seconds before its first step (as a rank blocked in a
    collective on NCCL, where a lost peer fails nothing until the group is aborted)."""

    free: dict[int, list[int]]
    total: int = 1000 * 2**20
    peak: int = 2**20
    fail_step: dict[int, str] = field(default_factory=dict)
    late: dict[int, float] = field(default_factory=dict)

    def __call__(self, device: Any, tp_rank: int) -> ScriptedMeter:
        return ScriptedMeter(self, tp_rank)


class ScriptedMeter:
    def __init__(self, script: ScriptedMeters, rank: int) -> None:
        self.script, self.rank, self.reads = script, rank, 0

    def peak_bytes(self, step: Callable[[], object]) -> int:
        if why := self.script.fail_step.get(self.rank):
            raise RuntimeError(why)
        time.sleep(self.script.late.pop(self.rank, 0.0))
        step()
        return self.script.peak

    def free_bytes(self) -> tuple[int, int]:
        frees = self.script.free[self.rank]
        self.reads += 1
        return frees[min(self.reads, len(frees)) - 1], self.script.total


# a grouped int8 decode kind (helexa/kernels/cuda/int8g.py's key past the device)
INT8_KIND = (torch.bfloat16, 32, False)


@dataclass
class RefusingMeters(ScriptedMeters):
    """ScriptedMeters whose ranks in ``refuse`` also find, at load, that their card refuses
    the grouped int8 decode kernel for INT8_KIND (its probe's verdict, with that reason):
    a per-card difference carried to each rank as the script is."""

    refuse: dict[int, str] = field(default_factory=dict)
    # worker ranks whose executor says its graphs cannot run over its pool, and why (as a
    # quantised pool's Triton kernels refused on its card); patched in that rank's process
    no_graphs: dict[int, str] = field(default_factory=dict)

    def __call__(self, device: Any, tp_rank: int) -> ScriptedMeter:
        if why := self.refuse.get(tp_rank):
            from helexa.kernels.cuda import int8g

            int8g._verdicts.record((torch.device(device), *INT8_KIND), why)
        if why := self.no_graphs.get(tp_rank):
            assert tp_rank > 0, "rank 0 is the test's own process"
            from helexa.kernels.backends.executor import StepExecutor

            StepExecutor.graphs_refused = lambda self: why  # type: ignore[method-assign]
        return super().__call__(device, tp_rank)
