"""A client's event stream with back-pressure: a client that stops reading ends its stream.

aiohttp waits for the socket to drain once 64 KiB sit unsent (its writer's
limit, over the transport's 64 KiB high-water mark), so the bytes the router
holds for one stream are bounded by those two and the kernel's send buffer.
While a write waits, the handler stops reading its gRPC call; the neuron's
replies still arrive (the channel's HTTP/2 window grows to take them, and the
engine does not pause a request), so they wait in the channel until the
stream ends (docs/http.md, "Generation requests"). What the wait lacked was an end:
a client that reads nothing kept its request generating (and its KV held)
until the deadline. `ClientStream.write` waits at most
`timeouts.client_write_secs`; past it the connection is aborted and
`ClientStalled` raised, which ends the handler the way a client that left
does: its neuron calls are cancelled (serve.handle's `finally`), which
aborts them on the neuron and returns their KV.
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class ClientStalled(ConnectionResetError):
    """The client read nothing for client_write_secs; its connection was aborted."""


class ClientStream(web.StreamResponse):
    """A StreamResponse whose writes give up after `write_secs` without progress."""

    def __init__(self, request: web.Request, *, headers: dict[str, str],
                 write_secs: float) -> None:
        super().__init__(headers=headers)
        self.request = request
        self.write_secs = write_secs

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
