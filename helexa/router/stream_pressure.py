"""Whether others wait for what a stream's request holds: the read-rate floor's condition.

A client that reads its stream slower than the model writes it is paced (its request
paused, its KV kept: docs/http.md, "Generation requests"), which costs nobody anything
while nobody waits. The floor (`timeouts.client_min_bytes_per_sec`, client_stream.py)
is asked of it only while someone does: its model on its neuron has requests waiting for
admission (the neuron's Watch report: `queued`, waiting for KV or for a place under
max_in_flight), or the router itself holds requests for its model (waiting for it to
load or finish a profile switch, which waits for the requests in flight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from helexa.router.client_stream import Pace
from helexa.router.registry import Registry


class OnNeuron(Protocol):
    neuron: str  # where the call runs now (a stream lost before its first token moves)


def pressed(registry: Registry, held: Callable[[str], int], model: str,
            calls: Sequence[OnNeuron]) -> bool:
    """True while requests wait for `model` in the router (`held`) or on a neuron of `calls`."""
    if held(model) > 0:
        return True
    for call in calls:
        link = registry.links.get(call.neuron)
        status = link.model_status(model) if link is not None else None
        if status is not None and status.queued > 0:
            return True
    return False


def pace_for(pace: Pace, registry: Registry, held: Callable[[str], int], model: str,
             calls: Sequence[OnNeuron]) -> Pace:
    """`pace` whose floor applies only while `pressed`."""
    return dataclasses.replace(
        pace, pressed=lambda: pressed(registry, held, model, calls))
