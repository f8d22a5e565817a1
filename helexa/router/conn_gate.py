"""How many client connections the router holds open, and the 503 that answers one too many.

Each open connection is a file descriptor, and the process may hold only
so many (helexa/fd_limit.py). Before this cap a client that opened
connections enough (or kept them alive with a header byte every few
seconds) took every descriptor: accept() then failed for everyone (asyncio
logged `socket.accept() out of system resource` about 1,000 times a second,
11 MB of log in 20 s) and a well-behaved client's request waited unanswered.

`ConnectionGate` counts the connections the router serves. One that
arrives while `server.max_connections` are open (or, when set,
`server.max_connections_per_address` from its address) is answered at once
with a 503 `too_many_connections` naming the cap and its setting, unread,
and closed (`Refusal`): the response, then FIN, then what the client sent
meanwhile is dropped until it closes, for at most LINGER_SECS, so its
request on the way does not turn the close into a reset that would lose the
503. Connections already open are untouched
(docs/http.md, "Connections").
"""

from __future__ import annotations

import asyncio
import json

from helexa.config.router import RouterServerConfig
from helexa.config.schema import ConfigError
from helexa.fd_limit import fd_limit
from helexa.log import get_logger
from helexa.router.errors import ApiError
from helexa.router.metrics import RouterMetrics

# The descriptors kept back from client connections: half the limit, at most this many. An
# eighth of them for refusals lingering; a quarter (at most aiohttp's default of 128) for
# the accept batch: asyncio accepts up to the listen backlog's count of connections before
# any is counted here, and one accept past the limit pauses accepting for a second; the
# rest (320 at most, 48 under a limit of 256) for the router's own files: its neuron links,
# the log, the keys file on reload, its threads' (an idle router over one neuron holds 14).
RESERVE_MAX = 512
# A refused connection's request is read and dropped at most this long, then the socket is
# reset. Time, not bytes: a client that sends its whole body before it reads (an 8 MiB one,
# the default server.max_body_bytes) met a reset, not the 503, under a 64 KiB bound.
LINGER_SECS = 2.0
LOG_EVERY_SECS = 1.0  # one http.connection_refused line at most this often, with a count


def fd_reserve(limit: int) -> int:
    return min(RESERVE_MAX, limit // 2)


def accept_batch(limit: int) -> int:
    """The listen backlog: a burst of connections accepted at once fits the reserve."""
    return max(1, min(128, fd_reserve(limit) // 4))


def default_max_connections(limit: int) -> int:
    return max(1, limit - fd_reserve(limit))


def cap_problem(max_connections: int | None, limit: int) -> str:
    """Why the fd limit cannot hold a configured server.max_connections ("" when it can)."""
    room = default_max_connections(limit)
    if max_connections is None or max_connections <= room:
        return ""
    return (f"server.max_connections = {max_connections} needs {max_connections} + "
            f"{fd_reserve(limit)} (kept for the router's own files) file descriptors, but "
            f"this process may open {limit} (RLIMIT_NOFILE, raised to its hard limit at "
            f"start): set it to at most {limit} - {fd_reserve(limit)} = {room}, or leave it "
            f"unset, or raise the hard limit (ulimit -Hn; systemd LimitNOFILE=)")


class ConnectionGate:
    """The open client connections, by address, and the refusal of one too many."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.log = get_logger("router")
        self.max_connections = 1  # set from the config (RouterState._commit)
        self.per_address: int | None = None
        self.fd_limit = 2 * RESERVE_MAX
        self.open = 0
        self.by_address: dict[str, int] = {}
        self.lingering = 0
        self._unlogged = 0
        self._logged_at = -LOG_EVERY_SECS
        metrics.connections_open.set_function(lambda: self.open)

    def configure(self, server: RouterServerConfig) -> None:
        """Take the caps of a config check_caps passed (a reload leaves open ones open)."""
        self.fd_limit = fd_limit()
        self.max_connections = server.max_connections or default_max_connections(self.fd_limit)
        self.per_address = server.max_connections_per_address

    @property
    def backlog(self) -> int:
        return accept_batch(self.fd_limit)

    def admit(self, address: str) -> str | None:
        """Count a new connection from `address` in, or say why not ("max_connections",
        "per_address")."""
        if self.open >= self.max_connections:
            return "max_connections"
        if self.per_address is not None and self.by_address.get(address, 0) >= self.per_address:
            return "per_address"
        self.open += 1
        self.by_address[address] = self.by_address.get(address, 0) + 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]

    def refuse(self, transport: asyncio.Transport, address: str, reason: str) -> None:
        """Answer the 503 on `transport` without reading its request, and close it."""
        self.metrics.connections_refused.labels(reason).inc()
        if reason == "max_connections":
            message = (f"the router holds its cap of open connections (server.max_connections "
                       f"= {self.max_connections}); this one was closed unread: retry shortly")
        else:
            message = (f"this client address ({address}) holds its cap of open connections "
                       f"(server.max_connections_per_address = {self.per_address}); this one "
                       f"was closed unread: close one or retry shortly")
        err = ApiError(503, message, code="too_many_connections")
        body = json.dumps(err.body()).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {err.headers()['Retry-After']}"
                f"\r\nConnection: close\r\n\r\n").encode()
        # Past as many lingering as an eighth of the reserve, a refusal closes at once.
        linger = self.lingering < fd_reserve(self.fd_limit) // 8
        refusal = Refusal(self, linger)
        transport.set_protocol(refusal)
        refusal.start(transport, head + body)
        self._note(address, reason)

    def _note(self, address: str, reason: str) -> None:
        self._unlogged += 1
        now = asyncio.get_running_loop().time()
        if now - self._logged_at >= LOG_EVERY_SECS:
            self.log.warning("http.connection_refused", reason=reason, address=address,
                             open=self.open, max_connections=self.max_connections,
                             per_address=self.per_address, refused=self._unlogged)
            self._unlogged, self._logged_at = 0, now


class Refusal(asyncio.Protocol):
    """A refused connection: the 503 written, FIN, then what comes is dropped until the
    client closes or LINGER_SECS pass."""

    def __init__(self, gate: ConnectionGate, linger: bool) -> None:
        self.gate = gate
        self.linger = linger
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def start(self, transport: asyncio.Transport, reply: bytes) -> None:
        self.transport = transport
        self.gate.lingering += 1  # until connection_lost, which every end below brings
        try:
            transport.write(reply)
            if self.linger and transport.can_write_eof():
                transport.write_eof()  # ENOTCONN when the client already reset
                self.timer = asyncio.get_running_loop().call_later(LINGER_SECS, transport.abort)
            else:
                transport.close()
        except OSError:
            transport.abort()

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read, only taken off the socket

    def eof_received(self) -> bool:
        if self.transport is not None:
            self.transport.close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.gate.lingering -= 1


def address_of(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"



def check_caps(max_connections: int | None) -> None:
    """Raise ConfigError, with the arithmetic, where the fd limit cannot hold the cap."""
    problem = cap_problem(max_connections, fd_limit())
    if problem:
        raise ConfigError(problem)

