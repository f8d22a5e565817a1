"""The HTTP server's own edges: malformed HTTP in the OpenAI envelope, and read timeouts.

aiohttp answers what it cannot parse (a Content-Length beside
Transfer-Encoding, a 100 KB header, a bad request line) from
`RequestHandler.handle_error`, before any route or middleware runs, as
plain text. `RouterRunner` serves with a handler class whose
`handle_error` answers in the envelope instead (and logs one line rather
than a traceback: such requests are noise an attacker controls).

A connection must also not be held open by a client that sends half a
request: `server.read_timeout_secs` is aiohttp's keep-alive timeout, which
closes a connection still waiting for (the rest of) a request's headers,
from the moment it opened or its last response ended; and `read_body`
answers 408 when a body stops arriving for as long, or arrives slower than
`MIN_BODY_BYTES_PER_SEC` once that long has passed: a body trickled a byte
at a time (slowloris) held its connection and handler until max_body_bytes,
weeks at a byte a second, and enough such connections take every socket.

A reply must not be held for a client that never reads it either. A stream
ends itself (client_stream.py), and so does a chat or completions answer
(client_stream.send_whole: with `n` and `top_logprobs` it is megabytes); any
other whole reply is written by aiohttp after its handler returned, into the transport's buffer, with no end to the wait: a
client that sent requests and read nothing kept every reply in the router's
memory for as long as it kept its sockets open. `_EnvelopeHandler` watches
each reply's write: when the transport's buffer has not shrunk for
`timeouts.client_write_secs`, the connection is aborted and its buffer freed
(docs/http.md, "Generation requests").

And no client may hold every socket: each connection is counted in by the
router's `ConnectionGate` (conn_gate.py) as it opens, and one over
`server.max_connections` is answered 503 there, unread (docs/http.md,
"Connections").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from helexa.router.conn_gate import ConnectionGate, address_of
from helexa.router.errors import ApiError

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="router")


class _EnvelopeHandler(RequestHandler):
    # timeouts.client_write_secs as now configured (a reload changes it), set by RouterRunner
    write_secs: Callable[[], float] = staticmethod(lambda: 30.0)
    gate: ConnectionGate | None = None
    _address: str | None = None  # set once the gate counted this connection in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.gate is not None:
            address = address_of(transport)
            refused = self.gate.admit(address)
            if refused:  # answered and closed by the gate; this handler never starts
                self.gate.refuse(transport, address, refused)  # type: ignore[arg-type]
                return
            self._address = address
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.gate is not None and self._address is not None:
            self.gate.release(self._address)
            self._address = None
        super().connection_lost(exc)

    async def finish_response(self, request: BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        watch = asyncio.get_running_loop().create_task(self._end_if_stalled(request))
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            watch.cancel()

    async def _end_if_stalled(self, request: BaseRequest) -> None:
        """Abort the connection once its unsent bytes have not shrunk for write_secs (the
        write waiting on them then fails as a client that left)."""
        transport = request.transport
        if transport is None:
            return
        # This first runs once the reply's write waits on the buffer to drain.
        left = transport.get_write_buffer_size()
        while not transport.is_closing():
            secs = self.write_secs()
            await asyncio.sleep(secs)
            now = transport.get_write_buffer_size()
            if now and now >= left:
                log.info("http.client_stalled", unsent_bytes=now, path=request.path,
                         secs=secs)
                transport.abort()
                return
            left = now

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's own: too late for another response
            raise ConnectionError("Response is sent already, cannot send another response")
        if status >= 500:
            log.error("http.handler_failed", error=repr(exc))
            err = ApiError(status, "internal error; the router's log has the details",
                           code="internal_error")
        else:
            log.info("http.malformed", status=status, error=message or repr(exc))
            err = ApiError(status, f"Malformed HTTP request: {message or exc}",
                           code="invalid_request_error")
        resp = err.response()
        resp.force_close()  # the rest of the stream cannot be trusted
        return resp


class _EnvelopeServer(web.Server):
    write_secs: Callable[[], float] = staticmethod(lambda: 30.0)
    gate: ConnectionGate | None = None

    def __call__(self) -> RequestHandler:
        # Server.__call__ builds RequestHandler(self, loop=..., **kwargs); only the class differs.
        handler = _EnvelopeHandler(self, loop=self._loop, **self._kwargs)
        handler.write_secs = self.write_secs
        handler.gate = self.gate
        return handler


class RouterRunner(web.AppRunner):
    """An AppRunner whose connections answer malformed HTTP in the OpenAI envelope, end a
    reply its client does not read for `write_secs`, and are counted in by `gate`."""

    def __init__(self, app: web.Application, *, write_secs: Callable[[], float],
                 gate: ConnectionGate | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.write_secs = write_secs
        self.gate = gate

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # same state, one overridden factory method
        assert isinstance(server, _EnvelopeServer)
        server.write_secs = self.write_secs
        server.gate = self.gate
        return server


# A body must keep up this average once its first read_timeout_secs are over. 8 KiB/s is a
# 64 kbit/s link's, below a congested mobile uplink's: a slow but steady client's multi-MB
# image body gets through (an 8 MiB one, the default server.max_body_bytes, has 17 min),
# while a trickle of a byte a second is refused a few seconds past the first read timeout.
MIN_BODY_BYTES_PER_SEC = 8 * 1024


async def read_body(request: web.Request, max_body_bytes: int, read_timeout_secs: float) -> bytes:
    """The whole body, or 413 past max_body_bytes, or 408 when no byte of it came for
    read_timeout_secs or it came slower than MIN_BODY_BYTES_PER_SEC after that long, or 400
    when it does not decode (a broken gzip or deflate, a bad chunk); each closes the
    connection: the unread rest cannot be skipped."""
    if (request.content_length or 0) > max_body_bytes:
        raise ApiError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        # The body's deadline so far: the grace, then a second per MIN_BODY_BYTES_PER_SEC.
        left = start + read_timeout_secs + size / MIN_BODY_BYTES_PER_SEC - loop.time()
        try:
            async with asyncio.timeout(min(read_timeout_secs, max(left, 0.0))):
                chunk = await request.content.readany()
        except web.RequestPayloadError as e:  # a Content-Encoding or chunk that does not decode
            why = getattr(e.__cause__, "message", None) or str(e)
            raise ApiError(400, f"the request body could not be read: {why}",
                           code="invalid_request_error", close=True) from None
        except TimeoutError:
            if left < read_timeout_secs:
                raise ApiError(408, f"the request body came slower than "
                                    f"{MIN_BODY_BYTES_PER_SEC // 1024} KiB/s ({size} bytes in "
                                    f"{loop.time() - start:.0f} s)",
                               code="request_timeout") from None
            raise ApiError(408, f"no byte of the request body came for {read_timeout_secs:g} s",
                           code="request_timeout") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)
