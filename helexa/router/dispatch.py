"""From a GenerateRequest to a neuron's answer: selection, on-demand load, one retry.

This is where policy (selection.rank) meets the registry's soft state and the
gRPC edge. A request whose model is not READY anywhere waits (up to
`timeouts.load_wait_secs`, or its own deadline where that comes first) for a
load it may cause itself, if its principal is in `auth.load_principals`, or
for a profile switch to end; a refusal before the first byte
(UNAVAILABLE, RESOURCE_EXHAUSTED, NOT_FOUND: rpc_errors.RETRYABLE) is retried
once on the next neuron in the preference order.

A streaming request gets an open Generate stream (its first message in
hand: the neuron sends it at admission, and the client's stream opens on
it). The same one retry covers a stream whose neuron is lost after that but
before its first token (its call broke with a RETRYABLE status, or the
router ended it: out of rotation, or silent past the prefill bound), when
its opening was its first neuron's (no refusal used the retry): the stream
goes on over a call on the next neuron in the preference order, the lost one
left out, within the request's deadline (`_resume`, driven by
forward.OpenStream). Once a token went out, or when the engine failed
(INTERNAL), the client gets the `upstream_error` event. A non-streaming
request gets Complete's whole reply. For the latter every
error comes before the first byte to the client, so the same rule covers
the whole call: a refusal with a retryable status is retried once, and so
is a neuron that dies mid-generation (its call ends UNAVAILABLE), which is
invisible to the client; when no other neuron is left the client sees the
status mapped as a refusal would be (503 service_unavailable for a dead
neuron). Other failures during generation (INTERNAL, UNKNOWN: the engine or
the daemon failed) are not retried: 502 upstream_error, as for a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from helexa.proto import neuron_pb2 as pb
from helexa.router.auth import may_load
from helexa.router.errors import ApiError
from helexa.router.forward import (
    Completed,
    OpenStream,
    UpstreamClosed,
    complete,
    err_detail,
    open_generate,
)
from helexa.router.inflight import UpstreamLost
from helexa.router.metrics import RouterMetrics
from helexa.router.registry import NeuronLink, Registry
from helexa.router.rpc_errors import DEADLINE_MARGIN_SECS, RETRYABLE, map_rpc_error, withheld
from helexa.router.selection import (
    Candidate,
    Estimate,
    rank,
    rendezvous_score,
    reservation_bytes,
)

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="router")
LOAD_RETRY_AFTER_SECS = 5
# A model that failed to load stays failed until the neuron's backoff or an operator retries it.
FAILED_RETRY_AFTER_SECS = 30
# A unary call's send stays pending (counted by selection on top of Watch) this long: two Watch
# periods (at most 20 reports a second), by when the neuron's report includes the request.
UNARY_SEEN_SECS = 0.1
_WAITING = (pb.MODEL_STATE_LOADING, pb.MODEL_STATE_SWITCHING)


class Held:
    """One request counted in `helexa_router_held_requests` from its first wait here for its
    model (a load, a profile switch: no neuron's queue sees it) until it stops waiting."""

    def __init__(self, metrics: RouterMetrics, counts: dict[str, int]) -> None:
        self.metrics = metrics
        self.counts = counts  # Dispatcher.held: model -> requests held (stream_pressure.py)
        self.child: Any = None
        self.model = ""

    def start(self, model: str) -> None:
        if self.child is None:
            self.child, self.model = self.metrics.held.labels(model), model
            self.child.inc()
            self.counts[model] = self.counts.get(model, 0) + 1

    def end(self) -> None:
        if self.child is not None:
            self.child.dec()
            self.child = None
            self.counts[self.model] -= 1


class ModelFailed(RuntimeError):
    """The neuron answered a Load with the model FAILED; the message says why."""


def model_failed(model: str, reason: str) -> ApiError:
    return ApiError(503, f"`{model}` failed to load: {reason}", code="model_failed",
                    retry_after_secs=FAILED_RETRY_AFTER_SECS)


@dataclass
class DispatchSettings:
    load_principals: list[str]
    load_wait_secs: float
    request_secs: float


class Dispatcher:
    """Sends the request handlers' calls to neurons."""

    def __init__(self, registry: Registry, metrics: RouterMetrics,
                 settings: DispatchSettings) -> None:
        self.registry = registry
        self.metrics = metrics
        self.settings = settings
        self._loads: dict[str, asyncio.Task[None]] = {}  # model -> the one Load call this router made
        self.held: dict[str, int] = {}  # model -> requests waiting here for it to be ready

    async def open(self, greq: pb.GenerateRequest, est: Estimate, key: bytes, *,
                   principal: str, kind: str, stream: bool = True) -> OpenStream | Completed:
        """An open Generate stream for greq (`stream`) or its Complete reply, or the ApiError
        the client should see."""
        rpc = open_generate if stream else complete
        model = greq.model
        wait = self._wait_bound(greq)
        tried: set[str] = set()
        refusal: ApiError | None = None
        held = Held(self.metrics, self.held)
        try:
            while True:
                candidates = [c for c in self.registry.candidates(model)
                              if c.neuron not in tried]
                if not candidates:
                    if refusal is not None:
                        raise refusal  # nobody else to try: the client sees the neuron's answer
                    await self._await_model(model, principal, wait, held)
                    continue
                held.end()  # it waited no longer: sent on now
                name = rank(candidates, est, key)[0]
                cand = next(c for c in candidates if c.neuron == name)
                try:
                    result = await self._call(rpc, greq, est, cand, stream)
                except (UpstreamLost, grpc.aio.AioRpcError) as e:
                    retry = refusal is None and (not isinstance(e, grpc.aio.AioRpcError)
                                                 or e.code() in RETRYABLE)
                    err = self._refused(greq, name, e, kind, retry=retry)
                    if not retry:
                        raise err from None
                    refusal = err
                    tried.add(name)
                    continue
                except UpstreamClosed as e:
                    raise ApiError(502, str(e), code="upstream_error") from None
                if isinstance(result, OpenStream):  # a loss before its first token: _resume
                    result.resume = functools.partial(self._resume, greq, est, key, kind,
                                                      set(tried | {name}))
                    result.resumed = refusal is not None  # a refusal used its one retry
                return result
        finally:  # refused, or its client gone (cancelled) while it waited
            held.end()

    async def _call(self, rpc: Any, greq: pb.GenerateRequest, est: Estimate, cand: Candidate,
                    stream: bool) -> OpenStream | Completed:
        """One call on cand's neuron, counted where selection will see it."""
        name, model = cand.neuron, greq.model
        link = self.registry.links[name]
        send = self.registry.note_send(name, model, reservation_bytes(cand, est))
        if not stream:  # no first byte will say the neuron has it: its Watch will
            send.answered(after_secs=UNARY_SEEN_SECS)
        self.metrics.selections.labels(name, model).inc()
        flight = link.open_flight(streaming=stream, model=model)
        flight.on_end = functools.partial(self.registry.note_end, send)
        try:
            result: OpenStream | Completed = await rpc(
                link.stub, name, greq, metadata=link.metadata,
                timeout_secs=self._timeout_secs(greq), flight=flight)
            if not stream:  # a unary call returns its whole reply
                flight.ended()
            return result
        finally:
            send.answered()

    def _left_secs(self, greq: pb.GenerateRequest) -> float:
        """The seconds left of the request's deadline (request_secs where it names none)."""
        if not greq.deadline_unix_ms:
            return self.settings.request_secs
        return greq.deadline_unix_ms / 1000 - time.time()

    def _wait_bound(self, greq: pb.GenerateRequest) -> tuple[float, str]:
        """Until when (monotonic) a request may wait for its model to be ready (a load, a
        profile switch), and what bounds it: timeouts.load_wait_secs, or the request's own
        deadline where that comes first (sent later, the neuron would abort it at once)."""
        load_wait, left = self.settings.load_wait_secs, self._left_secs(greq)
        if left < load_wait:
            why = f"its deadline (timeouts.request_secs = {self.settings.request_secs:g} s)"
            return time.monotonic() + max(0.0, left), why
        return time.monotonic() + load_wait, f"timeouts.load_wait_secs ({load_wait:g} s)"

    def _timeout_secs(self, greq: pb.GenerateRequest) -> float:
        """The gRPC deadline of a call: the request's own (the neuron aborts it then) and a
        margin for its abort to arrive."""
        return max(0.0, self._left_secs(greq)) + DEADLINE_MARGIN_SECS

    def _refused(self, greq: pb.GenerateRequest, name: str, e: Exception, kind: str, *,
                 retry: bool | None) -> ApiError:
        """The client's error for a neuron's refusal or loss, counted, and logged as a
        refusal unless `retry` is None."""
        detail = None
        if isinstance(e, grpc.aio.AioRpcError):
            err, grpc_code = map_rpc_error(e, kind), e.code().name
            detail = withheld(e, err)
        else:  # the router ended the call: the neuron stopped answering
            err, grpc_code = ApiError(503, str(e), code="service_unavailable"), None
        self.metrics.refusals.labels(name, greq.model, err.code).inc()
        if retry is not None:
            log.info("request.refused", req_id=greq.req_id, neuron=name, model=greq.model,
                     grpc=grpc_code, code=err.code, reason=err.message, retry=retry,
                     detail=detail)
        return err

    async def _resume(self, greq: pb.GenerateRequest, est: Estimate, key: bytes, kind: str,
                      tried: set[str], lost: OpenStream, e: Exception,
                      retry_left: bool) -> OpenStream:
        """A neuron lost before its stream's first token (forward.OpenStream), counted and
        logged; the stream opened on the next neuron in the preference order within the
        request's deadline, where its one retry is left (`retry_left`: no refusal used it at
        the open, no loss before); else UpstreamLost saying why not."""
        model, reason = greq.model, err_detail(e)
        tried.add(lost.neuron)
        err = self._refused(greq, lost.neuron, e, kind, retry=None)
        left_secs = self._left_secs(greq)
        candidates = [c for c in self.registry.candidates(model) if c.neuron not in tried]
        order = rank(candidates, est, key) if left_secs > 0 and retry_left else []
        log.info("request.neuron_lost", req_id=greq.req_id, neuron=lost.neuron, model=model,
                 code=err.code, reason=reason, retry_on=order[0] if order else None)
        if not order:
            why = ("its one retry was used" if not retry_left else "its deadline passed"
                   if left_secs <= 0 else "no other neuron serves it")
            raise UpstreamLost(f"{reason} (before its first token; not retried: {why})")
        cand = next(c for c in candidates if c.neuron == order[0])
        try:
            stream = await self._call(open_generate, greq, est, cand, True)
        except (UpstreamLost, grpc.aio.AioRpcError, UpstreamClosed) as e2:
            if not isinstance(e2, UpstreamClosed):
                self._refused(greq, cand.neuron, e2, kind, retry=False)
            raise UpstreamLost(f"{reason} (before its first token), and neuron {cand.neuron} "
                               f"failed it too: {err_detail(e2)}") from None
        assert isinstance(stream, OpenStream)
        return stream

    async def _await_model(self, model: str, principal: str, wait: tuple[float, str],
                           held: Held) -> None:
        """Return when the registry changed (the caller re-checks), or raise the right 4xx/5xx;
        `wait`: until when (monotonic) the request may wait, and what bounds it; `held`
        counts the request while it waits for a model the fleet has (loading, switching)."""
        reg = self.registry
        if reg.awaiting_first_report():  # just started or reloaded: hear every neuron first
            await reg.wait_changed(0.5)
            return
        if not reg.healthy_links():
            raise ApiError(503, "no neuron is reachable", code="service_unavailable")
        draining = [link.name for link in reg.healthy_links()
                    if (m := link.model_status(model)) is not None
                    and m.state == pb.MODEL_STATE_READY]
        if draining:  # READY but not a candidate: its neuron is draining, or the model is
            raise ApiError(503, f"every neuron serving `{model}` is shutting down",
                           code="shutting_down")
        if reg.models_in_state(model, pb.MODEL_STATE_DRAINING):
            raise ApiError(503, f"`{model}` is draining", code="shutting_down")
        task = self._loads.get(model)
        # A finished Load that failed is this request's answer; looking first keeps the
        # next line from starting another Load over it (a retry loop against the neuron).
        if task is not None and task.done() and task.exception() is not None \
                and not reg.models_in_state(model, *_WAITING):
            self._loads.pop(model, None)
            exc = task.exception()
            if isinstance(exc, ModelFailed):  # said at once: waiting cannot make it load
                raise model_failed(model, str(exc))
            raise ApiError(503, f"loading `{model}` failed: {exc}",
                           code="service_unavailable")
        if not reg.models_in_state(model, *_WAITING):
            self._maybe_start_load(model, principal)
        remaining = wait[0] - time.monotonic()
        if remaining <= 0:
            switching = reg.models_in_state(model, pb.MODEL_STATE_SWITCHING)
            if switching and not reg.models_in_state(model, pb.MODEL_STATE_LOADING):
                # docs/errors.md, "The table": a model switching profile is service_unavailable
                raise ApiError(503, f"`{model}` is switching profile (on "
                               f"{', '.join(switching)}) and was not ready within {wait[1]}; "
                               "retry shortly", code="service_unavailable")
            raise ApiError(503, f"`{model}` is loading and was not ready within {wait[1]}; "
                           "retry shortly", code="model_loading",
                           retry_after_secs=LOAD_RETRY_AFTER_SECS)
        held.start(model)
        await reg.wait_changed(min(remaining, 0.5))

    def _maybe_start_load(self, model: str, principal: str) -> None:
        reg = self.registry
        holders = reg.catalogue_holders(model)
        if not holders:
            failed = reg.models_in_state(model, pb.MODEL_STATE_FAILED)
            if failed:
                raise model_failed(model, self._failure(model))
            if model in reg.known_models():
                raise ApiError(503, f"no healthy neuron serves `{model}`",
                               code="service_unavailable")
            raise ApiError(404, f"The model `{model}` does not exist", code="model_not_found",
                           param="model")
        if not may_load(principal, self.settings.load_principals):
            if reg.models_in_state(model, pb.MODEL_STATE_FAILED):
                raise model_failed(model, self._failure(model))
            raise ApiError(503, f"`{model}` is not loaded and this key may not cause loads",
                           code="service_unavailable")
        task = self._loads.get(model)
        if task is not None and not task.done():
            return
        # Both router replicas pick the same neuron for a model: no double loads.
        link = max(holders, key=lambda h: rendezvous_score(model.encode(), h.name))
        self._loads[model] = asyncio.get_running_loop().create_task(
            self._load(link, model, principal))

    def _failure(self, model: str) -> str:
        """Why the model failed, as a neuron's Watch said."""
        for link in self.registry.healthy_links():
            m = link.model_status(model)
            if m is not None and m.state == pb.MODEL_STATE_FAILED:
                return f"{m.error or 'no reason given'} (on {link.name})"
        return "no reason given"

    async def _load(self, link: NeuronLink, model: str, principal: str) -> None:
        log.info("model.load_requested", neuron=link.name, model=model, principal=principal)
        try:
            resp = await link.stub.Load(pb.LoadRequest(model=model, principal=principal),
                                        metadata=link.metadata,
                                        timeout=max(600.0, self.settings.load_wait_secs))
        except grpc.aio.AioRpcError as e:
            log.warning("model.load_failed", neuron=link.name, model=model, grpc=e.code().name,
                        detail=e.details())
            raise RuntimeError(e.details() or e.code().name) from None
        finally:
            self.registry.notify()
        if resp.status.state == pb.MODEL_STATE_FAILED:
            # The neuron remembers the failure and retries only after a backoff.
            log.warning("model.load_failed", neuron=link.name, model=model, error=resp.status.error)
            raise ModelFailed(f"{resp.status.error or 'no reason given'} (on {link.name})")

    async def close(self) -> None:
        for task in self._loads.values():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
