"""A stand-in for the CUDA calls of graph capture and replay (helexa/kernels/backends/
cuda_graphs.py GraphRuntime), so that the graph executor's bookkeeping runs on CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StandInGraph:
    run: Any


@dataclass
class StandInRuntime:
    """Captures by recording the step; replays by running it again over the static inputs
    (what a CUDA graph does with the tensors it was captured on)."""

    pools: list[object] = field(default_factory=list)
    captured: list[object] = field(default_factory=list)  # each capture's pool
    replays: int = 0

    def pool(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, device: torch.device, run: Any, pool: object) -> StandInGraph:
        run()
        self.captured.append(pool)
        return StandInGraph(run)

    def replay(self, graph: StandInGraph) -> None:
        self.replays += 1
        graph.run()
