"""Anthropic Messages replies: a neuron's deltas as a `message` body or its event stream.

Content blocks come from the parsed parts of the output (agent_output.py):
`thinking` (with an empty signature: there is nothing to sign here),
`text`, and `tool_use` (input as an object). Stop reasons: `end_turn`,
`stop_sequence` (with the sequence), `max_tokens`, `tool_use`. Streaming
opens a block when its first piece arrives (a thought the prompt opened: at
admission, docs/api.md, "`POST /v1/messages` (Anthropic)") and closes it when
another kind starts or the message ends: message_start, then per block
content_block_start / content_block_delta (text_delta, thinking_delta,
input_json_delta; a thinking block's last is its signature_delta) /
content_block_stop, then message_delta (stop reason, usage) and message_stop; a
stream that fails ends with an `error` event.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from helexa.proto import neuron_pb2 as pb
from helexa.router.agent_output import OutputParser, Parts
from helexa.router.anthropic_errors import error_body
from helexa.router.errors import ApiError
from helexa.router.json_depth import json_depth_error
from helexa.router.tool_parsers import whole_calls

_STOP: dict[int, str] = {pb.FINISH_REASON_STOP: "end_turn", pb.FINISH_REASON_LENGTH: "max_tokens"}
_EMPTY_DELTA: dict[str, dict[str, str]] = {"thinking": {"type": "thinking_delta", "thinking": ""},
                                          "text": {"type": "text_delta", "text": ""}}


def message_id() -> str:
    return "msg_" + os.urandom(12).hex()


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    """A call's arguments as tool_use's `input`: {} where they are no JSON, or nest deeper
    than a body may (json_depth.py: reading or writing them again would overflow)."""
    if json_depth_error(arguments.encode()) is not None:
        return {}
    try:
        return json.loads(arguments, strict=False)
    except ValueError:
        return {}


def stop_reason(finish: int, stop_reason: str, stop: list[str], calls: int
                ) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) for a finished reply."""
    if finish == pb.FINISH_REASON_STOP and stop_reason in stop:
        return "stop_sequence", stop_reason
    if calls and finish == pb.FINISH_REASON_STOP:
        return "tool_use", None
    return _STOP.get(finish), None


def usage(u: pb.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens}


def full_message(msg_id: str, model: str, reply: pb.GenerateResponse,
                 parser: OutputParser | None, stop: list[str]) -> dict[str, Any]:
    """The non-streaming reply."""
    parts = Parts(content=reply.text)
    if parser is not None:
        if reply.thought_open:
            parser.thought_opened()
        a, b = Parts(), parser.finish(reply.text)  # whole: a call it leaves open is text
        parts = Parts(a.reasoning + b.reasoning, a.content + b.content, a.calls + b.calls)
    calls = whole_calls(parts.calls)
    content: list[dict[str, Any]] = []
    if parts.reasoning:
        content.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
    if parts.content:
        content.append({"type": "text", "text": parts.content})
    content += [{"type": "tool_use", "id": tool_use_id(c["id"]), "name": c["name"],
                 "input": _input(c["arguments"])} for c in calls]
    reason, seq = stop_reason(reply.finish_reason, reply.stop_reason, stop, len(calls))
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(reply.usage)}


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class StreamEncoder:
    """Anthropic's event sequence for one reply, fed the neuron's messages in order."""

    def __init__(self, msg_id: str, model: str, parser: OutputParser | None,
                 stop: list[str]) -> None:
        self.msg_id, self.model, self.parser, self.stop = msg_id, model, parser, stop
        self.index = -1  # the open block's index
        self.kind: str | None = None  # the open block's type
        self.calls = 0

    # The first neuron message's counts, for message_start (the usage message_delta says).
    prompt_tokens = cached_tokens = 0

    def start(self) -> bytes:
        return event("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(pb.Usage(prompt_tokens=self.prompt_tokens,
                                    cached_tokens=self.cached_tokens))}})

    def whole(self, reply: pb.GenerateResponse) -> dict[str, Any]:
        """The non-streaming reply."""
        return full_message(self.msg_id, self.model, reply, self.parser, self.stop)

    def ping(self) -> bytes:
        """A keep-alive while the neuron is silent: inside a thinking or text block, an empty
        delta of it, else Anthropic's own `ping` event. Claude Code (2.1.197) skips `ping`
        when it resets its stream watchdog (300 s, `CLAUDE_STREAM_IDLE_TIMEOUT_MS`), so a
        prefill longer than that inside a thought would be dropped and started over."""
        if self.kind in _EMPTY_DELTA:
            return self._delta(_EMPTY_DELTA[self.kind])
        return event("ping", {"type": "ping"})

    def failed(self, err: ApiError) -> bytes:
        """The last event of a stream that failed: Anthropic's `error` event."""
        return self._close() + event("error", error_body(err))

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.kind = kind
        return out + event("content_block_start", {"type": "content_block_start",
                                                   "index": self.index, "content_block": block})

    def _close(self) -> bytes:
        if self.kind is None:
            return b""
        out = b""
        if self.kind == "thinking":  # a thought's end carries its (empty) signature
            out = self._delta({"type": "signature_delta", "signature": ""})
        self.kind = None
        return out + event("content_block_stop", {"type": "content_block_stop",
                                                  "index": self.index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": delta})

    def _parts(self, parts: Parts) -> bytes:
        out = b""
        if parts.reasoning:
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": parts.reasoning})
        if parts.content:
            if self.kind != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": parts.content})
        for c in parts.calls:
            if c.id is not None:  # a call's first piece opens its block
                self.calls += 1
                out += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(c.id),
                                               "name": c.name, "input": {}})
            if c.arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": c.arguments})
        return out

    def feed(self, msg: pb.GenerateResponse) -> bytes:
        """The events one neuron message makes (the closing ones included on the last)."""
        out = b""
        if self.parser is None:
            pieces = [Parts(content=msg.text)]
        else:
            if msg.thought_open:
                self.parser.thought_opened()
                if self.parser.phase == "thinking" and self.kind is None:
                    # the thought is open from admission on: its block opens now, so the
                    # prefill's keep-alives are its deltas (ping())
                    out = self._open("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
            pieces = self.parser.feed_in_order(msg.text)  # a call, then text after it
        out += b"".join([self._parts(p) for p in pieces])
        if msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return out
        if self.parser is not None:
            out += self._parts(self.parser.finish())
        out += self._close()
        reason, seq = stop_reason(msg.finish_reason, msg.stop_reason, self.stop, self.calls)
        out += event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": usage(msg.usage)})
        return out + event("message_stop", {"type": "message_stop"})
