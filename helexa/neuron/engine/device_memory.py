"""What the pool's measurement (pool_probe.py) reads of a device's memory, behind one small
interface chosen by device type: the bytes a step allocates at its peak, and the memory
free on the device once the allocator's cached blocks are released.

CUDA's meter reads its caching allocator's statistics and the driver's free memory. A
device without such readings (CPU) has no meter, so its pool is the plan's. Every
tensor-parallel rank builds its own meter for its own device (``device_meter``); a test
hands ModelRunner another factory (its ``memory_meter``, carried to every rank in
RunnerArgs) to drive the probe's real code path on CPU with readings of its choosing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class MemoryMeter(Protocol):
    def peak_bytes(self, step: Callable[[], object]) -> int:
        """Run ``step``; the bytes it allocated above what was allocated before it, at its
        peak."""
        ...

    def free_bytes(self) -> tuple[int, int]:
        """(free, total) bytes of the device, its allocator's cached blocks released first."""
        ...


# (device, tensor-parallel rank) -> its meter, or None where the device cannot be measured
MeterFactory = Callable[[torch.device, int], "MemoryMeter | None"]


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak_bytes(self, step: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)

    def free_bytes(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)  # what the work queued before it allocates, held
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


def device_meter(device: torch.device, tp_rank: int = 0) -> MemoryMeter | None:
    """The device's own meter: CUDA's, else None (nothing to measure: the plan stands)."""
    return CudaMeter(device) if device.type == "cuda" else None
