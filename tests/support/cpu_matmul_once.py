"""The CPU matmul choice measured once per weight shape in a test process, not at every load.

helexa/kernels/cpu/matmul.py ``install`` times each kind (torch, oneDNN, native) per
distinct weight shape at three row counts whenever a model loads on CPU (~50 ms a shape).
A neuron loads a model once; a test process loads hundreds (every ModelRunner a test
builds), the same few tiny shapes each time: in a profile of five tests/neuron/engine
files, 16.5 s of their 64 s was this timing. ``measure_once_per_shape`` keeps the first
measurement of a shape (at the same row counts, bias or none, relayout allowed or not,
native library or not, torch thread count) for later loads in the process. What a load
measures does not depend on the weight's values (it times random copies of its shape),
and every choice is one ``install`` makes on this machine; within a process two loads of
one shape now take the same kernels, where before timing noise could choose otherwise.
A test that stands in for the timer (``_time_us``) measures afresh."""

from __future__ import annotations

import dataclasses
from typing import Any


def measure_once_per_shape() -> None:
    import torch

    from helexa.kernels.cpu import matmul

    real, timer = matmul.measure, matmul._time_us
    if getattr(real, "once_per_shape", False):
        return
    made: dict[tuple, Any] = {}

    def measure(weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, int, int],
                lib: Any, allow_relayout: bool) -> Any:
        if matmul._time_us is not timer:
            return real(weight, bias, rows, lib, allow_relayout)
        key = (tuple(weight.shape), bias is not None, tuple(rows), lib is not None,
               allow_relayout, torch.get_num_threads())
        if key not in made:
            made[key] = real(weight, bias, rows, lib, allow_relayout)
        first = made[key]
        return dataclasses.replace(first, times_us={k: list(v) for k, v in first.times_us.items()})

    measure.once_per_shape = True  # type: ignore[attr-defined]
    matmul.measure = measure
