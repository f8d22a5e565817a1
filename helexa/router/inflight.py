"""Calls in flight on a neuron, so the router can end them when the neuron stops answering.

Each Generate or Complete call the dispatcher opens is a `Flight` on its
neuron's link. A hung host (SIGSTOP, a frozen VM, a pulled cable) answers no
keepalive ping, and gRPC closes its connection within `timeouts.keepalive_secs`
+ `timeouts.keepalive_timeout_secs` (neuron_channel.py): its calls fail
UNAVAILABLE, which is an `upstream_error` event on a stream once a token went
out, a retry on another neuron before that (dispatch.py), or a 503 with none
left. Behind that, for a neuron that answers pings yet sends nothing (a wedged
engine), the registry's health loop ends a stream that is overdue, and a call
with no clock of its own (`clocked`: a unary call, a stream queued or waiting
for a row) once its neuron's Watch has been silent as long and it left
rotation, within
`timeouts.stream_idle_secs`, not at the request's deadline. A neuron that only
leaves rotation (silent past `timeouts.unhealthy_after_secs`, as a neuron busy
for a few seconds is) gets no new work, but its calls go on (registry.py).

Overdue knows about prefill. Once tokens flow, a stream is overdue after
`timeouts.stream_idle_secs` without one while the router waits for it: not
while the router itself is not reading (its client's socket is full, and a
client may read again within `timeouts.client_write_secs`, however long): the
clock counts from the router's ask for the next message (`reading`), and not
at all until it asks.
Before its first token, it is overdue only past a prefill deadline counted
from the message that says its prefill began (`prefill_started`: the
request got a batch row): the idle bound plus PREFILL_MARGIN times the
prompt's tokens (the first message says how many) over the model's measured
prefill rate (from Watch; MIN_PREFILL_TOKENS_PER_SEC when nothing was
measured yet), so a 100k-token prompt is not cut at 30 s and a hung host is
still caught. The first message comes at admission; an admitted request may
then wait for a row (more in flight than `max_slots`) as long as the
requests running take, which no prefill rate predicts: that wait is bounded
by the request's deadline, not here. So is a wait for a row after tokens
flowed: a request paused while its client did not read, resumed with every
row taken (or whose row went back to a request admitted before it), says so
(`waiting_for_row`), and the idle clock stops until its next tokens; the
neuron aborts it at its deadline, a hung host leaves rotation (Watch), and a
wedged engine is killed by its daemon, which fails its requests. Before the
first message the request may be queued: the neuron bounds that wait itself
(`kv_max_wait_secs`). A neuron that never says `prefill_started` (older than
the field) starts the clock with its first token; one that never says
`waiting_for_row` is timed as before it. Ending a flight cancels its gRPC
call; the call's pending read raises CancelledError in the handler task,
which `lost()` tells apart from the handler itself being cancelled (the
client went away) and turns into `UpstreamLost`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class UpstreamLost(Exception):
    """The router ended a call because its neuron stopped answering."""


# A long prompt's prefill is slower per token than the recent rate (attention grows with the
# context): its deadline allows this many times the time the rate predicts.
PREFILL_MARGIN = 4.0
MIN_PREFILL_TOKENS_PER_SEC = 100.0  # a CPU's rate for a small model, when none is measured


class Flight:
    """One call on one neuron: its gRPC call, when it brought its first message and its last
    tokens, why it ended."""

    __slots__ = ("neuron", "call", "streaming", "first_at", "started_at", "last_at",
                 "prompt_tokens", "prefill_tokens_per_sec", "waiting_for_row", "asking",
                 "reason", "on_end", "__weakref__")

    def __init__(self, neuron: str, *, streaming: bool,
                 prefill_tokens_per_sec: float = 0.0) -> None:
        self.neuron = neuron
        self.call: Any = None  # the grpc.aio call, once made
        self.streaming = streaming
        self.first_at = 0.0  # monotonic time of the first message; 0 = none yet
        self.started_at = 0.0  # when its prefill began (prefill_started); 0 = not yet
        self.last_at = 0.0  # monotonic time of the last message with tokens; 0 = none yet
        self.prompt_tokens = 0  # as the first message says
        self.prefill_tokens_per_sec = prefill_tokens_per_sec  # the model's, from Watch
        self.waiting_for_row = False  # the neuron said it waits for a row, no token since
        self.asking = False  # the router asked for the next message and has none yet
        self.reason: str | None = None  # set when the router ended the call
        self.on_end: Callable[[], None] | None = None  # called once, when the reply is whole

    def ended(self) -> None:
        """The neuron sent the reply's end (its finish): the request no longer runs there."""
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    def heard(self, msg: Any = None) -> None:
        """A message arrived (msg: the GenerateResponse; None counts as tokens)."""
        now = time.monotonic()
        self.asking = False
        if not self.first_at:
            self.first_at = now
            self.prompt_tokens = getattr(msg, "prompt_tokens", 0)
        tokens = msg is None or bool(msg.token_ids) or bool(msg.finish_reason)
        if not self.started_at and (tokens or getattr(msg, "prefill_started", False)):
            self.started_at = now
        if tokens:
            self.last_at = now
        waits = bool(getattr(msg, "waiting_for_row", False))
        if tokens or waits:  # the last word on it: a wait for a row, or tokens (none since)
            self.waiting_for_row = waits

    def reading(self, read: bool = True) -> None:
        """The router asks for the next message (`read`: of the call; else it takes one it
        read ahead). It stops asking while its client's socket is full (client_stream.py),
        and the neuron, its window full, then sends nothing: that silence is the client's,
        so once tokens flow the idle bound counts from here, and only while it asks."""
        self.asking = read
        if self.last_at:
            self.last_at = max(self.last_at, time.monotonic())

    def prefill_deadline_secs(self, idle_secs: float) -> float:
        """How long after its prefill began the first token may take."""
        rate = max(self.prefill_tokens_per_sec, MIN_PREFILL_TOKENS_PER_SEC)
        return idle_secs + PREFILL_MARGIN * self.prompt_tokens / rate

    def clocked(self) -> bool:
        """Whether `overdue` times this call by its own messages: a stream whose prefill began
        and that waits for no row. Any other call has only its neuron's Watch to tell a hung
        neuron from a busy one (registry.py)."""
        return self.streaming and bool(self.started_at) and not self.waiting_for_row

    def overdue(self, now: float, idle_secs: float) -> str | None:
        """Why the stream should be ended now, or None while it is in time."""
        if not self.streaming or not self.started_at or self.waiting_for_row:
            return None  # a unary call, or queued or waiting for a row: bounded elsewhere
        if self.last_at:
            if self.asking and now - self.last_at > idle_secs:
                return f"no message from neuron {self.neuron} for {idle_secs:g} s"
            return None
        deadline = self.prefill_deadline_secs(idle_secs)
        if now - self.started_at > deadline:
            return (f"no token from neuron {self.neuron} within {deadline:.0f} s of prefill "
                    f"({self.prompt_tokens} prompt tokens at a measured "
                    f"{self.prefill_tokens_per_sec:.0f} tokens/s)")
        return None

    def end(self, reason: str) -> None:
        """End the call (the handler sees UpstreamLost); a no-op once it is over."""
        if self.reason is None and self.call is not None and not self.call.done():
            self.reason = reason
            self.call.cancel()

    def lost(self) -> UpstreamLost | None:
        """The UpstreamLost to raise for a CancelledError out of this call, or None when the
        cancellation is the handler's own (the client left) and must propagate."""
        task = asyncio.current_task()
        if self.reason is None or (task is not None and task.cancelling()):
            return None
        return UpstreamLost(self.reason)
