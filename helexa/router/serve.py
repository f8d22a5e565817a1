"""The two generation endpoints: POST /v1/chat/completions and POST /v1/completions.

One handler serves both. Its steps follow the path of a request
(docs/architecture.md; the contract is docs/http.md):
principal, body, alias, selection (Dispatcher), then either an SSE stream
over Generate calls or one JSON body from Complete calls (unary: a stream
costs more gRPC CPU on both ends, and a non-streaming client sees nothing
before the end anyway). `n > 1` fans out into n calls (one per choice). HTTP
headers go out only after every choice's first neuron message (it comes at
admission) or whole reply, so a neuron's refusal is still a proper HTTP error;
after that, SSE comments keep the stream alive while the neuron is silent (a
long prefill), and a neuron failing mid-stream ends it with an
`upstream_error` event. If the client goes away the handler is cancelled (aiohttp handler
cancellation), which cancels the gRPC calls in flight (the `finally` below
cancels open streams), and that aborts them on the neuron. TTFT and
inter-token latency are observed on streams only: a Complete reply carries
its first token and its last together.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web

from helexa.proto import neuron_pb2 as pb
from helexa.router import (
    anthropic,
    anthropic_encode,
    anthropic_errors,
    completion_logprobs,
    echo_share,
    encode,
    event_replies,
    images,
    reply_check,
    responses_api,
    responses_encode,
    stream_pressure,
)
from helexa.router.agent_output import OutputParser
from helexa.router.client_stream import ClientStalled, ClientStream, Pace, send_whole
from helexa.router.errors import MAX_MESSAGE_CHARS, ApiError, clip
from helexa.router.event_replies import (
    SSE_HEADERS,
    UpstreamFailed,
    check_finish,
    ended_short,
    mid_stream_error,
)
from helexa.router.feasibility import refuse_unservable
from helexa.router.forward import Completed, OpenStream, generate_requests
from helexa.router.http_edge import read_body
from helexa.router.inflight import UpstreamLost
from helexa.router.metrics import ModelSeries
from helexa.router.openai_api import Kind, ParsedRequest, parse_request
from helexa.router.selection import Estimate, affinity_key, estimate_prompt_tokens

if TYPE_CHECKING:
    from helexa.router.app import RouterState

STATE: web.AppKey[RouterState] = web.AppKey("state")  # the app's RouterState
_PARSERS = {"messages": anthropic.parse_request, "responses": responses_api.parse_request}


class _Done:
    """A choice's stream has ended (its pump's last word)."""


def _estimate(req: ParsedRequest) -> tuple[Estimate, bytes]:
    if req.messages is not None:
        prompt = estimate_prompt_tokens(req.prompt_chars, len(req.messages))
        # The opening of the conversation: its system prompt and first user turn; or the
        # client's own name for what shares a cache (Responses' prompt_cache_key).
        head = [t.content for t in req.messages[:2]] if req.cache_key is None \
            else ["\0prompt_cache_key", req.cache_key]
    elif req.prompt_ids is not None:
        prompt = estimate_prompt_tokens(0, num_token_ids=len(req.prompt_ids))
        head = [",".join(map(str, req.prompt_ids[:256]))]
    else:
        prompt = estimate_prompt_tokens(req.prompt_chars)
        head = [(req.prompt_text or "")[:1024]]
    return Estimate(prompt, req.max_tokens), affinity_key(req.model, head)


async def _merge(streams: list[OpenStream]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """Messages of all choices as they come, as (choice index, message). Each choice's pump
    reads at most one message ahead of the consumer, so a client that stops reading stops
    the reads, and gRPC's flow control then the neuron (neuron_channel.channel_options)."""
    if len(streams) == 1:
        async for msg in streams[0].messages():
            yield 0, msg
        return
    done = _Done()
    queue: asyncio.Queue[tuple[int, pb.GenerateResponse | BaseException | _Done]] = \
        asyncio.Queue()
    taken = [asyncio.Event() for _ in streams]  # set when the consumer took a pump's message

    async def pump(i: int, s: OpenStream) -> None:
        try:
            async for msg in s.messages():
                taken[i].clear()
                queue.put_nowait((i, msg))
                await taken[i].wait()
        except BaseException as e:  # handed to the consumer, which decides
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_count = len(streams)
        while open_count:
            i, item = await queue.get()
            if isinstance(item, _Done):
                open_count -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
                taken[i].set()  # its pump reads the next once this one is written
    finally:
        for t in tasks:
            t.cancel()


