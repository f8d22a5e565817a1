"""The replies that are event streams of their own: Anthropic Messages and OpenAI Responses.

Both front ends answer one choice, as a JSON body (from Complete's whole
reply, built on the router's work pool as chat's is: parsing a whole reply grows
with it, and on the event loop one reply of 88,000 characters held every other
stream for seconds) or as named SSE events (over an open Generate stream), through an
encoder with one interface: `whole(reply)` (the body), `start()` (the opening
events), `feed(msg)` (the events of one neuron message, the closing ones on
the last) and `failed(err)` (the event that ends a stream that failed).
Every failure after the first event, the neuron's or ours, ends the stream
with that event, so a client never sees a stream simply stop. While the
neuron is silent (a long prompt's prefill: minutes on a CPU; the neuron's
first message comes at admission, so the stream is open by then) the stream
sends a keep-alive every PING_SECS (`ping()`: Anthropic's `ping` event, as
Anthropic's API does, or an empty delta of the open block; Responses'
`response.in_progress` again). Each is an event, never an SSE comment,
because agents time out per event: Claude Code drops a stream after 300 s
without one (and counts no `ping`: anthropic_encode.py), codex after its
`stream_idle_timeout`, and both then start the request over (its prefill
too). Chat streams send SSE comments (`with_pings`, serve.py): chat has no
event that clients skip.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
import msgspec
from aiohttp import web

from helexa.proto import neuron_pb2 as pb
from helexa.router import encode
from helexa.router.client_stream import ClientStream, Pace, send_whole
from helexa.router.errors import ApiError
from helexa.router.inflight import UpstreamLost
from helexa.router.rpc_errors import PAST_DEADLINE

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
PING_SECS = 10.0
SSE_PING = b": ping\n\n"  # chat's keep-alive: an SSE comment (its clients know no other)
T = TypeVar("T")


class UpstreamFailed(Exception):
    """A neuron ended the request short after its first message; str() is the client's
    message (ended_short, or the neuron's own words)."""


class Encoder(Protocol):
    def whole(self, reply: pb.GenerateResponse) -> dict[str, Any]: ...
    def start(self) -> bytes: ...
    def feed(self, msg: pb.GenerateResponse) -> bytes: ...
    def failed(self, err: ApiError) -> bytes: ...
    def ping(self) -> bytes: ...


def ended_short(msg: pb.GenerateResponse, deadline_secs: float) -> str | None:
    """Why the neuron ended the request without finishing it (ABORT, ERROR), from its
    `stop_reason`, in the client's words; None for a finish (stop, length) or a message
    before the last. `deadline_secs`: the deadline the router gave it (timeouts.request_secs).
    docs/errors.md, "The table": all of them are upstream_error."""
    if msg.finish_reason == pb.FINISH_REASON_ABORT:
        if msg.stop_reason == "deadline":
            return (f"the request ran past its deadline (timeouts.request_secs = "
                    f"{deadline_secs:g} s) and the neuron ended it")
        if msg.stop_reason == "shutdown":
            return ("the neuron stopped the model before the request finished (its drain "
                    "outlasted server.drain_secs, or the model was unloaded); retry it")
        return "the neuron aborted the request" + (
            f" ({msg.stop_reason})" if msg.stop_reason else "")
    if msg.finish_reason == pb.FINISH_REASON_ERROR:
        return "the neuron failed while generating" + (
            f": {msg.stop_reason}" if msg.stop_reason else "")
    return None


def check_finish(msg: pb.GenerateResponse, deadline_secs: float) -> None:
    if (why := ended_short(msg, deadline_secs)) is not None:
        raise UpstreamFailed(why)


def mid_stream_error(e: grpc.aio.AioRpcError | UpstreamFailed | UpstreamLost) -> ApiError:
    """The event that ends a stream the neuron ended short, failed or was lost under."""
    if isinstance(e, UpstreamFailed):
        return ApiError(502, str(e), code="upstream_error")
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(502, PAST_DEADLINE, code="upstream_error")
    detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
    return ApiError(502, f"the neuron failed mid-stream: {detail}", code="upstream_error")


OffLoop = Callable[[Callable[[], bytes]], Awaitable[bytes]]


async def reply(request: web.Request, stream: bool, choice: encode.Choice, call: Any,
                enc: Encoder, headers: dict[str, str], log: Any, req_id: str,
                off_loop: OffLoop,
                on_message: Callable[[pb.GenerateResponse], None] | None = None,
                pace: Pace = Pace(30.0), deadline_secs: float = 0.0) -> web.StreamResponse:
    """One choice's reply, whole (call is forward.Completed; its body built by off_loop, the
    work pool's run) or as the encoder's event stream (call is forward.OpenStream;
    on_message sees each of its messages: timing), whose client is ended when it takes
    less than `pace` asks (client_stream.py); deadline_secs: ended_short's."""
    if not stream:
        whole = call.reply
        if (why := ended_short(whole, deadline_secs)) is not None:
            raise ApiError(502, why, code="upstream_error")
        body = await off_loop(lambda: _whole_body(choice, enc, whole))
        return await send_whole(request, body, headers, pace)
    resp = ClientStream(request, headers={**SSE_HEADERS, **headers}, pace=pace)
    await resp.prepare(request)
    await resp.write(enc.start())
    try:
        async for msg in with_pings(call.messages(), resp, enc.ping):
            if on_message is not None:
                on_message(msg)
            check_finish(msg, deadline_secs)
            encode.add_delta(choice, msg, streamed=True)
            if out := enc.feed(msg):
                await resp.write(out)
        if choice.finish_reason is None:
            raise UpstreamFailed("the neuron failed mid-stream: it ended the stream without "
                                 "finishing")
    except (grpc.aio.AioRpcError, UpstreamFailed, UpstreamLost) as e:
        err = mid_stream_error(e)
        log.warning("request.upstream_failed", req_id=req_id, detail=err.message)
        await resp.write(enc.failed(err))
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away: serve.handle() logs it
    except Exception:  # a bug of ours after the 200 went out: still end with the event
        log.exception("request.stream_failed", req_id=req_id)
        await resp.write(enc.failed(ApiError(500, "internal error; the router's log has the "
                                                  "details", code="internal_error")))
    await resp.write_eof()
    return resp


def _whole_body(choice: encode.Choice, enc: Encoder, whole: pb.GenerateResponse) -> bytes:
    encode.add_delta(choice, whole)
    return msgspec.json.encode(enc.whole(whole))


async def with_pings(messages: AsyncIterator[T], resp: web.StreamResponse,
                     ping: Callable[[], bytes]) -> AsyncIterator[T]:
    """The messages, writing ping() to the client each PING_SECS none arrives. The read
    runs in a task of its own so that a ping never cancels it halfway. Meanwhile a
    ClientStream's client is looked at as a waiting write's is (ClientStream.check): a
    paused request waits here, not in a write, while its client drains what was written."""
    it, loop = aiter(messages), asyncio.get_running_loop()
    checked = resp if isinstance(resp, ClientStream) else None
    every = checked.look_secs() if checked is not None else PING_SECS
    while True:
        nxt = asyncio.ensure_future(anext(it))
        try:
            ping_at = loop.time() + PING_SECS
            while not (await asyncio.wait({nxt}, timeout=min(every, PING_SECS)))[0]:
                if checked is not None:
                    checked.check()
                if loop.time() >= ping_at:
                    await resp.write(ping())
                    ping_at = loop.time() + PING_SECS
            msg = nxt.result()
        except StopAsyncIteration:
            return
        finally:
            if not nxt.done():
                nxt.cancel()  # the client left (or a write failed) mid-wait
        yield msg
