"""The gRPC channel options of the router's link to a neuron: reconnect backoff, the per-call
flow-control window, and keepalive pings that tell a hung host from a busy neuron.

A neuron busy for seconds (a large request's work holding its Python, a loaded host) and one
whose host is hung (SIGSTOP, a frozen VM, a pulled cable) both fall silent on Watch and on
their streams. They differ in HTTP/2 PINGs: gRPC's core answers those on its own I/O threads,
without Python's GIL, so a neuron whose Python is held still acks them (measured:
tests/integration/router/test_router_keepalive.py holds a neuron's GIL for 6 s under 1 s pings
with a 1 s timeout, and its stream goes on), while a stopped process, or a host the network no longer reaches, acks
nothing. The router pings each neuron's connection after `timeouts.keepalive_secs` without a
byte from it and gives it `timeouts.keepalive_timeout_secs` to answer; with no answer gRPC
closes the connection and every call on it fails UNAVAILABLE at once: a stream with tokens
ends with an upstream_error event, a call before its first token is retried on another
neuron (dispatch.py), and the Watch call fails too, so the neuron leaves rotation. A hung host
is so found within about keepalive_secs + keepalive_timeout_secs (5 s by default), not at
`timeouts.stream_idle_secs` (measured with a real neuron SIGSTOPped mid-stream: 5.0 s after
the stop, against 70 s with gRPC's defaults and the old 10 s keepalive). The neuron's server
is told to accept pings this often (helexa/neuron/daemon.py, `server_options`): gRPC
documents that a server by default answers pings more often than every 5 minutes, with no
data sent, with GOAWAY too_many_pings, which cuts every call of a busy neuron: with gRPC's
server defaults, the test above (1 s pings) ends its stream "Too many pings". (A 15 s hold
under 2 s pings was not cut so, once; the options are not left to that.)
"""

from __future__ import annotations

from dataclasses import dataclass

from helexa.config.router import TimeoutsConfig

STREAM_WINDOW_BYTES = 64 * 1024  # what a call's unread replies may hold (channel_options)


@dataclass(frozen=True)
class ChannelSettings:
    """What a link's channel is built with (from the config's `timeouts`); a reload that
    changes them rebuilds the links (registry.py, `build_links`)."""

    reconnect_max_secs: float = 5.0
    keepalive_secs: float = 2.0
    keepalive_timeout_secs: float = 3.0

    @classmethod
    def of(cls, timeouts: TimeoutsConfig) -> ChannelSettings:
        return cls(reconnect_max_secs=timeouts.reconnect_max_secs,
                   keepalive_secs=timeouts.keepalive_secs,
                   keepalive_timeout_secs=timeouts.keepalive_timeout_secs)


def channel_options(settings: ChannelSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(settings.reconnect_max_secs * 1000)),
        ("grpc.keepalive_time_ms", int(settings.keepalive_secs * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_secs * 1000)),
        # gRPC 1.85 times a ping's ack by this (default a minute), not by keepalive_timeout_ms:
        # with it unset a SIGSTOPped neuron's stream ended 62 s after the stop (2 s keepalive).
        ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_secs * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # A ping however long the router has sent nothing (a stream's request went out at its
        # start): gRPC documents a limit of two pings without data sent (not seen to bind in
        # grpcio 1.85: a stream caught in 5 s after two pings without it; kept for others).
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        # The window each call grants the neuron stays at STREAM_WINDOW_BYTES: without BDP
        # probing it does not grow with the link, so a stream the router stops reading (its
        # client's socket is full: client_stream.py) fills it and the neuron's writes wait,
        # and the neuron pauses the request (helexa/neuron/engine/flow.py). With probing
        # on (gRPC's default) it grew to megabytes a call, held here. A reply bigger than
        # the window still comes whole (gRPC widens the window for a message being read),
        # and a stream read as it comes moves STREAM_WINDOW_BYTES a round trip (64 MB/s at
        # 1 ms; a token stream with 20 top logprobs needs about 0.3 KB a token).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]
