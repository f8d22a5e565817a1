"""OpenAI response encoding: neuron `GenerateResponse` deltas → JSON bodies and SSE chunks.

Chat and completions differ only in the shape of a choice (`message`/`delta`
vs `text`) and of logprobs (`{"content": [...]}` vs the legacy parallel
lists). `return_token_ids` adds `prompt_token_ids` (top level) and
per-choice `token_ids`, as vLLM does; usage carries
`prompt_tokens_details.cached_tokens`. A completion's `echo` starts its text
with the prompt; with `logprobs` the prompt's tokens start its logprobs
(completion_logprobs.py), and a stream sends both with the first generated
token (the neuron's message that has them), as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from helexa.proto import neuron_pb2 as pb
from helexa.router import completion_logprobs
from helexa.router.agent_output import OutputParser, Parts
from helexa.router.completion_logprobs import JSON, each
from helexa.router.openai_api import ParsedRequest
from helexa.router.tool_parsers import whole_calls

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass
class Choice:
    """What one choice has produced so far (accumulated for non-streaming replies)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: pb.Usage | None = None
    prompt_token_ids: list[int] | None = None
    text_chars: int = 0  # for completions' text_offset
    num_tokens: int = 0  # tokens so far (a streamed choice keeps no token_ids)
    parser: OutputParser | None = None  # chat: splits thought, answer and tool calls
    prompt_tokens: int = 0  # from the first neuron message (continuous usage)
    prompt_index: int = 0  # completions batch: which prompt this choice continues
    echo: str = ""  # completions' echo: the prompt text that starts the choice's text
    # ... and with logprobs its tokens' (the neuron's prompt_logprobs), first in them; a
    # stream sends the echo with them (echo_due until then)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    echo_due: bool = False
    num_calls: int = 0  # tool calls streamed so far
    thought_open: bool = False  # the prompt opened a thought (the neuron said so)


@dataclass(frozen=True)
class Envelope:
    """The fields every body of one reply shares."""

    id: str
    created: int
    model: str
    req: ParsedRequest

    @property
    def chat(self) -> bool:
        return self.req.kind == "chat"