async def handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[STATE]
    t0 = time.monotonic()
    req_id = os.urandom(12).hex()
    # Plain dict rather than log.bind(): a request's fields grow as it is understood.
    ctx: dict[str, Any] = {"req_id": req_id}
    log = state.log
    model = label = asked = "-"  # label: the model's on the metrics (metric_label)
    code = "200"
    calls: list[OpenStream | Completed] = []
    state.metrics.in_progress.inc()
    try:
        principal = ctx["principal"] = state.auth.of(request.headers)
        raw = await read_body(request, state.max_body_bytes, state.read_timeout_secs)
        # Off the loop (work_pool.py): decoding and schema compiling grow with the body. Each
        # task counts against the principal's share of the pool (429 beyond it).
        if kind in _PARSERS:
            req = await state.work_pool.run(principal, _PARSERS[kind], raw, state.caps)
        else:
            req = await state.work_pool.run(principal, parse_request, raw, kind, state.caps)
        if req.compiles:  # its grammars, caps checked: on the compile pool (agent_request.py)
            await state.compile_pool.run(principal, req.compile)
        asked = req.model
        model = ctx["model"] = state.aliases.resolve(asked)
        label = metric_label(state, model)
        refuse_unservable(state.registry.candidates(model), req)
        est, key = _estimate(req)
        if any(images.parts_of(req)):  # decoded on the work pool; their tokens estimated
            vision = images.check_model_takes_images(req, model, state.registry)
            await images.resolve(req, state.cfg.images, state.work_pool, principal)
            if vision is not None:
                est = Estimate(est.prompt_tokens + images.estimated_tokens(req, vision),
                               est.max_tokens)
        deadline_ms = int((time.time() + state.request_secs) * 1000)
        prompts = req.per_prompt()  # a completions batch: n choices for each prompt
        greqs = await state.work_pool.run(
            principal, functools.partial(generate_requests, prompts, req.n, model=model,
                              principal="" if principal == "anonymous" else principal,
                              req_id=req_id, deadline_unix_ms=deadline_ms))
        log.info("request.start", **ctx, kind=kind, stream=req.stream, n=req.n,
                 est_prompt_tokens=est.prompt_tokens, max_tokens=req.max_tokens)
        if req.repaired_calls:  # a call max_tokens cut, sent back as received (cut_calls.py)
            log.info("request.history_call_repaired", **ctx, fields=req.repaired_calls)
        calls = await _open_all(state, greqs, est, key, principal, req.kind, req.stream)
        env = encode.Envelope(id=("chatcmpl-" if kind == "chat" else "cmpl-") + req_id,
                              created=int(time.time()), model=model, req=req)
        choices = [encode.Choice(index=k * req.n + i, prompt_index=k,
                                 parser=reply_check.reply_parser(state, req, model, calls),
                                 echo=completion_logprobs.echo_text(sub, calls[k * req.n + i]))
                   for k, sub in enumerate(prompts) for i in range(req.n)]
        streams = [c for c in calls if isinstance(c, OpenStream)]
        headers = _headers(req, calls[0], req_id)
        pace = stream_pressure.pace_for(state.client_pace, state.registry,
                                        lambda m: state.dispatcher.held.get(m, 0), model, calls)
        if kind in _PARSERS:
            enc = _encoder(kind, req, model, calls[0], choices[0].parser)
            series, last = state.metrics.model(label), [0.0]
            # a whole reply's body off the loop, as chat's below (event_replies.py)
            resp = await event_replies.reply(
                request, req.stream, choices[0], calls[0], enc, headers, log, req_id,
                functools.partial(state.work_pool.run, principal, share=False),
                on_message=lambda msg: _timing(series, t0, last, msg),
                pace=pace, deadline_secs=state.request_secs)
        elif req.stream:
            resp = await _stream(request, env, choices, streams, state,
                                 state.metrics.model(label), t0, req_id, headers, pace)
        else:
            # Off the loop: 16 choices with top_logprobs are tens of MB of JSON. Counted, never
            # refused for the principal's share: the tokens are made (work_pool.py).
            body = await state.work_pool.run(
                principal, _reply, env, choices, [c for c in calls if isinstance(c, Completed)],
                state.request_secs, share=False)
            resp = await send_whole(request, body, headers, state.client_pace)
        reply_check.check_schema(state, req, model, calls, choices, ctx)
        usage = encode.usage_dict(choices)
        state.metrics.model(label).tokens(usage["prompt_tokens"], usage["completion_tokens"])
        log.info("request.done", **ctx, neurons=[c.neuron for c in calls],
                 usage=usage, secs=round(time.monotonic() - t0, 4),
                 finish=[c.finish_reason for c in choices], client_gone=False)
        return resp
    except ApiError as e:
        e = state.aliases.named(e, asked)
        code = str(e.status)
        log.info("request.rejected", **ctx, status=e.status, code=e.code, message=e.message)
        return error_response(kind, e, {"x-request-id": req_id})
    except (asyncio.CancelledError, ConnectionResetError) as e:
        code = "499"  # nginx's "client closed request"
        stalled = isinstance(e, ClientStalled)  # it stopped reading: we ended it
        log.info("request.done", **ctx, outcome="client_stalled" if stalled else "client_gone",
                 client_gone=True, secs=round(time.monotonic() - t0, 4),
                 **({"reason": str(e)} if stalled else {}))
        if isinstance(e, asyncio.CancelledError):
            raise
        return web.Response(status=499)  # a write to a client that has gone
    except Exception as e:  # a bug of ours: the client gets the envelope, the metrics the truth
        code = "500"
        log.exception("request.done", **ctx, outcome="error", status=500,
                      error=clip(repr(e), MAX_MESSAGE_CHARS),
                      secs=round(time.monotonic() - t0, 4))
        return error_response(kind, ApiError(500, "internal error; the router's log has the "
                                                  "details", code="internal_error"),
                              {"x-request-id": req_id})
    finally:
        for c in calls:
            c.cancel()
        state.metrics.in_progress.dec()
        series = state.metrics.model(label)
        series.answered(code)
        series.e2e.observe(time.monotonic() - t0)


