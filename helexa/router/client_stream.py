"""A client's event stream with back-pressure: a client that stops reading pauses its
request, and is ended if it does not read again, or reads too little.

aiohttp waits for the socket to drain once 64 KiB sit unsent (its writer's
limit, over the transport's 64 KiB high-water mark), and the stream's socket
keeps at most SEND_BUFFER_BYTES in the kernel (set at `prepare`; the kernel's
own sizing grew it to 4 MiB on loopback, megabytes of tokens made for nobody),
so the bytes held for one stream are bounded by those three. While a write
waits, the handler stops reading its gRPC call; the call's window does not
grow (neuron_channel.channel_options), so the neuron's writes wait in turn and the
neuron pauses the request (helexa/neuron/engine/flow.py): it leaves the decode
batch, keeping its KV, and resumes when the client reads again (docs/http.md,
"Generation requests"). What the wait lacked was an end: a client that reads
nothing would hold its request's KV until the deadline; and a per-write timer
(each write waiting at most client_write_secs) was restarted by a trickle that
let a write finish now and then. So the bound is kept across writes, and
looked at while the stream waits for its paused request too
(event_replies.with_pings, `check`): while requests wait for admission to its
model on its neuron or in the router (`Pace.pressed`, stream_pressure.py), the
client must take something of what waits for it within each window
(`Pace.window_secs`, `timeouts.client_write_secs`) and, behind all the window
(over TAKEN_STEP_BYTES waiting at each mark), `Pace.min_bytes_per_sec`
(`timeouts.client_min_bytes_per_sec`) a second, less one TAKEN_STEP_BYTES
(PaceMeter). A slow reader nobody waits behind is only paced (a client doing
50 ms of work a chunk reads ~3 KB/s, under the default floor, and was cut with
no other load), and ended only for taking nothing for `Pace.idle_secs`
(`timeouts.client_idle_secs`): its TCP may show a steady 3 KB/s as nothing for
over 30 s (TAKEN_STEP_BYTES), and such a reader was cut. A client that falls short
has the write waiting on it (or the wait for its request's next message)
cancelled, its connection aborted and `ClientStalled` raised, which ends the
handler the way a client that left does: its neuron calls are cancelled (serve.handle's `finally`), which aborts
them on the neuron and returns their KV. What the client took is what left the
router: the bytes written, less those the transport and the kernel still hold
(SIOCOUTQ: unsent or unacknowledged). The transport's buffer alone moves only
when the kernel's has a third of itself free again (Linux's rule for a TCP
socket to be writable: about 170 KB of SEND_BUFFER_BYTES' 512 KiB), so it
would see a steady reader of a few KB/s take nothing for half a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import socket
import struct
import termios
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

# The kernel's send buffer of a stream's socket (it reserves twice this, for its own
# bookkeeping): megabytes a second to a client 100 ms away, far over a token stream's
# needs. It stays so for later requests on the connection: the kernel sizes it no more.
SEND_BUFFER_BYTES = 256 * 1024
WHOLE_CHUNK_BYTES = 256 * 1024  # send_whole's writes
# How often a write that waits looks at what its client took (at most, a window's eighth),
# and how many marks of it a window keeps at most (its rate is measured between them).
LOOK_SECS = 1.0
MARKS_A_WINDOW = 32
# What a steady reader has taken shows in steps: its kernel reopens its receive window, and
# so acknowledges more, only once a segment's worth is free (loopback: 66,560-byte steps for
# a reader of 3.4 KB/s, tcpi_bytes_acked moving with them), so a window may see one step less
# than it read. The floor is asked less one such step.
TAKEN_STEP_BYTES = 64 * 1024
_OUTQ = getattr(termios, "TIOCOUTQ", 0x5411)  # Linux's SIOCOUTQ for a TCP socket


@dataclass(frozen=True)
class Pace:
    """What a client behind its stream must take: something over each window_secs, and
    min_bytes_per_sec while `pressed()` says others wait for what its request holds (None:
    always; stream_pressure.py)."""

    window_secs: float
    min_bytes_per_sec: float = 0.0
    pressed: Callable[[], bool] | None = None
    idle_secs: float | None = None  # how long taking nothing ends it unpressed (None: a window)

    def waited_for(self) -> bool:
        return self.pressed is None or self.pressed()

    def floor_applies(self) -> bool:
        return self.min_bytes_per_sec > 0 and self.waited_for()

    def nothing_secs(self) -> float:
        """How long a client behind may take nothing: a window while others wait for what
        its request holds (`pressed`), else idle_secs (a slow reader's TCP may show nothing
        for longer than a window: module docstring)."""
        if self.idle_secs is None or self.waited_for():
            return self.window_secs
        return max(self.window_secs, self.idle_secs)


class ClientStalled(ConnectionResetError):
    """The client took too little of its reply for a window; its connection was aborted."""


def _kernel_held(sock: socket.socket | None) -> int:
    """Bytes the kernel holds for the socket, unsent or unacknowledged; 0 where unknown."""
    if sock is None:
        return 0
    try:
        held: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0" * 4))[0]
        return held
    except (OSError, ValueError):
        return 0


class PaceMeter:
    """A stream's client's taking over the last window, against its Pace."""

    def __init__(self, pace: Pace) -> None:
        self.pace = pace
        # (loop time, bytes the client had taken, bytes waiting for it) over the last window
        self.marks: deque[tuple[float, int, int]] = deque()
        # (since when, what it had taken then): the client has taken nothing since, something
        # waiting for it at each mark
        self.still: tuple[float, int] | None = None

    def look(self, now: float, taken: int, waiting: int) -> str | None:
        """Mark `taken` (all the client took so far) and `waiting` at `now`; why the client is
        to be ended: it took nothing of what waited for it for Pace.nothing_secs (a window
        while others wait, else timeouts.client_idle_secs); or, behind all the last window
        (over TAKEN_STEP_BYTES waiting at each mark) and the floor applying
        (Pace.floor_applies), less than the floor asks, less one TAKEN_STEP_BYTES (a steady
        reader's taking shows in such steps)."""
        marks, window = self.marks, self.pace.window_secs
        if marks and now - marks[-1][0] < window / MARKS_A_WINDOW:
            return None
        if waiting == 0:
            self.still = None  # caught up: not behind
        elif self.still is None or taken != self.still[1]:
            self.still = (now, taken)  # behind, from here
        marks.append((now, taken, waiting))
        while len(marks) > 1 and marks[1][0] <= now - window:
            marks.popleft()  # the last mark a window old stays: the rate is measured from it
        if self.still is not None and (idle := now - self.still[0]) >= window:
            if idle >= (bound := self.pace.nothing_secs()):
                knob = ("client_write_secs" if bound <= window
                        else "client_idle_secs, nobody waiting behind it")
                return f"the client read nothing for {idle:.0f} s (timeouts.{knob})"
        since, then, _ = marks[0]
        got = taken - then
        if now - since < window or got == 0:
            return None
        # A client that caught up in the window (a step or less waited for it at a mark) is
        # not behind: it takes what the model makes as it comes, however little that is.
        if min(m[2] for m in marks) <= TAKEN_STEP_BYTES or not self.pace.floor_applies():
            return None
        floor = self.pace.min_bytes_per_sec * window
        if got + TAKEN_STEP_BYTES >= floor:
            return None
        return (f"the client read {got} bytes in {now - since:.0f} s, under {floor:.0f} "
                f"(less a {TAKEN_STEP_BYTES}-byte step) while requests waited for admission "
                "(timeouts.client_min_bytes_per_sec over timeouts.client_write_secs)")


class ClientStream(web.StreamResponse):
    """A StreamResponse whose writes end the connection when its client, behind, takes
    less than `pace` asks (nothing at all for a window, when min_bytes_per_sec is 0)."""

    def __init__(self, request: web.Request, *, headers: dict[str, str], pace: Pace) -> None:
        super().__init__(headers=headers)
        self.request = request
        self.pace = pace
        self._sock: socket.socket | None = None
        self._meter = PaceMeter(pace)
        self._why: str | None = None  # why the connection was aborted
        self._timer: asyncio.TimerHandle | None = None

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._sock = sock
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass  # the kernel's sizing, as before
        return await super().prepare(request)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self._watched(super().write, data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self._watched(super().write_eof, data)

    async def _watched(self, write: Callable[[bytes], Awaitable[None]], data: Any) -> None:
        """`write(data)`, looked after while it waits as asyncio.timeout would, its deadline
        moved on while the client takes enough: cancelled, its connection aborted and
        ClientStalled raised when the client takes too little. (An abort alone would not do:
        the lost connection cancels the handler, aiohttp's handler_cancellation.)"""
        self.check()
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._timer = asyncio.get_running_loop().call_later(self.look_secs(), self._tick, task)
        try:
            await write(data)
        except asyncio.CancelledError:
            if self._why is None or task.uncancel() > cancelling:
                raise  # not ours, or not only ours
            self._stall(self._why)
        finally:
            self._timer.cancel()

    def look_secs(self) -> float:
        return min(LOOK_SECS, self.pace.window_secs / 8)

    def check(self) -> None:
        """What a waiting write does: ClientStalled, the connection aborted, where the
        client took too little (`_look`)."""
        if (why := self._look()) is not None:
            self._stall(why)

    def _tick(self, task: asyncio.Task[Any]) -> None:
        if (why := self._look()) is None:
            self._timer = asyncio.get_running_loop().call_later(self.look_secs(), self._tick,
                                                                task)
        elif self._why is None:
            self._why = why
            task.cancel()

    def _look(self) -> str | None:
        """Mark what the client has taken and what waits for it; why it is to be ended
        (PaceMeter.look), if it is."""
        transport, writer = self.request.transport, self._payload_writer
        if transport is None or writer is None:
            return None
        held = transport.get_write_buffer_size() + _kernel_held(self._sock)
        return self._meter.look(asyncio.get_running_loop().time(), writer.output_size - held,
                                held)

    def _stall(self, why: str) -> NoReturn:
        self._why = why
        self._abort()
        raise ClientStalled(why)

    def _abort(self) -> None:
        """Drop the connection and what it still buffers (a close would wait to flush)."""
        self.force_close()
        if (transport := self.request.transport) is not None:
            transport.abort()


async def send_whole(request: web.Request, body: bytes | bytearray, headers: dict[str, str],
                     pace: Pace) -> ClientStream:
    """A non-streaming JSON reply, written WHOLE_CHUNK_BYTES at a time, each write waiting
    for the socket as a stream's do (and its client held to the same pace). Handed to
    aiohttp whole, the body was joined with the headers and what the socket did not take
    at once copied into the transport's buffer: the reply held twice more (an 81 MB reply
    of 16 choices with 20 top logprobs). Its request has ended, its KV back: what it holds is
    the router's memory, so the floor applies whether or not requests wait."""
    resp = ClientStream(request, headers=headers, pace=dataclasses.replace(pace, pressed=None))
    resp.content_type = "application/json"
    resp.content_length = len(body)
    await resp.prepare(request)
    view = memoryview(body)
    for start in range(0, len(body), WHOLE_CHUNK_BYTES):
        await resp.write(view[start:start + WHOLE_CHUNK_BYTES])
    await resp.write_eof()
    return resp