def usage_dict(choices: list[Choice]) -> dict[str, Any]:
    """Usage summed over choices; the prompt is counted once (as OpenAI does for n > 1)."""
    done = [c.usage for c in choices if c.usage is not None]
    # each prompt of a batch counts once, however many choices continue it
    by_prompt: dict[int, tuple[int, int]] = {}
    for c in choices:
        if c.usage is not None:
            p, k = by_prompt.get(c.prompt_index, (0, 0))
            by_prompt[c.prompt_index] = (max(p, c.usage.prompt_tokens),
                                         max(k, c.usage.cached_tokens))
    prompt = sum(p for p, _ in by_prompt.values())
    cached = sum(k for _, k in by_prompt.values())
    completion = sum(u.completion_tokens for u in done)
    reasoning = sum(u.reasoning_tokens for u in done)
    # speculation (docs/speculation.md): drafts the model kept, and drafts it rejected
    accepted = sum(u.accepted_draft_tokens for u in done)
    rejected = sum(u.draft_tokens - u.accepted_draft_tokens for u in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning,
                                          "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def _entry(t: pb.TokenLogprob | pb.TopLogprob) -> dict[str, Any]:
    # the token's own bytes, from the neuron: its text may hold U+FFFD for a split character
    raw = t.token_bytes or t.token.encode("utf-8")
    return {"token": t.token, "logprob": t.logprob, "bytes": list(raw)}


def chat_entry(t: pb.TokenLogprob) -> dict[str, Any]:
    """One token's logprob as chat's `logprobs.content` entry (and Responses' output_text
    `logprobs`): token, logprob, bytes and its `top_logprobs`."""
    return {**_entry(t), "top_logprobs": [_entry(a) for a in t.top]}


def _chat_logprobs(lps: list[pb.TokenLogprob]) -> dict[str, Any]:
    return {"content": [chat_entry(t) for t in lps]}


def _logprobs(env: Envelope, lps: list[pb.TokenLogprob], offset: int,
              prompt: list[pb.TokenLogprob] | None = None) -> dict[str, Any] | None:
    if not env.req.logprobs:
        return None
    return _chat_logprobs(lps) if env.chat else completion_logprobs.as_dict(lps, offset, prompt)


@dataclass
class WholeLogprobs:
    """A non-streaming choice's logprobs, written as `_logprobs` would give them straight
    into the reply's one buffer by `json_body`, a token at a time."""

    chat: bool
    lps: list[pb.TokenLogprob]
    prompt: list[pb.TokenLogprob] = field(default_factory=list)  # an echo's, first
    offset: int = 0  # where the generated text begins in the choice's (after an echo)

    def write(self, buf: bytearray) -> None:
        if not self.chat:
            completion_logprobs.write(buf, self.lps, self.offset, self.prompt)
            return
        buf += b'{"content":'
        each(buf, self.lps, chat_entry)
        buf += b"}"


def json_body(obj: Any, buf: bytearray | None = None) -> bytearray:
    """`obj` (full_body's reply) as JSON in one buffer, its WholeLogprobs written in place:
    with a dict for each logprob entry of every token at once, or each choice's JSON apart
    from the reply's, the router held several times the reply (n 16, top_logprobs 20, 4,000
    tokens each: 81 MB of JSON, 680 MB more memory; docs/http.md)."""
    buf = bytearray() if buf is None else buf
    if isinstance(obj, WholeLogprobs):
        obj.write(buf)
    elif isinstance(obj, dict):
        buf += b"{"
        for i, (key, value) in enumerate(obj.items()):
            if i:
                buf += b","
            JSON.encode_into(key, buf, -1)
            buf += b":"
            json_body(value, buf)
        buf += b"}"
    elif isinstance(obj, list) and obj and isinstance(obj[0], dict):  # the choices
        buf += b"["
        for i, item in enumerate(obj):
            if i:
                buf += b","
            json_body(item, buf)
        buf += b"]"
    else:
        JSON.encode_into(obj, buf, -1)
    return buf


def with_stop_str(req: ParsedRequest, msg: pb.GenerateResponse) -> pb.GenerateResponse:
    """vLLM's include_stop_str_in_output: the stop string that ended the text ends it."""
    if req.include_stop_str and msg.finish_reason == pb.FINISH_REASON_STOP and \
            msg.stop_reason in req.stop:
        msg.text += msg.stop_reason
    return msg


def add_delta(choice: Choice, msg: pb.GenerateResponse, *, streamed: bool = False) -> None:
    """Fold one neuron message into a choice's running totals (after `delta_chunk`). A
    streamed choice has sent its token ids and logprobs already and keeps neither: with
    `top_logprobs: 20` they were ~2 KB a token, megabytes held per stream."""
    choice.text.append(msg.text)
    choice.prompt_tokens = choice.prompt_tokens or msg.prompt_tokens
    choice.thought_open = choice.thought_open or msg.thought_open
    choice.text_chars += len(msg.text)
    choice.num_tokens += len(msg.token_ids)
    if not streamed:
        choice.token_ids.extend(msg.token_ids)
        choice.logprobs.extend(msg.logprobs)
        choice.prompt_logprobs.extend(msg.prompt_logprobs)
    if msg.prompt_token_ids:
        choice.prompt_token_ids = list(msg.prompt_token_ids)
    if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        choice.finish_reason = FINISH_REASONS.get(msg.finish_reason)
        choice.stop_reason = msg.stop_reason or None
        choice.usage = msg.usage


# The tier that served a chat completion, named in its reply as OpenAI's names it: one here,
# whatever `service_tier` asked for (docs/api.md, "Chat and completions: shared fields").
SERVICE_TIER = "default"


def full_body(env: Envelope, choices: list[Choice]) -> dict[str, Any]:
    """The non-streaming reply, for json_body (its logprobs are WholeLogprobs)."""
    out_choices = []
    for c in choices:
        text = "".join(c.text)
        body: dict[str, Any] = {"index": c.index}
        finish = c.finish_reason
        if env.chat:
            body["message"] = {"role": "assistant", "content": text}
            if c.parser is not None:
                if c.thought_open:
                    c.parser.thought_opened()
                # fed whole, with the end: a call the reply leaves open is text
                parts, rest = Parts(), c.parser.finish(text)
                body["message"], finish = chat_message(parts, rest, finish)
        else:
            body["text"] = c.echo + text
        body["logprobs"] = WholeLogprobs(env.chat, c.logprobs, c.prompt_logprobs,
                                         len(c.echo)) if env.req.logprobs else None
        body["finish_reason"] = finish
        body["stop_reason"] = c.stop_reason
        if env.req.return_token_ids:
            body["token_ids"] = c.token_ids
        out_choices.append(body)
    reply: dict[str, Any] = {
             "id": env.id, "object": "chat.completion" if env.chat else "text_completion",
             "created": env.created, "model": env.model, "choices": out_choices,
             "usage": usage_dict(choices)}
    if env.chat:
        reply["service_tier"] = SERVICE_TIER
    if env.req.return_token_ids:
        reply["prompt_token_ids"] = choices[0].prompt_token_ids if choices else None
    return reply


def chat_message(a: Parts, b: Parts, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole assistant message from its parsed parts, and its finish reason."""
    content = a.content + b.content
    calls = whole_calls(a.calls + b.calls)
    msg: dict[str, Any] = {"role": "assistant",
                           "content": content if content or not calls else None}
    reasoning = a.reasoning + b.reasoning
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}}
                             for c in calls]
        if finish == "stop":
            finish = "tool_calls"
    return msg, finish


def _chunk(env: Envelope, choices: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
           with_usage_key: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {
             "id": env.id, "object": "chat.completion.chunk" if env.chat else "text_completion",
             "created": env.created, "model": env.model, "choices": choices}
    if env.chat:
        chunk["service_tier"] = SERVICE_TIER
    if with_usage_key:
        chunk["usage"] = usage  # OpenAI sends `usage: null` on every chunk but the last
    return chunk


def first_chunk(env: Envelope, choice: Choice) -> dict[str, Any] | None:
    """Chat opens each choice with the assistant role; completions have no such chunk
    unless they echo the prompt."""
    if not env.chat:
        if env.req.echo and env.req.logprobs:  # sent with the prompt's logprobs: delta_chunk
            choice.echo_due = True
            return None
        if not choice.echo:
            return None
        return _chunk(env, [{"index": choice.index, "text": choice.echo, "logprobs": None,
                             "finish_reason": None}], with_usage_key=env.req.include_usage)
    body = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}
    return _chunk(env, [body], with_usage_key=env.req.include_usage)


def delta_chunk(env: Envelope, choice: Choice, msg: pb.GenerateResponse,
                first: bool) -> dict[str, Any] | None:
    """One SSE chunk for one neuron message (None when it carries nothing to say)."""
    finish = (FINISH_REASONS.get(msg.finish_reason)
              if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED else None)
    if msg.thought_open and choice.parser is not None:  # (said on the first message, often
        choice.parser.thought_opened()  # one with nothing else: the admission's)
    echo, echoed = "", None
    if choice.echo_due and (msg.prompt_logprobs or finish is not None):  # the prompt's, now
        echo, echoed, choice.echo_due = choice.echo, list(msg.prompt_logprobs), False
    if not msg.text and not msg.token_ids and finish is None and echoed is None:
        return None  # (a first message's prompt ids then ride on the next chunk)
    body: dict[str, Any] = {"index": choice.index}
    if env.chat and choice.parser is not None:
        parts = choice.parser.feed(msg.text)
        if finish is not None:
            rest = choice.parser.finish()
            parts = Parts(parts.reasoning + rest.reasoning, parts.content + rest.content,
                          parts.calls + rest.calls)
        body["delta"] = _parts_delta(choice, parts)
        if finish == "stop" and choice.num_calls:
            finish = "tool_calls"
        if not body["delta"] and finish is None and not env.req.return_token_ids \
                and not env.req.logprobs:
            return None  # held back: a marker may be starting
    elif env.chat:
        body["delta"] = {"content": msg.text} if msg.text or finish is None else {}
    else:
        body["text"] = echo + msg.text
    body["logprobs"] = _logprobs(env, list(msg.logprobs), len(choice.echo) + choice.text_chars,
                                 echoed)
    body["finish_reason"] = finish
    if finish is not None:
        body["stop_reason"] = msg.stop_reason or None
    if env.req.return_token_ids:
        body["token_ids"] = list(msg.token_ids)
    chunk = _chunk(env, [body], with_usage_key=env.req.include_usage)
    if env.req.continuous_usage:  # vLLM: the counts so far on every chunk
        prompt = choice.prompt_tokens or msg.prompt_tokens
        done = choice.num_tokens + len(msg.token_ids)
        chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                          "total_tokens": prompt + done}
    if env.req.return_token_ids and first:
        chunk["prompt_token_ids"] = list(msg.prompt_token_ids) or choice.prompt_token_ids
    return chunk


def _parts_delta(choice: Choice, parts: Parts) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parts.reasoning:
        delta["reasoning_content"] = parts.reasoning
    if parts.content:
        delta["content"] = parts.content
    if parts.calls:
        delta["tool_calls"] = []
        for c in parts.calls:
            entry: dict[str, Any] = {"index": c.index}
            if c.id is not None:  # a call's first piece: who it calls
                entry.update(id=c.id, type="function")
                entry["function"] = {"name": c.name, "arguments": c.arguments}
                choice.num_calls += 1
            else:
                entry["function"] = {"arguments": c.arguments}
            delta["tool_calls"].append(entry)
    return delta


def usage_chunk(env: Envelope, choices: list[Choice]) -> dict[str, Any]:
    """The extra last chunk `stream_options.include_usage` asks for."""
    return _chunk(env, [], usage=usage_dict(choices), with_usage_key=True)


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
