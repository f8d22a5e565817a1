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
answers 408 when a body stops arriving for as long.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from helexa.router.errors import ApiError

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="router")


class _EnvelopeHandler(RequestHandler):
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
    def __call__(self) -> RequestHandler:
        # Server.__call__ builds RequestHandler(self, loop=..., **kwargs); only the class differs.
        return _EnvelopeHandler(self, loop=self._loop, **self._kwargs)


class RouterRunner(web.AppRunner):
    """An AppRunner whose connections answer malformed HTTP in the OpenAI envelope."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer  # same state, one overridden factory method
        return server


async def read_body(request: web.Request, max_body_bytes: int, read_timeout_secs: float) -> bytes:
    """The whole body, or 413 past max_body_bytes, or 408 when no byte of it came for
    read_timeout_secs (both close the connection: the unread rest cannot be skipped)."""
    if (request.content_length or 0) > max_body_bytes:
        raise ApiError(413, f"request body over {max_body_bytes} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            async with asyncio.timeout(read_timeout_secs):
                chunk = await request.content.readany()
        except TimeoutError:
            raise ApiError(408, f"no byte of the request body came for {read_timeout_secs:g} s",
                           code="request_timeout") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_body_bytes:
            raise ApiError(413, f"request body over {max_body_bytes} bytes",
                           code="request_too_large")
        chunks.append(chunk)


