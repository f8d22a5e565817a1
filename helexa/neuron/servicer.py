"""The neuron's gRPC service (helexa.neuron.v1.Neuron) on grpc.aio.

`Generate` is the request path inside the daemon: tokenise (the checkpoint's
chat template) and check the context on a worker thread, so a huge prompt
never stalls other streams or Watch, hand a `NewRequest` to the model's engine,
and turn its per-step `RequestUpdate`s into text deltas (incremental
detokenisation, stop strings) ending with usage. Admission itself happens in
the engine process; its refusals come back as `refused_code` and leave here
as gRPC statuses with `helexa-code` / `helexa-retry-after-ms`. A caller that
goes away cancels this handler, which closes the engine iterator, which
aborts the request wherever it is. `Complete` is the same path with its
messages merged into one reply (helexa.responses), for callers that do not
stream.
"""

from __future__ import annotations

import asyncio
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
from helexa.neuron.limits import Refusal, check_context
from helexa.neuron.metrics import NeuronMetrics
from helexa.neuron.residency import ModelState, Residency, ResidentModel
from helexa.neuron.status import StatusHub, model_status
from helexa.neuron.vision.prompt import with_images
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc
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
        top_logprobs=max(0, s.top_logprobs))


def tokenise(tokenizer: Any, request: pb.GenerateRequest) -> list[int]:
    """The prompt's token ids: chat via the chat template, text as is, or ids given."""
    which = request.WhichOneof("prompt")
    if which == "chat":
        msgs, kwargs = agent.template_inputs(request.chat, request.reasoning_effort,
                                             request.HasField("constraint"))
        if not msgs:
            raise Refusal("invalid_request_error", "messages: expected at least one message")
        try:
            return list(tokenizer.encode_chat(msgs, **kwargs))
        except Exception as e:  # the checkpoint's template refused these messages
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template failed: {e}") from None
    if which == "text":
        ids = list(tokenizer.encode(request.text))
        if not ids:
            raise Refusal("invalid_request_error", "prompt: expected at least one token")
        return ids
    if which == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise Refusal("invalid_request_error", "prompt: expected at least one token id")
        bad = next((i for i in ids if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise Refusal("invalid_request_error",
                          f"prompt: token id {bad} is outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        return ids
    raise Refusal("invalid_request_error", "prompt: expected chat messages, text or token ids")


def prompt_of(tokenizer: Any, request: pb.GenerateRequest, max_tokens: int | None,
              limits: Any) -> tuple[list[int], list[messages.ImageInput]]:
    """Tokenise (images decoded, their tokens placed) and check the context: CPU-bound for a
    long prompt or a large image, so Generate runs it on a worker thread (the tokenizer
    releases the GIL for long texts, Pillow while it decodes)."""
    ids, images = with_images(tokenizer, request, tokenise(tokenizer, request))
    check_context(len(ids), max_tokens, limits)
    return ids, images


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

    # ------------------------------------------------------------------ Generate, Complete

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.time()
        req_id = request.req_id or uuid.uuid4().hex
        principal = request.principal
        blog = log.bind(req_id=req_id, model=request.model, principal=principal or "anonymous")
        try:
            if self.draining:
                raise Refusal("shutting_down", "This neuron is shutting down.",
                              int(self.residency.cfg.server.drain_secs * 1000))
            r = self.residency.serving(request.model)
            if req_id in self._open:
                raise Refusal("invalid_request_error",
                              f"req_id: `{req_id}` is already being served")
            max_tokens = request.max_tokens if request.HasField("max_tokens") else None
            prompt_ids, images = await asyncio.to_thread(prompt_of, r.tokenizer, request,
                                                         max_tokens, r.limits)
            grammar = agent.constraint_grammar(request)
            thinking = agent.thinking(r.tokenizer, r.entry, request, prompt_ids,
                                      _enable_thinking(request))
        except Refusal as e:
            await self._refuse(context, blog, request.model, e)
            return
        stop_ids = list(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids += [i for i in r.tokenizer.eos_token_ids if i not in stop_ids]
        deadline = (request.deadline_unix_ms / 1000 if request.deadline_unix_ms > 0
                    else arrival + self.residency.cfg.server.request_timeout_secs)
        new = messages.NewRequest(
            req_id=req_id, prompt_token_ids=prompt_ids, sampling=sampling_params(request.sampling),
            max_tokens=max_tokens, principal=principal, stop_token_ids=stop_ids,
            deadline_unix=deadline, arrival_unix=arrival, grammar=grammar, thinking=thinking,
            images=images)
        blog.info("request.start", prompt_tokens=len(prompt_ids), max_tokens=max_tokens)
        r.begin()
        try:
            async for resp in self._stream(r, new, request, context, blog):
                yield resp
        finally:
            r.end()
            self.hub.changed()

    async def Complete(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        # Generate's own path, its messages merged: refusals abort the call from inside it,
        # and a caller going away cancels this handler and, closing Generate, the request.
        async with contextlib.aclosing(self.Generate(request, context)) as stream:
            return merge_responses([m async for m in stream])

    async def _stream(self, r: ResidentModel, new: messages.NewRequest,
                      request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                      blog: Any) -> AsyncIterator[pb.GenerateResponse]:
        from helexa.neuron.engine.detokenizer import IncrementalDetokenizer, StopChecker

        tok, model = r.tokenizer, r.model_id
        detok = IncrementalDetokenizer(tok, new.prompt_token_ids)
        stopper = StopChecker(list(request.stop))
        out_ids: list[int] = []
        t_admit = t_first = t_last = 0.0
        cached = 0
        drafted = accepted = 0  # speculation: the request's totals, as the engine last said
        finish: int | None = None
        stop_reason, error, client_gone, sent_first = "", "", True, False
        updates = r.client.generate(new)
        self._open[new.req_id] = r
        try:
            async for upd in updates:
                if upd.refused_code:
                    raise Refusal(upd.refused_code, upd.refused_message or upd.refused_code,
                                  upd.retry_after_ms)
                if upd.admitted:
                    t_admit, cached = time.time(), upd.cached_tokens
                drafted = max(drafted, upd.spec_drafted_tokens)
                accepted = max(accepted, upd.spec_accepted_tokens)
                resp = pb.GenerateResponse()
                if not sent_first and request.return_prompt_token_ids:
                    resp.prompt_token_ids.extend(new.prompt_token_ids)
                if not sent_first and new.thinking is not None and new.thinking.starts_open:
                    resp.thought_open = True
                if upd.new_token_ids:
                    now = time.time()
                    if t_first == 0.0:
                        t_first = now
                        self.metrics.ttft.labels(model).observe(now - new.arrival_unix)
                    else:
                        self.metrics.itl.labels(model).observe((now - t_last) / len(upd.new_token_ids))
                    t_last = now
                    out_ids += upd.new_token_ids
                    resp.token_ids.extend(upd.new_token_ids)
                    if upd.logprobs:
                        resp.logprobs.extend(_logprobs(tok, upd.logprobs))
                    text, matched = stopper.feed(detok.add(upd.new_token_ids))
                    resp.text = text
                    if matched is not None:
                        r.client.abort(new.req_id, "stop_string")
                        finish, stop_reason = pb.FINISH_REASON_STOP, matched
                if finish is None and upd.finished is not None:
                    finish = int(upd.finished)
                    error = upd.error
                    if upd.finished == messages.FinishReason.ERROR and not out_ids:
                        raise Refusal("upstream_error", f"the engine failed: {error}")
                    if upd.finished != messages.FinishReason.ABORT:
                        tail, matched = stopper.feed(detok.flush())
                        resp.text += tail
                        if matched is not None:
                            finish, stop_reason = pb.FINISH_REASON_STOP, matched
                        else:
                            resp.text += stopper.flush()
                    if upd.finished == messages.FinishReason.STOP and out_ids and \
                            out_ids[-1] in request.stop_token_ids:
                        stop_reason = str(out_ids[-1])
                    elif upd.finished == messages.FinishReason.ERROR:
                        stop_reason = error
                    elif upd.finished == messages.FinishReason.ABORT and upd.error == "deadline":
                        stop_reason = "deadline"  # the engine enforces deadlines and says so
                if finish is not None:
                    resp.finish_reason = finish
                    resp.stop_reason = stop_reason
                    resp.usage.CopyFrom(_usage(new, out_ids, cached, t_admit, t_first, t_last))
                    resp.usage.reasoning_tokens = upd.reasoning_tokens
                    resp.usage.draft_tokens = drafted
                    resp.usage.accepted_draft_tokens = accepted
                if resp.ByteSize() or finish is not None:
                    sent_first = True
                    yield resp
                if finish is not None:
                    break
            client_gone = False
        except Refusal as e:
            client_gone = False
            await self._refuse(context, blog, model, e)
        except Exception as e:  # the engine link broke: not the caller's doing
            client_gone, error = False, f"{type(e).__name__}: {e}"
            finish = finish or pb.FINISH_REASON_ERROR
            raise
        finally:
            self._open.pop(new.req_id, None)
            await updates.aclose()
            outcome = ("client_gone" if client_gone
                       else pb.FinishReason.Name(finish or 0).removeprefix("FINISH_REASON_").lower())
            if finish is not None or client_gone:
                self.metrics.requests.labels(model, outcome).inc()
                self.metrics.prefill_tokens.labels(model).inc(len(new.prompt_token_ids) - cached)
                self.metrics.cached_tokens.labels(model).inc(cached)
                self.metrics.decode_tokens.labels(model).inc(len(out_ids))
                u = _usage(new, out_ids, cached, t_admit, t_first, t_last)
                blog.info("request.done", prompt_tokens=len(new.prompt_token_ids),
                          completion_tokens=len(out_ids), cached_tokens=cached,
                          queue_ms=round(u.queue_ms, 3), prefill_ms=round(u.prefill_ms, 3),
                          decode_ms=round(u.decode_ms, 3), finish_reason=outcome,
                          stop_reason=stop_reason, client_gone=client_gone, error=error or None)

    async def _refuse(self, context: grpc.aio.ServicerContext, blog: Any, model: str,
                      e: Refusal) -> None:
        if not any(entry.id == model for entry in self.residency.catalogue()):
            model = "unknown"  # keep label values to the catalogue
        self.metrics.refusals.labels(model, e.code).inc()
        self.metrics.requests.labels(model, "rejected").inc()
        blog.info("request.rejected", code=e.code, message=e.message,
                  retry_after_ms=e.retry_after_ms or None)
        await context.abort(e.status, e.message, e.trailing_metadata())

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
            out = pb.TokenizeResponse(max_model_len=r.limits.context if r.limits else 0)
            which = request.WhichOneof("input")
            if which == "token_ids":
                ids = list(request.token_ids.ids)
                bad = next((i for i in ids if not 0 <= i < r.tokenizer.vocab_size), None)
                if bad is not None:
                    raise Refusal("invalid_request_error",
                                  f"tokens: token id {bad} is outside the vocabulary")
                out.text = r.tokenizer.decode(ids)
            elif which == "chat":
                msgs, kwargs = agent.template_inputs(request.chat, request.reasoning_effort)
                try:
                    ids = r.tokenizer.encode_chat(msgs, request.add_generation_prompt, **kwargs)
                    out.token_ids.extend(await asyncio.to_thread(
                        lambda: with_images(r.tokenizer, request, list(ids))[0]))
                except Refusal:
                    raise
                except Exception as e:
                    raise Refusal("invalid_request_error",
                                  f"messages: the model's chat template failed: {e}") from None
            else:
                out.token_ids.extend(r.tokenizer.encode(request.text,
                                                        request.add_special_tokens))
        except Refusal as e:
            await context.abort(e.status, e.message, e.trailing_metadata())
        return out

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
            await context.abort(e.status, e.message, e.trailing_metadata())
        return pb.LoadResponse(status=model_status(r), evicted=evicted)

    async def Unload(self, request: pb.UnloadRequest,
                     context: grpc.aio.ServicerContext) -> pb.UnloadResponse:
        try:
            done = await self.residency.unload(request.model, drain=request.drain,
                                               force=request.force)
        except Refusal as e:
            await context.abort(e.status, e.message, e.trailing_metadata())
        return pb.UnloadResponse(unloaded=done)

    async def SetProfile(self, request: pb.SetProfileRequest,
                         context: grpc.aio.ServicerContext) -> pb.SetProfileResponse:
        try:
            r, changed = await self.residency.set_profile(request.model, request.profile)
        except Refusal as e:
            await context.abort(e.status, e.message, e.trailing_metadata())
        return pb.SetProfileResponse(status=model_status(r), changed=changed)


def _enable_thinking(request: pb.GenerateRequest) -> Any:
    """chat_template_kwargs.enable_thinking as the client set it (None when not)."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.template_kwargs_json:
        return None
    _, kwargs = agent.template_inputs(pb.Chat(template_kwargs_json=request.chat.template_kwargs_json), "")
    return kwargs.get("enable_thinking")


def _usage(new: messages.NewRequest, out_ids: list[int], cached: int, t_admit: float,
           t_first: float, t_last: float) -> pb.Usage:
    ms = 1000.0
    return pb.Usage(
        prompt_tokens=len(new.prompt_token_ids), completion_tokens=len(out_ids),
        cached_tokens=cached,
        queue_ms=(t_admit - new.arrival_unix) * ms if t_admit else 0.0,
        prefill_ms=(t_first - new.arrival_unix) * ms if t_first else 0.0,
        decode_ms=(t_last - t_first) * ms if t_first else 0.0)


def _logprobs(tok: Any, lps: list[messages.TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, token=tok.decode([lp.token_id]),
                            token_bytes=tok.token_bytes(lp.token_id), logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t.token_id, token=tok.decode([t.token_id]),
                                               token_bytes=tok.token_bytes(t.token_id),
                                               logprob=t.logprob) for t in lp.top])
            for lp in lps]
