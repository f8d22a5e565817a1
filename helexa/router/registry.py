"""The router's soft state: what each neuron last said on its Watch stream.

One `NeuronLink` per configured endpoint owns a gRPC channel and one task
reading `Watch`; that task alone writes the link's status. A neuron is in
rotation while its stream is connected and it spoke within
`timeouts.unhealthy_after_secs` (the router asks for a heartbeat well inside
that); a broken stream is reopened with exponential backoff up to
`timeouts.reconnect_max_secs`, and the neuron is back as soon as it speaks.

Leaving rotation sends no new work there; it ends none of the calls already
there. A neuron busy for a few seconds (a large request's work on its loop,
a loaded host) goes silent as a hung one does, and ending every call on it
then let one client's request cut every other client's stream (the review's
finding 4: a 2.55 s gap from four 10,000-token completions cut a bystander).
What tells them apart is the channel's keepalive (neuron_channel.py): gRPC's
core answers the router's pings without the neuron's Python, so a busy neuron
answers and a hung host (SIGSTOP, a frozen VM, a pulled cable) does not, and
its connection is closed within `timeouts.keepalive_secs` +
`timeouts.keepalive_timeout_secs` (5 s): every call on it fails UNAVAILABLE
at once (an upstream_error event after tokens, a retry elsewhere before them)
and the Watch call with them, which takes the neuron out of rotation.
`_health_loop` keeps the calls' own bounds behind that: a stream that its
neuron stops feeding is overdue after `timeouts.stream_idle_secs`
(inflight.py), and a call with no clock of its own (a unary Complete, a
stream not yet given a row or waiting for one) is ended once its neuron's
Watch has been silent that long too and it left rotation (a neuron whose
core answers pings but whose engine is wedged; one still sent work is not
hung, nor is a call cut between two beats where that bound is under their
interval).

The registry also remembers the router's own sends that the neuron has not
reported yet (`PendingSend`): selection adds them to the neuron's load and
subtracts their KV, so a burst spreads instead of herding onto whichever
neuron looked idle in the last report.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from helexa.config.schema import ConfigError, NeuronEndpoint, resolve_path
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc as pbg
from helexa.router.inflight import Flight
from helexa.router.loop_clock import HEALTH_TICK_SECS, LoopClock
from helexa.router.neuron_channel import ChannelSettings, channel_options
from helexa.router.selection import DEFAULT_OUTPUT_TOKENS, Candidate

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="router")
PENDING_TTL_SECS = 10.0  # a send the neuron never reports stops counting after this


@dataclass
class PendingSend:
    neuron: str
    model: str
    kv_bytes: int
    sent_at: float = field(default_factory=time.monotonic)
    answered_at: float | None = None  # first byte, refusal or end: the neuron has seen it

    def answered(self, after_secs: float = 0.0) -> None:
        """The neuron has seen this send, or its Watch reports will have `after_secs` from now."""
        at = time.monotonic() + after_secs
        if self.answered_at is None or at < self.answered_at:
            self.answered_at = at


class NeuronLink:
    """One neuron: its channel, its last status and the task that keeps it fresh."""

    def __init__(self, endpoint: NeuronEndpoint, registry: Registry, *,
                 config_file: Path | None = None, channel: ChannelSettings | None = None) -> None:
        """Open the channel (nothing runs until start()); raises ConfigError when a file the
        endpoint names cannot be read. config_file and channel default to the registry's (a
        reload passes the new config's before it is applied)."""
        self.endpoint = endpoint
        self.name = endpoint.name
        self.registry = registry
        self.settings = channel or registry.channel
        options = channel_options(self.settings)
        if endpoint.tls:
            roots = None
            if endpoint.ca_file:
                ca = resolve_path(config_file or registry.config_file, endpoint.ca_file)
                try:
                    roots = ca.read_bytes()
                except OSError as e:
                    raise ConfigError(f"{config_file or registry.config_file}: neurons.endpoints"
                                      f" `{endpoint.name}`.ca_file: cannot read {ca}:"
                                      f" {e.strerror}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=roots)
            self.channel = grpc.aio.secure_channel(endpoint.address, creds, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(endpoint.address, options=options)
        self.stub = pbg.NeuronStub(self.channel)
        self.status: pb.NeuronStatus | None = None
        self.opened_at = time.monotonic()
        self.first_try_done = False  # a first report came, or the first attempt failed
        self.connected = False
        self.last_seen = self.held_at_seen = 0.0  # (the router's loop_clock.held() then)
        self.was_healthy = False
        self.pending: list[PendingSend] = []
        # Per model: the router's calls that ended since the last report, which that report
        # may still count in flight (a conversation's next turn, sent at once, must not see
        # its own finished turn as load and leave the neuron that holds its prefix).
        self.ended: dict[str, int] = {}
        # Calls open on this neuron (weak: a finished request's flight goes with its handler).
        self.flights: weakref.WeakSet[Flight] = weakref.WeakSet()
        self.task: asyncio.Task[None] | None = None
        self.closing = False

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.registry.token
        return (("authorization", f"Bearer {token}"),) if token else ()

    def healthy(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return (self.connected and self.status is not None
                and self.silent_secs(now) <= self.registry.unhealthy_after_secs)

    def silent_secs(self, now: float) -> float:
        """How long its Watch has been silent while the router listened (loop_clock.py)."""
        return now - self.last_seen - (self.registry.loop_clock.held(now) - self.held_at_seen)

    def open_flight(self, *, streaming: bool, model: str = "") -> Flight:
        status = self.model_status(model)
        flight = Flight(self.name, streaming=streaming, prefill_tokens_per_sec=(
            status.prefill_tokens_per_sec if status is not None else 0.0))
        self.flights.add(flight)
        return flight

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._watch_forever())

    async def close(self) -> None:
        self.closing = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await self.channel.close(grace=None)

    async def _watch_forever(self) -> None:
        backoff = 0.1
        # A heartbeat at a third of the silence bound: one lost beat is not an outage.
        heartbeat_ms = max(50, int(self.registry.unhealthy_after_secs * 1000 / 3))
        while True:
            call = self.stub.Watch(pb.WatchRequest(heartbeat_ms=heartbeat_ms),
                                   metadata=self.metadata)
            try:
                while not self.closing:
                    # Silence far past the bound: the stream is dead even if TCP says not.
                    # (asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel.)
                    async with asyncio.timeout(3 * self.registry.unhealthy_after_secs + 1):
                        status = await call.read()
                    if status is grpc.aio.EOF:
                        break
                    self._on_status(status)
                    backoff = 0.1
            except asyncio.CancelledError:
                call.cancel()
                raise
            except (grpc.aio.AioRpcError, TimeoutError) as e:
                self.first_try_done = True
                detail = e.code().name if isinstance(e, grpc.aio.AioRpcError) else "silent"
                if self.connected:
                    log.warning("neuron.watch_lost", neuron=self.name, reason=detail)
            finally:
                call.cancel()
            self.connected = False
            if self.closing:
                return
            self.registry.notify()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.registry.reconnect_max_secs)

    def _on_status(self, status: pb.NeuronStatus) -> None:
        now = time.monotonic()
        self.status = status
        self.first_try_done = True
        self.last_seen, self.held_at_seen = now, self.registry.loop_clock.held(now)
        self.connected = True
        self.ended = {}
        # Sends the neuron had seen before this report are now in its counters.
        self.pending = [p for p in self.pending
                        if (p.answered_at is None or p.answered_at > now)
                        and now - p.sent_at < PENDING_TTL_SECS]
        self.registry.notify()

    def model_status(self, model: str) -> pb.ModelStatus | None:
        if self.status is None:
            return None
        return next((m for m in self.status.models if m.model == model), None)


class Registry:
    """All neuron links, plus a change signal for requests waiting on a load."""

    def __init__(self, endpoints: Iterable[NeuronEndpoint], *, token: str | None,
                 unhealthy_after_secs: float, reconnect_max_secs: float) -> None:
        self.token = token
        self.config_file = Path("router.toml")  # paths in endpoints are relative to it
        self.unhealthy_after_secs = unhealthy_after_secs
        self.reconnect_max_secs = reconnect_max_secs
        self.channel = ChannelSettings(reconnect_max_secs=reconnect_max_secs)
        self.first_report_secs = 5.0
        self.stream_idle_secs = 30.0
        self.links: dict[str, NeuronLink] = {}
        self._endpoints = list(endpoints)
        self._changed = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self.loop_clock = LoopClock()

    async def start(self) -> None:
        await self.set_endpoints(self._endpoints)
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for link in list(self.links.values()):
            await link.close()
        self.links.clear()

    async def set_endpoints(self, endpoints: Iterable[NeuronEndpoint]) -> None:
        """Add, replace or drop links so they match the config; in-flight calls finish."""
        self.swap_links(self.build_links(endpoints))

    def build_links(self, endpoints: Iterable[NeuronEndpoint], *, config_file: Path | None = None,
                    channel: ChannelSettings | None = None) -> dict[str, NeuronLink]:
        """The links for a config, reusing the unchanged ones, without touching the running
        set: a reload builds every new link first (ConfigError when one cannot be built, with
        nothing changed) and swaps only when all succeeded."""
        out: dict[str, NeuronLink] = {}
        settings = channel or self.channel
        try:
            for e in endpoints:
                old = self.links.get(e.name)
                same = old is not None and old.endpoint == e and old.settings == settings
                out[e.name] = old if same and old is not None else NeuronLink(
                    e, self, config_file=config_file, channel=settings)
        except ConfigError:
            for link in out.values():
                if link.task is None:  # built here, never started: close its channel
                    asyncio.get_running_loop().create_task(link.channel.close(grace=None))
            raise
        return out

    def swap_links(self, links: dict[str, NeuronLink]) -> None:
        """Make `links` (from build_links) the running set; links left out close once the
        calls already on them finish."""
        for name, link in list(self.links.items()):
            if links.get(name) is not link:
                asyncio.get_running_loop().create_task(self._close_later(link))
        self.links = dict(links)
        for link in self.links.values():
            if link.task is None:
                link.start()
        self.notify()

    async def _close_later(self, link: NeuronLink, grace_secs: float = 600.0) -> None:
        link.closing = True
        if link.task is not None:
            link.task.cancel()
        await link.channel.close(grace=grace_secs)

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_secs: float) -> None:
        """Return at the next status change, or after timeout_secs."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_secs):
                await self._changed.wait()

    async def _health_loop(self) -> None:
        self.loop_clock.tick_at = time.monotonic()
        while True:
            await asyncio.sleep(HEALTH_TICK_SECS)
            now = time.monotonic()
            if self.loop_clock.tick(now):  # our own loop stalled: Watch reports may wait
                continue  # unread, and a neuron must not lose its calls for our pause
            idle = self.stream_idle_secs
            for link in self.links.values():
                healthy = link.healthy(now)
                if healthy != link.was_healthy:  # in or out of rotation; its calls go on
                    link.was_healthy = healthy
                    log.info("neuron.up" if healthy else "neuron.down", neuron=link.name,
                             open_calls=len(link.flights))
                    self.notify()
                silent = not healthy and link.silent_secs(now) > idle  # out of rotation too
                for f in list(link.flights):
                    why = f.overdue(now, idle)
                    if why is None and silent and not f.clocked():
                        why = (f"neuron {link.name} stopped answering (no Watch report for"
                               f" {idle:g} s)")
                    if why is not None:
                        f.end(why)

    async def wait_first_tries(self) -> None:
        """Return once every link brought its first report or failed its first attempt, or
        each waited `first_report_secs` (a router says it listens only after this)."""
        while any(not link.first_try_done and self._young(link) for link in self.links.values()):
            await self.wait_changed(HEALTH_TICK_SECS)

    def awaiting_first_report(self) -> bool:
        """Some link opened less than `first_report_secs` ago has not reported yet: what it
        will say may change the answer, so a request waits rather than fail now."""
        return any(link.status is None and self._young(link) for link in self.links.values())

    def _young(self, link: NeuronLink) -> bool:
        return time.monotonic() - link.opened_at < self.first_report_secs

    # ------------------------------------------------------------ queries

    def healthy_links(self) -> list[NeuronLink]:
        now = time.monotonic()
        return [link for link in self.links.values() if link.healthy(now)]

    def candidates(self, model: str) -> list[Candidate]:
        """Healthy, non-draining neurons with `model` READY, with the router's unreported sends."""
        out = []
        for link in self.healthy_links():
            if link.status is None or link.status.draining:  # healthy: status is set
                continue
            m = link.model_status(model)
            if m is None or m.state != pb.MODEL_STATE_READY:
                continue
            mine = [p for p in link.pending if p.model == model]
            out.append(Candidate(
                neuron=link.name, kv_free_bytes=m.kv.free_bytes,
                bytes_per_token=m.kv.bytes_per_token, block_size=m.kv.block_size or 16,
                context=m.limits.context,
                in_flight=max(0, m.in_flight - link.ended.get(model, 0)), queued=m.queued,
                pending_sends=len(mine), pending_bytes=sum(p.kv_bytes for p in mine),
                default_output_tokens=m.admission.default_output_tokens or DEFAULT_OUTPUT_TOKENS,
                max_per_principal=m.admission.max_per_principal,
                max_held=(m.admission.max_in_flight + m.admission.max_queue_depth
                          if m.admission.max_in_flight else 0),
                fixed_bytes=m.kv.fixed_bytes_per_request))
        return out

    def note_send(self, neuron: str, model: str, kv_bytes: int) -> PendingSend:
        send = PendingSend(neuron, model, kv_bytes)
        link = self.links.get(neuron)
        if link is not None:
            link.pending.append(send)
        return send

    def note_end(self, send: PendingSend) -> None:
        """The call of `send` ended: it is neither pending nor, whatever the last report said,
        in flight there."""
        link = self.links.get(send.neuron)
        if link is None:
            return
        if send in link.pending:
            link.pending.remove(send)
        if link.last_seen > send.sent_at:  # a report since the send may count it in flight
            link.ended[send.model] = link.ended.get(send.model, 0) + 1

    def models_in_state(self, model: str, *states: int, healthy_only: bool = True) -> list[str]:
        links = self.healthy_links() if healthy_only else list(self.links.values())
        return [link.name for link in links
                if (m := link.model_status(model)) is not None and m.state in states]

    def catalogue_holders(self, model: str) -> list[NeuronLink]:
        return [link for link in self.healthy_links() if link.status is not None
                and not link.status.draining and model in link.status.catalogue]

    def known_models(self) -> set[str]:
        """Every model any neuron (healthy or not) has reported resident or in its catalogue."""
        out: set[str] = set()
        for link in self.links.values():
            if link.status is not None:
                out.update(m.model for m in link.status.models)
                out.update(link.status.catalogue)
        return out
