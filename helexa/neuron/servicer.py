"""The neuron's gRPC service (helexa.neuron.v1.Neuron) on grpc.aio: the gRPC edge only.

`Generate` is the request path inside the daemon: make the prompt (the
checkpoint's chat template, tokens, images, the context check, the constraint
grammar: helexa/neuron/prepare.py) as one task of the caller's principal on the
neuron's work pool (helexa/neuron/work.py: bounded, fair between principals,
off the event loop so a huge prompt never stalls other streams or Watch; the call
counts as the model's work from before, so a drain, an unload or an eviction waits for it,
and it holds its req_id from before too; it is checked again once made: `_take`,
`_check`), hand
a `NewRequest` to the model's engine,
and send what the request's `OutputProcessor` (helexa/neuron/output_processor.py:
detokenising, stop strings, finish, usage) makes of each `RequestUpdate`.
Admission itself happens in the engine process; its refusals, and the
daemon's own, are `Refusal`s that leave here as gRPC statuses
(helexa/neuron/grpc_status.py). A caller that goes away cancels this handler,
which closes the engine iterator, which aborts the request wherever it is.
`Complete` is the same path with its messages merged into one reply
(helexa/responses.py), for callers that do not stream.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from helexa import __version__
from helexa.neuron import agent
from helexa.neuron.engine import messages
from helexa.neuron.grpc_status import abort
from helexa.neuron.metrics import NeuronMetrics
from helexa.neuron.output_processor import OutputProcessor
from helexa.neuron.prepare import Prepared, prepare
from helexa.neuron.residency import Residency
from helexa.neuron.resident_model import ModelState, ResidentModel
from helexa.neuron.status import StatusHub, model_status
from helexa.neuron.tokenize_work import check_size, tokenize_reply
from helexa.neuron.work import NeuronWork
from helexa.plan_sources import PlanError
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc
from helexa.refusal import Refusal
from helexa.responses import merge_responses

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="neuron")


def sampling_params(s: pb.SamplingParams) -> messages.SamplingParams:
    """Proto sampling → engine sampling; proto zeros that mean "off" become the off value."""
    return messages.SamplingParams(
        temperature=max(0.0, s.temperature), top_p=s.top_p if 0 < s.top_p <= 1 else 1.0,
        top_k=max(0, s.top_k), min_p=max(0.0, s.min_p), presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty > 0 else 1.0,
        seed=s.seed if s.HasField("seed") else None, logprobs=s.logprobs or s.top_logprobs > 0,
        top_logprobs=max(0, s.top_logprobs),
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None)


class NeuronServicer(neuron_pb2_grpc.NeuronServicer):
    """The RPCs; one instance per daemon, all on the daemon's asyncio loop."""

    def __init__(self, name: str, residency: Residency, hub: StatusHub,
                 metrics: NeuronMetrics) -> None:
        self.name = name
        self.residency = residency
        self.hub = hub
        self.metrics = metrics
        self.draining = False
        self._open: dict[str, ResidentModel] = {}  # req_id -> model, for every open call
        # every call's prompt work, fair between principals (work.py)
        self.work = NeuronWork(residency.cfg.server, metrics)

    # ------------------------------------------------------------------ Generate, Complete

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.time()
        req_id = request.req_id or uuid.uuid4().hex
        principal = request.principal
        blog = log.bind(req_id=req_id, model=request.model, principal=principal or "anonymous")
        r: ResidentModel | None = None  # once set, the call holds its id and counts on r
        try:
            try:
                r = self._take(request.model, req_id)
                # the caller leaving cancels this await: its task, still waiting, never runs
                p = await self.work.run_stoppable(principal, prepare, r.tokenizer, r.entry,
                                                  r.limits, request)
                self._check(request.model, r)  # a drain or an unload while it was made
            except Refusal as e:
                await self._refuse(context, blog, request.model, e)
                return
            # a caller's stop id inside a tagged tool call does not end the reply (docs/api.md,
            # "Chat and completions: shared fields"): where calls are tagged, the engine stops
            # at eos alone and the output processor at the caller's ids outside calls
            calls = None if p.grammar else agent.call_tags(r.entry, r.tokenizer.chat_template,
                                                           request)
            # the caller's ids as one set, made once (the output processor takes it as it is)
            caller_stop = frozenset(request.stop_token_ids)
            stop_ids = set() if calls else set(caller_stop)
            if not request.ignore_eos:
                stop_ids.update(r.tokenizer.eos_token_ids)
            deadline = (request.deadline_unix_ms / 1000 if request.deadline_unix_ms > 0
                        else arrival + self.residency.cfg.server.request_timeout_secs)
            new = messages.NewRequest(
                req_id=req_id, prompt_token_ids=p.prompt_ids,
                sampling=sampling_params(request.sampling), max_tokens=p.max_tokens,
                max_tokens_ceiling=(request.max_tokens if request.fit_max_tokens
                                    and p.max_tokens is not None else None),
                principal=principal, stop_token_ids=list(stop_ids), deadline_unix=deadline,
                arrival_unix=arrival, grammar=p.grammar, thinking=p.thinking, images=p.images)
            blog.info("request.start", prompt_tokens=len(p.prompt_ids),
                      max_tokens=p.max_tokens)
            async for resp in self._stream(r, new, request, context, blog, calls,
                                           caller_stop, p):
                yield resp
        finally:
            if r is not None:
                self._open.pop(req_id, None)  # its own entry: a duplicate never made one
                r.end()
                self.hub.changed()

    def _take(self, model: str, req_id: str) -> ResidentModel:
        """The serving model, with the call counted on it (begun: a drain, an unload or an
        eviction waits for it while its prompt is made) and its req_id held; or the refusal:
        draining, the model's state, a req_id already being served."""
        self._not_draining()
        r = self.residency.serving(model)
        if req_id in self._open:
            raise Refusal("invalid_request_error",
                          f"req_id: `{req_id}` is already being served")
        self._open[req_id] = r
        r.begin()
        return r

    def _not_draining(self) -> None:
        """shutting_down while the neuron drains, its retry after drain_secs."""
        if self.draining:
            raise Refusal("shutting_down", "This neuron is shutting down.",
                          int(self.residency.cfg.server.drain_secs * 1000))

    def _check(self, model: str, r: ResidentModel) -> None:
        """After the prompt was made: still to be served by r's engine (ready, or switching
        profile: its engine queues the request until the switch ends), else the refusal a
        new call would get now (shutting_down while draining, the model's state)."""
        self._not_draining()
        if self.residency.models.get(model) is r and r.state in (ModelState.READY,
                                                                  ModelState.SWITCHING):
            return
        self.residency.serving(model)  # draining, failed, gone: refused as a new call
        raise Refusal("service_unavailable",  # unloaded and loaded again meanwhile
                      f"The model `{model}` was reloaded; send the request again.", 1000)

    async def Complete(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        # Generate's own path, its messages merged: refusals abort the call from inside it,
        # and a caller going away cancels this handler and, closing Generate, the request.
        async with contextlib.aclosing(self.Generate(request, context)) as stream:
            return merge_responses([m async for m in stream])

    async def _stream(self, r: ResidentModel, new: messages.NewRequest,
                      request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                      blog: Any, calls: tuple[str, str] | None,
                      caller_stop: frozenset[int], p: Prepared
                      ) -> AsyncIterator[pb.GenerateResponse]:
        model = r.model_id
        # a constrained reply ends where its grammar does: a stop string inside it would
        # leave a half call or half JSON (docs/api.md, "JSON Schema keywords under
        # constrained decoding")
        out = OutputProcessor(r.tokenizer, new, stop=() if new.grammar else request.stop,
                              stop_token_ids=caller_stop,
                              return_prompt_token_ids=request.return_prompt_token_ids,
                              requested_max_tokens=(request.max_tokens
                                                    if request.HasField("max_tokens") else None),
                              calls=calls,
                              prompt_text=p.prompt_text if request.return_prompt_text else None,
                              text_offsets=p.text_offsets)
        client_gone = True  # until the loop ends any other way: cancellation lands anywhere
        counted = False  # _done ran already
        pauses = _Pauses(blog, self.metrics.pauses.labels(model))
        updates = (_prompt_alone(new) if _computes_nothing(new)
                   else r.client.generate(new, on_flow=pauses))
        try:
            async for upd in updates:
                step = out.process(upd)
                if step.abort_engine:
                    r.client.abort(new.req_id, step.abort_reason)
                if step.first_token_secs is not None:
                    self.metrics.ttft.labels(model).observe(step.first_token_secs)
                if step.inter_token_secs is not None:
                    self.metrics.itl.labels(model).observe(step.inter_token_secs)
                if step.response is not None:
                    yield step.response
                if out.finished:
                    break
            client_gone = False
        except Refusal as e:
            client_gone = False
            if out.finished:  # the engine failed it after admission, before a token: it ran
                # counted and logged by _done, no refusal, before the caller hears of it
                counted = True
                self._done(model, out, client_gone, blog, pauses)
                await abort(context, e)
            else:
                await self._refuse(context, blog, model, e)
        except Exception as e:  # the engine link broke: not the caller's doing
            client_gone = False
            out.fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            await updates.aclose()
            if (out.finished or client_gone) and not counted:
                self._done(model, out, client_gone, blog, pauses)

    def _done(self, model: str, out: OutputProcessor, client_gone: bool, blog: Any,
              pauses: _Pauses | None = None) -> None:
        """Count a request that ran (finished, failed or left) and log its request.done."""
        outcome = out.outcome(client_gone)
        prompt_tokens, cached = len(out.new.prompt_token_ids), out.cached_tokens
        self.metrics.requests.labels(model, outcome).inc()
        if not _computes_nothing(out.new):
            self.metrics.prefill_tokens.labels(model).inc(prompt_tokens - cached)
        self.metrics.cached_tokens.labels(model).inc(cached)
        self.metrics.decode_tokens.labels(model).inc(len(out.output_token_ids))
        u = out.usage()
        blog.info("request.done", prompt_tokens=prompt_tokens,
                  completion_tokens=u.completion_tokens, cached_tokens=cached,
                  queue_ms=round(u.queue_ms, 3), prefill_ms=round(u.prefill_ms, 3),
                  decode_ms=round(u.decode_ms, 3), finish_reason=outcome,
                  stop_reason=out.stop_reason, client_gone=client_gone, error=out.error or None,
                  **(pauses.summary() if pauses is not None else {}))

    async def _refuse(self, context: grpc.aio.ServicerContext, blog: Any, model: str,
                      e: Refusal) -> None:
        if not any(entry.id == model for entry in self.residency.catalogue()):
            model = "unknown"  # keep label values to the catalogue
        self.metrics.refusals.labels(model, e.code).inc()
        self.metrics.requests.labels(model, "rejected").inc()
        blog.info("request.rejected", code=e.code, message=e.message,
                  retry_after_ms=e.retry_after_ms or None)
        await abort(context, e)

    # ------------------------------------------------------------------ status

    async def Watch(self, request: pb.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.NeuronStatus]:
        async for status in self.hub.watch(request.heartbeat_ms):
            yield status

    async def Models(self, request: pb.ModelsRequest,
                     context: grpc.aio.ServicerContext) -> pb.ModelsResponse:
        res = self.residency
        return pb.ModelsResponse(
            catalogue=[pb.CatalogueEntry(model=e.id, tp=e.tp, priority=e.priority,
                                         profile=res.profile_of(e.id),
                                         resident=e.id in res.models and
                                         res.models[e.id].state != ModelState.FAILED)
                       for e in res.catalogue()],
            models=[model_status(r) for r in list(res.models.values())])

    async def Health(self, request: pb.HealthRequest,
                     context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(status="DRAINING" if self.draining else "SERVING",
                                 neuron=self.name, version=__version__)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            r = self.residency.serving(request.model)
            check_size(request, self.residency.cfg.server.max_tokenize_bytes)
            return await self.work.run_stoppable(request.principal, tokenize_reply, r, request)
        except Refusal as e:
            await abort(context, e)

    # ------------------------------------------------------------------ operations

    async def Load(self, request: pb.LoadRequest,
                   context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        try:
            if self.draining:
                raise Refusal("shutting_down", "This neuron is shutting down.")
            log.info("model.load_requested", model=request.model,
                     principal=request.principal or "anonymous")
            r, evicted = await self.residency.load(request.model,
                                                   retry_failed=request.retry_failed)
        except Refusal as e:
            await abort(context, e)
        return pb.LoadResponse(status=model_status(r), evicted=evicted)

    async def Unload(self, request: pb.UnloadRequest,
                     context: grpc.aio.ServicerContext) -> pb.UnloadResponse:
        try:
            done = await self.residency.unload(request.model, drain=request.drain,
                                               force=request.force)
        except Refusal as e:
            await abort(context, e)
        return pb.UnloadResponse(unloaded=done)

    async def SetProfile(self, request: pb.SetProfileRequest,
                         context: grpc.aio.ServicerContext) -> pb.SetProfileResponse:
        try:
            r, changed = await self.residency.set_profile(request.model, request.profile)
        except PlanError as e:  # planned before anything changed: the model runs on as it was
            await abort(context, Refusal(
                "invalid_request_error",
                f"profile `{request.profile}` cannot run `{request.model}`: {e}"))
        except Refusal as e:
            await abort(context, e)
        return pb.SetProfileResponse(status=model_status(r), changed=changed)


def _computes_nothing(new: messages.NewRequest) -> bool:
    """A reply that needs no model computation: max_tokens 0 without prompt logprobs (an
    echo: the prompt's text and its count, which the neuron has without the engine; vLLM
    computes one token and drops it). Such a request is answered here, no prefill run."""
    return new.max_tokens == 0 and new.sampling.prompt_logprobs is None


async def _prompt_alone(new: messages.NewRequest) -> AsyncIterator[messages.RequestUpdate]:
    """_computes_nothing's request, as the engine would end it after its prefill."""
    yield messages.RequestUpdate(req_id=new.req_id, admitted=True, started=True,
                                 prompt_tokens=len(new.prompt_token_ids),
                                 finished=messages.FinishReason.LENGTH)


class _Pauses:
    """What a request's pauses and resumes say (flow control, engine/flow.py): its caller
    stopped reading, so its tokens wait here and the engine leaves it out of steps. A
    reader slower than the model is paced, a pause every ~192 tokens: the first pause and
    its resume are logged at info, later ones at debug, and request.done counts them all."""

    def __init__(self, blog: Any, counter: Any) -> None:
        self.blog, self.counter = blog, counter
        self.count, self.paused_secs, self._since = 0, 0.0, 0.0

    def __call__(self, paused: bool, unread: int) -> None:
        if paused:
            self._since = time.monotonic()
            self.count += 1
            self.counter.inc()
            kw: dict[str, Any] = {"unread_tokens": unread, "pause": self.count}
            if self.count == 1:
                self.blog.info("request.paused", **kw)
            else:
                self.blog.debug("request.paused", **kw)
        elif self._since:
            secs = time.monotonic() - self._since
            self.paused_secs, self._since = self.paused_secs + secs, 0.0
            kw = {"unread_tokens": unread, "pause": self.count,
                  "paused_ms": round(secs * 1000, 3)}
            if self.count == 1:
                self.blog.info("request.resumed", **kw)
            else:
                self.blog.debug("request.resumed", **kw)

    def summary(self) -> dict[str, Any]:
        """request.done's fields: how many pauses and how long in all; none if none."""
        if not self.count:
            return {}
        ongoing = time.monotonic() - self._since if self._since else 0.0  # ended paused
        return {"pauses": self.count,
                "paused_ms": round((self.paused_secs + ongoing) * 1000, 3)}
