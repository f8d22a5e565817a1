"""The gRPC edge toward neurons: build a GenerateRequest, call the neuron.

A neuron refuses before any token, with a gRPC status and trailing metadata that
rpc_errors.py's `map_rpc_error` turns into the client's error (docs/errors.md's table).
Streaming requests use `open_generate`, which returns only once the first message has
arrived, so a refusal is seen before the router commits to an HTTP status. Non-streaming
requests use `complete`: the unary Complete RPC (a stream costs more gRPC CPU on both
ends), whose one reply is the whole answer, so every error of such a call, a refusal or a
failure, arrives before any byte went to the client.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc
from helexa.responses import merge_responses
from helexa.router import agent_request
from helexa.router.inflight import Flight, UpstreamLost
from helexa.router.openai_api import ParsedRequest
from helexa.router.rpc_errors import RETRYABLE

Metadata = tuple[tuple[str, str], ...]  # gRPC call metadata: (key, value) pairs


def generate_request(req: ParsedRequest, *, model: str, principal: str, req_id: str,
                     deadline_unix_ms: int, choice: int = 0) -> pb.GenerateRequest:
    """The GenerateRequest for one choice of a parsed request (its grammars compiled)."""
    assert not req.compiles, "ParsedRequest.compile() first"
    # top_p 0 keeps the smallest set holding none of the mass, the top token alone: greedy
    # decoding (OpenAI takes 0; on the wire 0 means unset, so it is sent as temperature 0)
    greedy = req.top_p == 0
    sampling = pb.SamplingParams(
        temperature=0.0 if greedy else 1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None or greedy else req.top_p,
        top_k=req.top_k or 0, min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty or 1.0,
        logprobs=req.logprobs, top_logprobs=req.top_logprobs)
    if req.seed is not None:
        sampling.seed = _choice_seed(req.seed, choice)
    g = pb.GenerateRequest(
        req_id=req_id, model=model, principal=principal, sampling=sampling, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        deadline_unix_ms=deadline_unix_ms, return_prompt_token_ids=req.return_token_ids)
    if req.max_tokens is not None:
        g.max_tokens = req.max_tokens
        g.fit_max_tokens = req.fit_max_tokens
    if req.echo:  # completions: the prompt's text where the router has none to index
        g.return_prompt_text = asks_prompt_text(req)
        if req.logprobs:
            g.sampling.prompt_logprobs = req.top_logprobs
    if req.tool_choice in ("required", "function"):  # the neuron writes the model's format
        g.constraint.tool_choice.SetInParent()
        g.constraint.tool_choice.function = req.tool_name or ""
        g.constraint.tool_choice.parallel = req.parallel_tool_calls
    elif agent_request.calls_or_answer(req):  # the neuron writes the calls' side
        assert req.constraint is not None
        g.constraint.calls_or_answer.parallel = req.parallel_tool_calls
        g.constraint.calls_or_answer.answer_schema = \
            req.constraint.source if req.constraint.kind == "json_schema" else ""
    elif req.constraint is not None:
        if req.constraint.kind == "json_object":
            g.constraint.json_object = True
        else:
            setattr(g.constraint, req.constraint.kind, req.constraint.source)
    g.reasoning_effort = req.reasoning_effort
    if req.thinking_budget_tokens is not None:
        g.thinking_budget_tokens = req.thinking_budget_tokens
    if req.messages is not None:
        g.chat.CopyFrom(chat_proto(req))
    elif req.prompt_ids is not None:
        g.token_ids.ids.extend(req.prompt_ids)
    else:
        g.text = req.prompt_text or ""
    return g


def asks_prompt_text(req: ParsedRequest) -> bool:
    """An echo whose text the neuron gives (GenerateResponse.prompt_text): a prompt of token
    ids (the router has no tokenizer), or one whose logprobs come back, their text_offset
    indexing that text."""
    return req.echo and (req.prompt_ids is not None or req.logprobs)


def _choice_seed(seed: int, choice: int) -> int:
    """Choices of one seeded request differ from each other yet stay reproducible."""
    return (seed + choice + 2**63) % 2**64 - 2**63


def generate_requests(prompts: list[ParsedRequest], n: int, *, model: str, principal: str,
                      req_id: str, deadline_unix_ms: int) -> list[pb.GenerateRequest]:
    """Every choice's GenerateRequest: `n` for each prompt, the k-th prompt's i-th choice
    named `{req_id}-{k * n + i}` (just `req_id` when there is one). Building the messages grows
    with them (200,000 turns took 0.6 s), so serve.py runs this on its work pool, off the
    loop that carries every stream; a prompt's choices copy its first one's message, less
    its prompt logprobs (an echo's, asked once a prompt: echo_share.py)."""
    one = len(prompts) * n == 1
    out: list[pb.GenerateRequest] = []
    for k, sub in enumerate(prompts):
        first = generate_request(sub, model=model, principal=principal,
                                 req_id=req_id if one else f"{req_id}-{k * n}",
                                 deadline_unix_ms=deadline_unix_ms, choice=0)
        out.append(first)
        for i in range(1, n):
            g = pb.GenerateRequest()
            g.CopyFrom(first)
            g.req_id = f"{req_id}-{k * n + i}"
            g.sampling.ClearField("prompt_logprobs")  # the first choice's serve all (echo_share)
            if sub.seed is not None:
                g.sampling.seed = _choice_seed(sub.seed, i)
            out.append(g)
    return out


def chat_proto(req: ParsedRequest) -> pb.Chat:
    """The chat messages, tools and template variables, as the neuron's template takes them."""
    chat = pb.Chat(messages=[pb.ChatMessage(
        role=t.role, content=t.content, tool_calls_json=t.tool_calls_json,
        tool_call_id=t.tool_call_id, name=t.name, reasoning_content=t.reasoning,
        parts=[pb.ContentPart(text=x) if isinstance(x, str)
               else pb.ContentPart(image=pb.Image(data=x.data)) for x in t.parts or []])
        for t in req.messages or []])
    if req.tools and req.tool_choice != "none":
        chat.tools_json = json.dumps(req.prompt_tools())
    if req.template_kwargs:
        chat.template_kwargs_json = json.dumps(req.template_kwargs)
    chat.continue_final_message = req.continue_final  # a prefill: the reply continues it
    return chat


# Set on a stream's first message only: a resumed stream's new first message loses them.
_FIRST_ONLY = ("thought_open", "prompt_tokens", "fitted_max_tokens", "cached_tokens",
               "prompt_token_ids", "prefill_started", "prompt_text")
# What the client saw of the first message, which a resumed stream's must repeat.
_AGREE = ("prompt_tokens", "thought_open", "fitted_max_tokens", "prompt_token_ids",
          "prompt_text")


def has_output(msg: pb.GenerateResponse) -> bool:
    """The message brings the client something generated (or the end)."""
    return bool(msg.token_ids or msg.text or msg.logprobs
                or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED)


def resumable(err: Exception) -> bool:
    """A lost neuron (the router ended its call, or the call broke with a status another
    neuron may well not answer: RETRYABLE, UNAVAILABLE for a neuron that died), not
    the engine's failure: the request may run elsewhere while nothing was generated."""
    return isinstance(err, UpstreamLost) or (
        isinstance(err, grpc.aio.AioRpcError) and err.code() in RETRYABLE)


# (the lost stream, why, whether a retry is left): the new stream, or UpstreamLost
Resume = Callable[["OpenStream", Exception, bool], Awaitable["OpenStream"]]


@dataclass
class OpenStream:
    """A Generate call whose first message has arrived; iterate it for the rest.

    Until a message with output came (only the admission's and prefill_started's did), a
    neuron lost (`resumable`) is not the client's failure: `resume` (set by the dispatcher)
    counts and logs the loss and, once, opens the request on the next neuron, and the
    stream goes on over that call, the new first message's fields the client already has
    left out."""

    neuron: str
    call: grpc.aio.UnaryStreamCall
    first: pb.GenerateResponse
    flight: Flight
    finished: bool = False  # the finish message arrived: nothing left to abort
    resume: Resume | None = None
    delivered: bool = False  # a message with output went out: no resume past this
    resumed: bool = False  # its one retry is used (a refusal at the open, or a resume)
    # Read ahead (`read_ahead`): messages read, not yet taken, and the task reading them.
    ahead: deque[pb.GenerateResponse] = field(default_factory=deque)
    reader: asyncio.Task[None] | None = None
    reading_ahead: bool = False

    def read_ahead(self) -> None:
        """Read the messages into memory as they come, however many, until
        `stop_reading_ahead`: while the sibling choices of an `n > 1` request wait to be
        admitted (serve.py), unread this call would fill its gRPC window and the neuron
        pause it, holding the KV they may wait for. Bounded by the reply itself (its
        max_tokens), and in time by the siblings' admission (kv_max_wait_secs)."""
        self.reading_ahead = True
        self.reader = asyncio.get_running_loop().create_task(self._read_ahead())
        self.reader.add_done_callback(_retrieved)  # messages() or cancel() takes the error

    def stop_reading_ahead(self) -> None:
        """Stop after the read in flight (cancelling it would abort the call); `messages`
        takes what was read first, then reads as its consumer does."""
        self.reading_ahead = False

    async def _read_ahead(self) -> None:
        msg = self.first
        while msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED and self.reading_ahead:
            self.flight.reading()
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            self.flight.heard(msg)
            self.ahead.append(msg)
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finished = True  # it no longer runs on the neuron
            self.flight.ended()

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """The messages; raises UpstreamLost when the router ended the call (inflight.py).
        Those read ahead come first; then it reads one at a time, as its consumer takes
        them, so a consumer that stops stops the reads (and the neuron: flow control). A
        neuron lost before any output was taken is the dispatcher's to resume (_resumed)."""
        msg: pb.GenerateResponse | None = self.first
        while True:
            if msg is not None:
                last = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if last:  # (a read ahead may have seen it already: the end is this one)
                    self.finished = True
                    self.flight.ended()
                self.delivered = self.delivered or has_output(msg)
                yield msg
                if last:
                    return
            try:
                if not self.ahead and (reader := self.reader) is not None:
                    self.reader, self.reading_ahead = None, False
                    if not reader.done():  # its read in flight is the router's ask now:
                        self.flight.reading()  # the neuron's silence from here counts
                    await reader  # its read in flight, if any, brings one more
                if self.ahead:  # read, unsent: the wait for them is the client's
                    self.flight.reading(read=False)
                    msg = self.ahead.popleft()
                    continue
                self.flight.reading()
                read = await self.call.read()
            except asyncio.CancelledError:
                if (lost := self.flight.lost()) is None:
                    raise
                msg = await self._resumed(lost)
                continue
            except grpc.aio.AioRpcError as e:
                msg = await self._resumed(e)
                continue
            if read is grpc.aio.EOF:
                return
            self.flight.heard(read)
            msg = read

    async def _resumed(self, err: Exception) -> pb.GenerateResponse | None:
        """Go on over a call on another neuron, returning its first message as a next one
        (None when it holds nothing new), or raise err: output went out already, or the
        error is the engine's; or UpstreamLost when the retry is used (the loss counted
        and logged by `resume` all the same)."""
        if self.delivered or self.resume is None or not resumable(err):
            raise err from None
        self.cancel()  # a no-op for a call the router ended or that broke
        self.flight.ended()  # it runs there no more: the registry counts it out
        self.reader, self.reading_ahead = None, False  # (`ahead` is empty: taken first)
        new = await self.resume(self, err, not self.resumed)
        self.resumed = True
        if differ := [f for f in _AGREE if getattr(new.first, f) != getattr(self.first, f)]:
            new.cancel()
            new.flight.ended()
            raise UpstreamLost(f"{err_detail(err)}; neuron {new.neuron}, which took the "
                               f"request over, disagrees on {', '.join(differ)}")
        self.neuron, self.call, self.flight = new.neuron, new.call, new.flight
        msg = pb.GenerateResponse()
        msg.CopyFrom(new.first)
        for f in _FIRST_ONLY:
            msg.ClearField(f)
        return msg if has_output(msg) else None

    def cancel(self) -> None:
        """Abort on the neuron, unless it already finished (its status then arrives on its
        own; cancelling would only cost both sides a RST_STREAM)."""
        if self.reader is not None:
            self.reader.cancel()
        if not self.finished and not self.call.done():
            self.call.cancel()


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # raised again where it is awaited; never "never retrieved"


def err_detail(e: BaseException) -> str:
    """What a failed call says: its status's details, or the exception's text."""
    if isinstance(e, grpc.aio.AioRpcError):
        return str(e.details() or e.code().name)
    return str(e)


class UpstreamClosed(Exception):
    """The neuron ended the stream without a finish message."""


async def open_generate(stub: neuron_pb2_grpc.NeuronStub, neuron: str,
                        greq: pb.GenerateRequest, *, metadata: Metadata,
                        timeout_secs: float, flight: Flight) -> OpenStream:
    """Start Generate and wait for its first message; raises AioRpcError on a refusal,
    UpstreamLost when the router ended the call."""
    call = flight.call = stub.Generate(greq, metadata=metadata, timeout=timeout_secs)
    try:
        first = await call.read()
    except asyncio.CancelledError:
        call.cancel()
        if (lost := flight.lost()) is not None:
            raise lost from None
        raise
    except BaseException:
        call.cancel()
        raise
    if first is grpc.aio.EOF:
        call.cancel()
        raise UpstreamClosed(f"neuron {neuron} closed the stream before any message")
    flight.heard(first)
    return OpenStream(neuron, call, first, flight)


@dataclass
class Completed:
    """A Complete call's reply: one choice's whole answer."""

    neuron: str
    reply: pb.GenerateResponse

    def cancel(self) -> None:
        """Nothing to abort: the call is over (the same interface as OpenStream)."""


async def complete(stub: neuron_pb2_grpc.NeuronStub, neuron: str, greq: pb.GenerateRequest,
                   *, metadata: Metadata, timeout_secs: float, flight: Flight) -> Completed:
    """Complete on one neuron; raises AioRpcError on a refusal or failure, UpstreamLost when
    the router ended the call. A neuron older than Complete (UNIMPLEMENTED) is asked with
    Generate instead and its stream merged."""
    try:
        try:
            flight.call = stub.Complete(greq, metadata=metadata, timeout=timeout_secs)
            reply = await flight.call
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            call = flight.call = stub.Generate(greq, metadata=metadata, timeout=timeout_secs)
            try:
                reply = merge_responses([m async for m in call])
            finally:
                call.cancel()  # a no-op once it ended; aborts it on the neuron if we were cancelled
    except asyncio.CancelledError:
        if (lost := flight.lost()) is not None:
            raise lost from None
        raise
    return Completed(neuron, reply)
