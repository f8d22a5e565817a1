"""How much vision-tower work one engine step carries, chosen by measuring the tower.

`engine.vision_step_budget` (patches × tower blocks a step, encoder_steps.py) unset means
"auto": the budget is `engine.vision_step_ms` over the tower's cost per patch-block on
this machine, measured twice over:

- at load, one block of a small dummy image (16 × 16 patches) on the model's device, once
  to warm and twice timed, the faster kept (`measure`): a first figure before any image
  comes, a few ms on a CPU and less on a GPU, so a load pays next to nothing for it;
- then from every step that runs tower work (`observe`, encoder_steps.run): the step's
  tower time over the patch-blocks it ran, into a running mean. This is the figure that
  counts: a block's attention spans its whole image, so a patch-block of a large image
  costs more than one of the dummy (on a 2-core CPU, bench/vision_gaps.py's tower: 32 µs
  at 256 patches, 120 µs at 4,096); the steps measure the images that come, on the
  machine as loaded as it is then (other models, other helpers).

The budget is logged (`engine.vision_budget`) at load and again whenever the running
mean moves it by half or double since it was last logged. An explicit budget overrides
(0 = each image whole, in one step), and the figures are still measured, so a reload back
to auto has them. At tp > 1 nothing is measured at load (the tower's blocks are
collectives over the ranks, which take tower work only with a step's slices): the first
step with tower work runs one block, and the budget follows from its time. vLLM and SGLang bound the encoder's work per step but never split an
image, so this pacing is ours (docs/architecture.md, "An image's tower over steps").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

log = structlog.get_logger(component="engine")
DUMMY_SIDE = 16  # the load's dummy image: 16 × 16 patches (a 448 × 448 image at patch 14)
_ALPHA = 0.5  # the latest step's weight in the running mean: two steps on, the load's is 1/4


def tower_depth(runner: object) -> int:
    """The tower's blocks where steps can split it (a vision model's), else 0."""
    vision = getattr(runner, "vision", None)
    if vision is None or not vision.takes_images:
        return 0
    return int(vision.model.visual.shape.depth)


def sync(device: Any) -> None:
    """Wait for the device's queued work (a CUDA tower's kernels run after they return)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(visual: Any, device: Any, side: int = DUMMY_SIDE,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per patch-block of `visual` (a VisionTower) on `device`: one block over a
    dummy image of side × side patches, the faster of two timed runs after a warm one."""
    patches = torch.zeros(side * side, visual.shape.patch_dim, device=device)
    times = []
    with torch.inference_mode():
        for _ in range(3):
            state = visual.embed(patches, [(1, side, side)])
            sync(device)
            start = clock()
            visual.run_blocks(state, 0, 1)
            sync(device)
            times.append(clock() - start)
    return min(times[1:]) / (side * side)


class VisionPace:
    """The per-step budget of tower work, from the configured target or override and the
    tower's measured cost."""

    def __init__(self, limits: Any, cost: float, logger: Any = None) -> None:
        self.log = logger if logger is not None else log
        self.cost = cost  # seconds per patch-block: the load's figure, then steps' running mean
        self.target_ms, self.override = 0.0, None
        self.logged = 0  # the budget last logged
        self.configure(limits)
        self._log("load")

    def configure(self, limits: Any) -> None:
        """The reloadable fields: `vision_step_ms` and `vision_step_budget`."""
        self.target_ms, self.override = limits.vision_step_ms, limits.vision_step_budget

    @property
    def budget(self) -> int:
        """Patch-blocks a step (0: images whole): the override, else the target over the
        cost (at least 1: a step runs one block of one image at the least anyway; 1 while
        nothing is measured yet)."""
        if self.override is not None:
            return int(self.override)
        if self.cost <= 0:
            return 1
        return max(1, round(self.target_ms / 1000 / self.cost))

    def observe(self, patch_blocks: int, seconds: float) -> None:
        """A step ran `patch_blocks` of tower work in `seconds`: into the running mean."""
        if patch_blocks <= 0 or seconds <= 0:
            return
        cost = seconds / patch_blocks
        self.cost += _ALPHA * (cost - self.cost) if self.cost > 0 else cost
        if self.override is None and not self.logged / 2 < self.budget < self.logged * 2:
            self._log("steps")

    def _log(self, source: str) -> None:
        self.logged = self.budget
        self.log.info("engine.vision_budget", source=source, budget=self.logged,
                      auto=self.override is None, target_ms=self.target_ms,
                      us_per_patch_block=round(self.cost * 1e6, 3))


def load(core: Any, logger: Any = None) -> VisionPace | None:
    """At load: the scheduler's tower depth and, for a vision model, its measured pace and
    budget; None without a tower. At tp > 1 the load measures nothing (the tower's blocks
    are collectives over the ranks, which take work only with a step): the first step
    runs one block, and the budget follows from what it took."""
    depth = tower_depth(core.runner)
    core.scheduler.vision_depth = depth
    if not depth:
        return None
    vision = core.runner.vision
    cost = measure(vision.model.visual, vision.device) if vision.ranks is None else 0.0
    pace = VisionPace(core.limits, cost, logger)
    core.scheduler.vision_budget = pace.budget
    return pace
