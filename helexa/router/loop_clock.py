"""How long the router's own event loop was held: time in which it heard no neuron.

A neuron leaves rotation once its Watch has been silent for
`timeouts.unhealthy_after_secs`, and a call with no clock of its own is ended
once it has been silent for `timeouts.stream_idle_secs` (registry.py). While
the router's loop is held (a burst of work on it, a host short of CPU) it
reads no report, and the reports the neurons sent meanwhile wait in their
sockets; the first request the loop runs after the hold could run before the
Watch readers take them. Counting that time as the neurons' silence made a
request right after a hold of the bound see every neuron out of rotation: a
503 "no neuron is reachable", or, with some of them out, a 400 that `n` or
the prompt could never be served (feasibility.py) though a retry would be.
So a neuron's silence counts only the time the router was listening: the
holds the health loop measured since its last report, and the one the loop
is only now out of (its tick overdue), are taken off.
"""

from __future__ import annotations

import time

HEALTH_TICK_SECS = 0.1
LOOP_STALL_SECS = 0.25  # a health tick this late means the router itself was not running


class LoopClock:
    """The seconds the loop was held in all, from the health loop's ticks."""

    def __init__(self) -> None:
        self.tick_at = time.monotonic()  # the health loop's last tick
        self.held_secs = 0.0  # the holds measured so far, in all

    def tick(self, now: float) -> bool:
        """The health loop's tick at `now`: whether the loop was held since the last one."""
        late, self.tick_at = now - self.tick_at - HEALTH_TICK_SECS, now
        if late > LOOP_STALL_SECS:
            self.held_secs += late
            return True
        return False

    def held(self, now: float) -> float:
        """The seconds held in all by `now`, with the hold the loop is only now out of."""
        late = now - self.tick_at - HEALTH_TICK_SECS
        return self.held_secs + (late if late > LOOP_STALL_SECS else 0.0)
