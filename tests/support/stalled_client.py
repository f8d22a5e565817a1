"""A client that stops reading a stream: a raw socket with a small receive window, so the
router's writes stop draining soon after it stops reading, and a wait for the writes
behind it (the neuron's, the router's reads) to stop."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def post_to_a_small_window(url: str, body: bytes,
                           path: str = "/v1/chat/completions") -> socket.socket:
    """A request (chat's unless `path` says) POSTed to the router at `url` over a raw socket
    with a 4 KiB receive window; the socket, connected, the request sent and nothing read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def until_flat(count: Callable[[], T], within_secs: float = 20.0,
               every_secs: float = 0.3) -> T:
    """count() once it stops changing between two looks `every_secs` apart (the buffers
    full, the writes behind them stopped); fails with the last figure past within_secs."""
    last, end = count(), time.monotonic() + within_secs
    while True:
        time.sleep(every_secs)
        if (now := count()) == last:
            return now
        assert time.monotonic() < end, now
        last = now
