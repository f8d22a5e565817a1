"""EngineClient: the daemon's handle on one engine process, for its asyncio loop.

It spawns the engine process (process.py), then talks to it over a pipe
without ever blocking the event loop: the pipe's end here is non-blocking and
the loop itself reads it when it is readable (add_reader) and writes to it,
keeping what the pipe would not take for when it is writable. No thread sits
between loop and pipe: on a virtual machine every thread wake-up is tens of
microseconds on each request's path. Frames are multiprocessing's (a 4-byte
length, or -1 and an 8-byte one), as the engine's Connection reads and writes
them. What the loop wants to send within one iteration (new requests, aborts,
limits) is coalesced into one ToEngine.

The loop alone owns the client's state: the open request streams, the last
status, whether the engine is alive. A request's updates arrive on its own
asyncio.Queue; `generate` yields them until the request finishes or is
refused, and closing it early sends Abort(reason="client_gone"). If the
engine process dies, every open request gets finished=ERROR and on_fatal is
called once. A request whose updates are taken too slowly is paused in the
engine until they are taken (flow.py).
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing.util  # noqa: F401 - its exit hook registered before ours (atexit: LIFO)
import os
import struct
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from helexa.neuron.engine import messages, start_method
from helexa.neuron.engine.flow import Flow, OnFlow
from helexa.neuron.engine.process import engine_main
from helexa.neuron.engine.spec import EngineSpec

OnStatus = Callable[[messages.EngineStatus], None]
OnText = Callable[[str], None]  # a fatal reason, or loading progress

# A healthy engine with work sends at least every 0.5 s (process.py); steps are
# bounded by max_batched_tokens. Much longer silence means it is stuck.
DEFAULT_STALL_SECS = 120.0


class EngineError(RuntimeError):
    """The engine process failed to start, or died."""


class EngineBusy(EngineError):
    """reset_kv found requests in flight (one admitted just before admitting stopped, say):
    wait for them and ask again."""


_live_processes: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _end_engines() -> None:
    """Engine processes are not daemonic (they start their own rank processes), so
    multiprocessing would wait for them at exit; an owner that never called shutdown
    must not hang its interpreter. Registered after multiprocessing's own exit hook,
    so it runs first."""
    for process in list(_live_processes):
        if process.is_alive():
            process.terminate()
    for process in list(_live_processes):
        process.join(2.0)
        if process.is_alive():
            process.kill()


def _is_terminal(upd: messages.RequestUpdate) -> bool:
    return upd.finished is not None or upd.refused_code is not None


class EngineClient:
    def __init__(self, spec: EngineSpec, process: Any, conn: Any, loop: asyncio.AbstractEventLoop,
                 on_status: OnStatus | None, on_fatal: OnText | None,
                 on_progress: OnText | None) -> None:
        self.spec = spec
        self.process = process
        self._conn = conn
        self._loop = loop
        self.on_status, self.on_fatal, self.on_progress = on_status, on_fatal, on_progress
        self.status: messages.EngineStatus | None = None
        self.alive = True
        self.fatal = ""
        self._closing = False
        self._streams: dict[str, asyncio.Queue[messages.RequestUpdate]] = {}
        self.flow = Flow(self._schedule_flush)
        self._pending_new: list[messages.NewRequest] = []
        self._pending_aborts: list[messages.Abort] = []
        self._pending_limits: messages.Limits | None = None
        self._pending_shutdown = False
        self._pending_reset: messages.ResetKv | None = None
        self._reset_done: asyncio.Future[str] | None = None
        self._flush_scheduled = False
        self._stop_admitting = False
        self._pending_refuse_queued = False
        self._refuse_new = False
        self._ready: asyncio.Future[None] = loop.create_future()
        self._last_heard = loop.time()
        self._watchdog: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(messages.FromEngine)
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._inbox = bytearray()  # bytes read but not yet a whole frame
        self._unsent = bytearray()  # bytes the pipe did not take yet
        self._piped = True  # the loop watches the pipe
        loop.add_reader(self._fd, self._on_readable)

    @classmethod
    async def start(cls, spec: EngineSpec, *, on_status: OnStatus | None = None,
                    on_fatal: OnText | None = None, on_progress: OnText | None = None,
                    timeout_secs: float | None = None,
                    stall_secs: float = DEFAULT_STALL_SECS,
                    runner_factory: Callable[[EngineSpec], Any] | None = None) -> EngineClient:
        """Spawn the engine process; return once its model is loaded (EngineError if not).

        With requests open, an engine that sends nothing for `stall_secs` is wedged (a
        hung collective, a stuck device): it is killed and reported like a dead one.
        `runner_factory` (picklable) replaces the model, for runs without one."""
        loop = asyncio.get_running_loop()
        ctx = start_method.context()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        fn, args = start_method.target(ctx, engine_main, (msgspec.msgpack.encode(spec),
                                                          child_conn, runner_factory))
        # Not daemonic: an engine with tp > 1 starts its own rank processes.
        process = ctx.Process(target=fn, args=args, name=f"helexa-engine-{spec.model_id}")
        await loop.run_in_executor(None, process.start)
        _live_processes.add(process)
        child_conn.close()  # so that the child's death reads as EOF here
        client = cls(spec, process, parent_conn, loop, on_status, on_fatal, on_progress)
        try:
            await asyncio.wait_for(asyncio.shield(client._ready), timeout_secs)
        except BaseException:
            await client.shutdown(timeout_secs=2.0)
            raise
        client._watchdog = loop.create_task(client._watch(stall_secs))
        return client

    @property
    def pid(self) -> int | None:
        pid: int | None = self.process.pid
        return pid

    # --- requests ----------------------------------------------------------

    async def generate(self, req: messages.NewRequest, on_flow: OnFlow | None = None
                       ) -> AsyncIterator[messages.RequestUpdate]:
        """Updates of `req` until it finishes or is refused; closing early aborts it. Taken
        too slowly, the request is paused in the engine until they are (flow.py), and
        `on_flow` hears of each pause and resume."""
        if not self.alive or self._closing:
            yield messages.RequestUpdate(req_id=req.req_id, finished=messages.FinishReason.ERROR,
                                         error=self.fatal or "the engine is shut down")
            return
        if req.req_id in self._streams:
            raise ValueError(f"req_id {req.req_id} is already streaming")
        updates: asyncio.Queue[messages.RequestUpdate] = asyncio.Queue()
        if not self._streams:
            self._last_heard = self._loop.time()  # an idle engine says nothing: start the clock
        self._streams[req.req_id] = updates
        self.flow.open(req.req_id, on_flow)
        self._pending_new.append(req)
        self._schedule_flush()
        done = False
        try:
            while True:
                upd = await updates.get()
                self.flow.taken(req.req_id, len(upd.new_token_ids))
                done = _is_terminal(upd)
                yield upd
                if done:
                    return
        finally:
            self._streams.pop(req.req_id, None)
            self.flow.close(req.req_id)
            if not done and self.alive:
                self.abort(req.req_id, "client_gone")

    def abort(self, req_id: str, reason: str = "client_gone") -> None:
        self._pending_aborts.append(messages.Abort(req_id=req_id, reason=reason))
        self._schedule_flush()

    def set_limits(self, limits: messages.Limits) -> None:
        """The whole set of runtime knobs from now on (the latest one sent wins)."""
        self._pending_limits = limits
        self._schedule_flush()

    def stop_admitting(self, flag: bool = True, *, refuse_queued: bool = False) -> None:
        """Stop (or resume) admitting; with `refuse_queued` (a drain) the engine also
        refuses what is queued, and what comes until admission resumes, `shutting_down`, so
        its callers can go elsewhere at once; without it (a profile switch) they are held
        queued."""
        self._stop_admitting = flag
        self._pending_refuse_queued = self._pending_refuse_queued or refuse_queued
        # a level, sent with every message: a resume and a switch's stop that follow a drain
        # before the next flush must not leave the engine refusing (a latch in the engine
        # would, the three being one message); a switch's stop during a drain keeps refusing
        self._refuse_new = flag and (refuse_queued or self._refuse_new)
        self._schedule_flush()

    async def reset_kv(self, *, num_blocks: int, kv_dtype: str, bytes_per_token: int,
                       context: int, max_output_tokens: int | None = None,
                       num_state_slots: int = 0, max_slots: int = 0,
                       max_batched_tokens: int = 0) -> None:
        """Re-plan the engine's KV pool without reloading weights, its runner rebuilt for
        ``max_slots`` decode rows and ``max_batched_tokens`` a step where given (nothing may
        be in flight: stop admitting and wait for in-flight work first). EngineError says
        why not."""
        if not self.alive:
            raise EngineError(self.fatal or "the engine is shut down")
        if self._reset_done is not None:
            raise EngineError("a pool re-plan is already under way")
        self._reset_done = self._loop.create_future()
        self._pending_reset = messages.ResetKv(
            num_blocks=num_blocks, kv_dtype=kv_dtype, bytes_per_token=bytes_per_token,
            context=context, max_output_tokens=max_output_tokens,
            num_state_slots=num_state_slots, max_slots=max_slots,
            max_batched_tokens=max_batched_tokens)
        self._schedule_flush()
        try:
            answer = await self._reset_done
        finally:
            self._reset_done = None
        if answer.startswith(messages.RESET_BUSY):
            raise EngineBusy(answer.removeprefix(messages.RESET_BUSY))
        if answer != "ok":
            raise EngineError(answer)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout_secs: float = 10.0) -> None:
        """Abort everything, let the process exit (killed after timeout_secs)."""
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.alive:
            self._pending_shutdown = True
            self._schedule_flush()
        await self._loop.run_in_executor(None, self.process.join, timeout_secs)
        if self.process.is_alive():
            self.process.kill()
            await self._loop.run_in_executor(None, self.process.join, 5.0)
        self._died("the engine was shut down")

    # --- plumbing ----------------------------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self.alive:
            return
        msg = messages.ToEngine(new=self._pending_new, aborts=self._pending_aborts,
                                limits=self._pending_limits, stop_admitting=self._stop_admitting,
                                shutdown=self._pending_shutdown, reset_kv=self._pending_reset,
                                refuse_queued=self._pending_refuse_queued,
                                refuse_new=self._refuse_new,
                                paused=self.flow.take())
        self._pending_new, self._pending_aborts, self._pending_limits = [], [], None
        self._pending_reset, self._pending_refuse_queued = None, False
        data = self._encoder.encode(msg)
        n = len(data)
        self._send(struct.pack("!i", n) + data if n <= 0x7FFFFFFF
                   else struct.pack("!iQ", -1, n) + data)

    def _send(self, frame: bytes) -> None:
        if self._unsent:  # earlier bytes are still waiting for the pipe: keep the order
            self._unsent += frame
            return
        try:
            sent = os.write(self._fd, frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # the engine's end is gone: reading sees EOF and reports it
        if sent < len(frame):
            self._unsent += frame[sent:]
            self._loop.add_writer(self._fd, self._on_writable)

    def _on_writable(self) -> None:
        try:
            sent = os.write(self._fd, self._unsent)
        except BlockingIOError:
            return
        except OSError:
            sent = len(self._unsent)
        del self._unsent[:sent]
        if not self._unsent:
            self._loop.remove_writer(self._fd)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            code = self.process.exitcode if not self.process.is_alive() else None
            self._died("the engine process exited"
                       + (f" (exit code {code})" if code not in (None, 0) else ""))
            return
        buf = self._inbox
        buf += chunk
        while len(buf) >= 4:
            size, head = struct.unpack_from("!i", buf)[0], 4
            if size == -1:
                if len(buf) < 12:
                    break
                size, head = struct.unpack_from("!Q", buf, 4)[0], 12
            if len(buf) < head + size:
                break
            try:
                msg = self._decoder.decode(buf[head : head + size])
            except msgspec.DecodeError as e:
                self._died(f"undecodable message from the engine: {e}")
                return
            del buf[: head + size]
            self._dispatch(msg)
            if not self._piped:
                return

    def _unwatch(self) -> None:
        if self._piped:
            self._piped = False
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)

    async def _watch(self, stall_secs: float) -> None:
        while self.alive:
            await asyncio.sleep(min(stall_secs / 4, 1.0))
            if self._streams and self._loop.time() - self._last_heard > stall_secs and self.alive:
                self.process.kill()
                self._died(f"the engine sent nothing for {stall_secs:g} s with requests open"
                           " (wedged); it was killed")

    def _dispatch(self, msg: messages.FromEngine) -> None:
        self._last_heard = self._loop.time()
        if msg.progress and self.on_progress is not None:
            self.on_progress(msg.progress)
        if msg.status is not None:
            self.status = msg.status
        if msg.ready and not self._ready.done():
            self._ready.set_result(None)
        for upd in msg.updates:
            stream = self._streams.get(upd.req_id)
            if stream is not None:
                stream.put_nowait(upd)
                self.flow.arrived(upd.req_id, len(upd.new_token_ids), _is_terminal(upd))
        if msg.kv_reset and self._reset_done is not None and not self._reset_done.done():
            self._reset_done.set_result(msg.kv_reset)
        if msg.status is not None and self.on_status is not None:
            self.on_status(msg.status)
        if msg.fatal:
            self._died(msg.fatal)

    def _died(self, reason: str) -> None:
        """The engine is gone: fail open requests, tell the owner (once)."""
        if not self.alive:
            return
        self.alive = False
        self.fatal = reason
        if not self._loop.is_closed():
            self._unwatch()
        for req_id, stream in self._streams.items():
            stream.put_nowait(messages.RequestUpdate(
                req_id=req_id, finished=messages.FinishReason.ERROR, error=reason))
        if self._reset_done is not None and not self._reset_done.done():
            self._reset_done.set_result(reason)
        if not self._ready.done():
            self._ready.set_exception(EngineError(reason))
            self._ready.exception()  # retrieved: start() raises it
        elif not self._closing and self.on_fatal is not None:
            self.on_fatal(reason)
