"""A client's event stream with back-pressure: a client that stops reading pauses its
request, and is ended if it does not read again.

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
nothing would hold its request's KV until the deadline. `ClientStream.write`
waits at most `timeouts.client_write_secs`; past it the connection is aborted
and `ClientStalled` raised, which ends the handler the way a client that left
does: its neuron calls are cancelled (serve.handle's `finally`), which aborts
them on the neuron and returns their KV.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

# The kernel's send buffer of a stream's socket (it reserves twice this, for its own
# bookkeeping): megabytes a second to a client 100 ms away, far over a token stream's
# needs. It stays so for later requests on the connection: the kernel sizes it no more.
SEND_BUFFER_BYTES = 256 * 1024
WHOLE_CHUNK_BYTES = 256 * 1024  # send_whole's writes


class ClientStalled(ConnectionResetError):
    """The client read nothing for client_write_secs; its connection was aborted."""


class ClientStream(web.StreamResponse):
    """A StreamResponse whose writes give up after `write_secs` without progress."""

    def __init__(self, request: web.Request, *, headers: dict[str, str],
                 write_secs: float) -> None:
        super().__init__(headers=headers)
        self.request = request
        self.write_secs = write_secs

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            except OSError:
                pass  # the kernel's sizing, as before
        return await super().prepare(request)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with asyncio.timeout(self.write_secs):
                await super().write(data)
        except TimeoutError:
            self._abort()
            raise ClientStalled(f"the client read nothing for {self.write_secs:g} s "
                                f"(timeouts.client_write_secs)") from None

    async def write_eof(self, data: bytes = b"") -> None:
        try:
            async with asyncio.timeout(self.write_secs):
                await super().write_eof(data)
        except TimeoutError:
            self._abort()
            raise ClientStalled(f"the client read nothing for {self.write_secs:g} s "
                                f"(timeouts.client_write_secs)") from None

    def _abort(self) -> None:
        """Drop the connection and what it still buffers (a close would wait to flush)."""
        self.force_close()
        if (transport := self.request.transport) is not None:
            transport.abort()


async def send_whole(request: web.Request, body: bytes | bytearray, headers: dict[str, str],
                     write_secs: float) -> ClientStream:
    """A non-streaming JSON reply, written WHOLE_CHUNK_BYTES at a time, each write waiting
    for the socket as a stream's do. Handed to aiohttp whole, the body was joined with the
    headers and what the socket did not take at once copied into the transport's buffer:
    the reply held twice more (an 81 MB reply of 16 choices with 20 top logprobs)."""
    resp = ClientStream(request, headers=headers, write_secs=write_secs)
    resp.content_type = "application/json"
    resp.content_length = len(body)
    await resp.prepare(request)
    view = memoryview(body)
    for start in range(0, len(body), WHOLE_CHUNK_BYTES):
        await resp.write(view[start:start + WHOLE_CHUNK_BYTES])
    await resp.write_eof()
    return resp