async def _open_all(state: RouterState, greqs: list[pb.GenerateRequest], est: Estimate,
                    key: bytes, principal: str, kind: Kind,
                    stream: bool) -> list[OpenStream | Completed]:
    """One open stream (or Complete reply) per choice, or the first refusal (the others are
    cancelled). A choice's stream open while others wait to be admitted is read ahead
    (forward.OpenStream.read_ahead) until they all are: unread, the neuron would pause it,
    and a sibling waiting for KV would wait for the KV it holds (a 503 at kv_max_wait_secs).
    Complete calls run side by side anyway, each to its end."""
    if len(greqs) == 1:  # the common case, without a task per choice
        return [await state.dispatcher.open(greqs[0], est, key, principal=principal, kind=kind,
                                            stream=stream)]
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(state.dispatcher.open(g, est, key, principal=principal, kind=kind,
                                                    stream=stream))
             for g in greqs]
    ok = False
    try:
        waiting = set(tasks)
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=tasks.index):
                if (e := t.exception()) is not None:
                    raise e
                if waiting and isinstance(call := t.result(), OpenStream):
                    call.read_ahead()
        ok = True
        opened = [t.result() for t in tasks]
        for c in opened:
            if isinstance(c, OpenStream):
                c.stop_reading_ahead()  # from here its reads wait for the client's
        return opened
    finally:
        if not ok:  # a refusal, or the client left: no choice may keep running
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled() and t.exception() is None:
                    t.result().cancel()


def metric_label(state: RouterState, model: str) -> str:
    """The `model` label of a request's series: the model id itself where the operator named
    it (an alias's target) or a neuron reported it (resident or in its catalogue), else
    "unknown". A client's string never becomes a label, whatever refuses the request (a bad
    image, a 429, the client leaving): each would be a hundred series more, for ever, which
    `/metrics` shows to anyone without a key."""
    if model in state.aliases.targets() or model in state.registry.known_models():
        return model
    return "unknown"


def error_response(kind: str, e: ApiError, headers: dict[str, str]) -> web.Response:
    """The refusal in the envelope of the endpoint's API (Anthropic's on /v1/messages)."""
    if kind == "messages":
        return anthropic_errors.error_response(e, headers)
    return e.response(headers)


