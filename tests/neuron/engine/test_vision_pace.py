"""The auto vision budget (engine/vision_pace.py): `engine.vision_step_ms` over the tower's
cost per patch-block, as measured at load on a dummy image and then in the steps, logged
as engine.vision_budget; an explicit budget overrides it, and a reload retargets it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from structlog.testing import capture_logs

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.vision_pace import DUMMY_SIDE, VisionPace, measure


@dataclass
class _Shape:
    patch_dim: int = 6


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Tower:
    """A tower whose block costs `cost` seconds per patch on a fake clock."""

    def __init__(self, cost: float, clock: _Clock) -> None:
        self.shape, self.cost, self.clock, self.blocks_run = _Shape(), cost, clock, 0

    def embed(self, patches: torch.Tensor, grids: list) -> list[int]:
        assert grids == [(1, DUMMY_SIDE, DUMMY_SIDE)]
        return [patches.shape[0]]

    def run_blocks(self, state: list[int], start: int, end: int) -> None:
        self.clock.now += self.cost * state[0] * (end - start)
        self.blocks_run += end - start


def test_the_auto_budget_is_the_target_over_the_measured_cost():
    clock = _Clock()
    for cost in (1e-6, 4e-6, 1e-3):  # seconds per patch-block: a GPU, a slower one, a CPU
        tower = _Tower(cost, clock)
        measured = measure(tower, "cpu", clock=clock)
        assert measured == pytest.approx(cost) and tower.blocks_run == 3  # a warm run, two timed
        with capture_logs() as logs:
            pace = VisionPace(m.Limits(vision_step_ms=20.0), measured)
        assert abs(pace.budget - 0.020 / cost) <= 1  # 20,000; 5,000; 20 patch-blocks
        assert [(e["event"], e["budget"], e["source"]) for e in logs] == \
            [("engine.vision_budget", pace.budget, "load")]


def test_the_steps_move_the_budget_and_a_move_of_double_is_logged():
    pace = VisionPace(m.Limits(vision_step_ms=20.0), 1e-6)  # 20,000 patch-blocks
    with capture_logs() as logs:
        pace.observe(4096 * 2, 4096 * 2 * 2e-6)  # a large image's patch-blocks at 2 µs each
        assert pace.budget == 13333  # the mean halfway there (1.5 µs): not yet half of 20,000
        pace.observe(4096, 4096 * 3e-6)  # 3 µs: the mean at 2.25 µs
        assert pace.budget == 8889  # below half of the 20,000 logged
    assert [(e["event"], e["budget"], e["source"]) for e in logs] == \
        [("engine.vision_budget", 8889, "steps")]


def test_an_explicit_budget_overrides_and_a_reload_retargets():
    pace = VisionPace(m.Limits(vision_step_budget=4096), 1e-5)
    assert pace.budget == 4096
    pace.configure(m.Limits(vision_step_budget=0))
    assert pace.budget == 0  # each image whole
    pace.configure(m.Limits(vision_step_ms=50.0))  # unset again: measured
    assert pace.budget == 5000


def test_unmeasured_one_block_a_step_until_the_first_step_measures():
    """tp > 1: the load measures nothing; the first step's figure is taken whole."""
    pace = VisionPace(m.Limits(vision_step_ms=20.0), 0.0)
    assert pace.budget == 1
    pace.observe(1024, 1024 * 4e-6)
    assert pace.budget == 5000
