"""Calls in flight on a neuron, so the router can end them when the neuron stops answering.

Each Generate or Complete call the dispatcher opens is a `Flight` on its
neuron's link. The registry's health loop ends every flight of a neuron that
leaves rotation (its Watch went silent or broke), and a stream that has
brought no message for `timeouts.stream_idle_secs` since its last one: a hung
host (SIGSTOP, a wedged engine) is then an `upstream_error` event on the
stream, or a 503 before the first byte, within moments, instead of silence
until gRPC keepalive gives up (a minute). Ending a flight cancels its gRPC
call; the call's pending read raises CancelledError in the handler task,
which `lost()` tells apart from the handler itself being cancelled (the
client went away) and turns into `UpstreamLost`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class UpstreamLost(Exception):
    """The router ended a call because its neuron stopped answering."""


class Flight:
    """One call on one neuron: its gRPC call, when it last brought a message, why it ended."""

    __slots__ = ("neuron", "call", "streaming", "last_at", "reason", "__weakref__")

    def __init__(self, neuron: str, *, streaming: bool) -> None:
        self.neuron = neuron
        self.call: Any = None  # the grpc.aio call, once made
        self.streaming = streaming
        self.last_at = 0.0  # monotonic time of the last message; 0 = none yet
        self.reason: str | None = None  # set when the router ended the call

    def heard(self) -> None:
        self.last_at = time.monotonic()

    def end(self, reason: str) -> None:
        """End the call (the handler sees UpstreamLost); a no-op once it is over."""
        if self.reason is None and self.call is not None and not self.call.done():
            self.reason = reason
            self.call.cancel()

    def idle_for(self, now: float) -> float:
        """Seconds since the stream's last message (0 before its first: a queued or
        prefilling request is the neuron's to bound)."""
        return now - self.last_at if self.streaming and self.last_at else 0.0

    def lost(self) -> UpstreamLost | None:
        """The UpstreamLost to raise for a CancelledError out of this call, or None when the
        cancellation is the handler's own (the client left) and must propagate."""
        task = asyncio.current_task()
        if self.reason is None or (task is not None and task.cancelling()):
            return None
        return UpstreamLost(self.reason)