def _encoder(kind: str, req: ParsedRequest, model: str, call: Any,
             parser: OutputParser | None) -> event_replies.Encoder:
    if kind == "messages":
        enc = anthropic_encode.StreamEncoder(anthropic_encode.message_id(), model, parser,
                                             req.stop)
        if isinstance(call, OpenStream):
            enc.prompt_tokens, enc.cached_tokens = call.first.prompt_tokens, call.first.cached_tokens
        return enc
    return responses_encode.ResponseEncoder(responses_encode.response_id(), model, req, parser)


def _headers(req: ParsedRequest, call: Any, req_id: str) -> dict[str, str]:
    """x-request-id, and what the neuron or the grammar changed about the request: the
    max_tokens it fitted to the context, the schema keywords not enforced while decoding."""
    headers = {"x-request-id": req_id}
    first = call.first if isinstance(call, OpenStream) else call.reply
    if first.fitted_max_tokens:
        headers["x-helexa-max-tokens"] = f"{first.fitted_max_tokens} (fitted to the context)"
    if req.unenforced:
        headers["x-helexa-unenforced-schema"] = "; ".join(req.unenforced)[:4000]
    return headers


def _timing(series: ModelSeries, t0: float, last: list[float], msg: pb.GenerateResponse) -> None:
    n = len(msg.token_ids)
    if not n:
        return
    now = time.monotonic()
    if last[0] == 0.0:
        series.first_token(now - t0)
    else:
        series.between_tokens((now - last[0]) / n)
    last[0] = now


def _reply(env: encode.Envelope, choices: list[encode.Choice],
           replies: list[Completed], deadline_secs: float) -> bytearray:
    echo_share.whole(env.req, [r.reply for r in replies])  # n > 1: one call scored the prompt
    for choice, r in zip(choices, replies, strict=True):
        if (why := ended_short(r.reply, deadline_secs)) is not None:
            raise ApiError(502, why, code="upstream_error")
        encode.add_delta(choice, encode.with_stop_str(env.req, r.reply))
    if any(c.finish_reason is None for c in choices):
        raise ApiError(502, "the neuron answered without finishing", code="upstream_error")
    return encode.json_body(encode.full_body(env, choices))


async def _stream(request: web.Request, env: encode.Envelope, choices: list[encode.Choice],
                  streams: list[OpenStream], state: RouterState, series: ModelSeries,
                  t0: float, req_id: str, headers: dict[str, str],
                  pace: Pace) -> web.StreamResponse:
    resp = ClientStream(request, headers={**SSE_HEADERS, **headers}, pace=pace)
    await resp.prepare(request)
    for c in choices:
        if (chunk := encode.first_chunk(env, c)) is not None:
            await resp.write(encode.sse(chunk))
    last = [0.0]
    seen_first = [False] * len(choices)
    try:
        merged = echo_share.streamed(env.req, _merge(streams))  # n > 1: one choice scored
        async for i, msg in event_replies.with_pings(merged, resp, lambda: event_replies.SSE_PING):
            _timing(series, t0, last, msg)
            check_finish(msg, state.request_secs)
            encode.with_stop_str(env.req, msg)
            chunk = encode.delta_chunk(env, choices[i], msg, first=not seen_first[i])
            encode.add_delta(choices[i], msg, streamed=True)
            if chunk is not None:
                seen_first[i] = True
                await resp.write(encode.sse(chunk))
        if any(c.finish_reason is None for c in choices):
            raise UpstreamFailed("the neuron failed mid-stream: it ended the stream without "
                                 "finishing")
    except (grpc.aio.AioRpcError, UpstreamFailed, UpstreamLost) as e:
        err = mid_stream_error(e)
        state.log.warning("request.upstream_failed", req_id=req_id, model=env.model,
                          detail=err.message)
        await resp.write(encode.sse(err.body()))
        await resp.write_eof()
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away: handle() logs it
    except Exception:  # a bug of ours after the 200 went out: end the stream with an error
        state.log.exception("request.stream_failed", req_id=req_id, model=env.model)
        err = ApiError(500, "internal error; the router's log has the details",
                       code="internal_error")
        await resp.write(encode.sse(err.body()))
        await resp.write_eof()
        return resp
    if env.req.include_usage:
        await resp.write(encode.sse(encode.usage_chunk(env, choices)))
    await resp.write(encode.SSE_DONE)
    await resp.write_eof()
    return resp
