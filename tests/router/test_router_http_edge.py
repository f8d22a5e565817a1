"""Malformed HTTP gets the OpenAI envelope, and half-sent requests are closed after the read
timeout (raw sockets against a router of its own, with a short read timeout)."""

from __future__ import annotations

import json
import re
import socket
import time

import msgspec
import pytest

from helexa.config.schema import RouterConfig
from helexa.router import app as router_app

BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'


@pytest.fixture(scope="module")
def edge(fleet):
    cfg = msgspec.convert({
        "server": {"listen": "127.0.0.1:0", "read_timeout_secs": 0.5},
        "neurons": {"token_file": None, "endpoints": []}}, RouterConfig)
    runner, state, addr = fleet.lt.run(router_app.start(cfg))
    host, port = addr.rsplit(":", 1)
    yield host, int(port)
    fleet.lt.run(router_app.stop(runner, state))


def exchange(addr, raw: bytes, wait_secs: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (a test that hangs here is the bug)."""
    with socket.create_connection(addr, timeout=wait_secs) as s:
        s.sendall(raw)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def envelope(reply: bytes) -> tuple[int, dict, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    return int(lines[0].split()[1]), headers, json.loads(body)["error"]


@pytest.mark.parametrize("raw,what", [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n" + BODY, "Transfer-Encoding"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n"
     b"Content-Length: 2\r\n\r\n{}", "8190"),
    (b"GARBAGE\r\n\r\n", "Malformed"),
])
def test_malformed_http_is_a_400_in_the_envelope(edge, raw, what):
    status, headers, err = envelope(exchange(edge, raw))
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert err["code"] == "invalid_request_error" and what in err["message"]


def test_a_short_content_length_is_a_400_in_the_envelope_and_then_closed(edge):
    reply = exchange(edge, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: 10\r\n\r\n" + BODY)
    replies = re.split(rb"(?=HTTP/1\.[01] )", reply)[1:]
    assert replies, reply
    for r in replies:  # the rest of the body, read as a request, is malformed HTTP too
        status, headers, err = envelope(r)
        assert status == 400 and headers["content-type"].startswith("application/json")


def test_half_sent_headers_are_closed_after_the_read_timeout(edge):
    assert exchange(edge, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") == b""


def test_a_half_sent_body_is_a_408_and_closed(edge):
    reply = exchange(edge, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Length: 100\r\n\r\n" + BODY[:20])
    status, headers, err = envelope(reply)
    assert status == 408 and err["code"] == "request_timeout"


def test_a_body_trickled_a_byte_at_a_time_is_a_408_and_closed(edge):
    """Each byte within the read timeout, none ever idle for it: a slowloris held its
    connection (and handler) until max_body_bytes, weeks at this rate."""
    with socket.create_connection(edge, timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: 100000\r\n\r\n")
        s.settimeout(0.2)
        reply, t0 = b"", time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                s.sendall(b" ")
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break  # closed under our write: the 408 was read before, or is lost
            if not chunk:
                break
            reply += chunk
        took = time.monotonic() - t0
    assert reply, f"no answer in {took:.1f} s"
    status, _, err = envelope(reply)
    assert status == 408 and err["code"] == "request_timeout" and "slower than" in err["message"]
    assert took < 5, took


def test_a_slow_but_steady_body_is_read_whole(edge):
    """A body at 24 KiB/s (a congested mobile uplink's), never idle, 2.5 s long past a 0.5 s
    read timeout: read whole. A floor of 64 KiB/s cut such clients' image bodies with a 408
    after most of the body had come, and their retries the same."""
    body = b" " * (60 * 1024 - len(BODY)) + BODY  # JSON may start with whitespace
    with socket.create_connection(edge, timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        for at in range(0, len(body), 6 * 1024):
            s.sendall(body[at:at + 6 * 1024])
            time.sleep(0.25)
        reply = b""
        while b"\r\n\r\n" not in reply and (chunk := s.recv(65536)):
            reply += chunk
    # read whole and parsed: what a router without neurons answers a good body, not a 408
    assert reply.startswith(b"HTTP/1.1 503"), reply[:300]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/tokenize"])
@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
def test_a_body_that_does_not_decode_is_a_400_and_closed(edge, path, encoding):
    """A Content-Encoding the body does not follow was a 500 internal_error (and a traceback
    in the log): the client's mistake, named as such."""
    reply = exchange(edge, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Encoding: {encoding}\r\n"
                           f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert b"Connection: close" in head
    assert b"could not be read" in body and encoding.encode() in body
