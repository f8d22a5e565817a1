"""Responses API replies: a neuron's deltas as a `response` object or its event stream.

Output items come from the parsed parts of the output (agent_output.py), in
the order the model wrote them: `reasoning` (the thought, as `content`
`reasoning_text`, or as a `summary_text` summary when `reasoning.summary`
asked for one: the thought is returned whole either way), `message`
(`output_text`), `function_call` (`call_id`, `name`, `arguments`), or for
a custom tool `custom_tool_call` (`call_id`, `name`, `input`: the text the
call's `input` argument holds, custom_tools.py). The
status is `completed`, or `incomplete` with `incomplete_details.reason:
max_output_tokens` when the output budget ran out. Streaming sends
response.created and response.in_progress, then per item
response.output_item.added, its part and delta events
(response.reasoning_text.delta or response.reasoning_summary_text.delta,
response.output_text.delta, response.function_call_arguments.delta,
response.custom_tool_call_input.delta as the input's string decodes) and
their .done events (an output_text's carry its tokens' logprobs where
`include` asked for them: responses_logprobs.py), response.output_item.done, and last
response.completed or response.incomplete; a neuron failing mid-stream ends
it with response.failed. Every event carries its `sequence_number`. While
the neuron is silent (a long prompt's prefill) response.in_progress comes
again as the keep-alive (event_replies.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from helexa.proto import neuron_pb2 as pb
from helexa.router import custom_tools
from helexa.router.agent_output import OutputParser, Parts
from helexa.router.errors import ApiError
from helexa.router.openai_api import ParsedRequest
from helexa.router.responses_logprobs import Token, Tokens
from helexa.router.tool_parsers import CALL_CLOSE, CALL_OPEN


def response_id() -> str:
    return "resp_" + os.urandom(12).hex()


def _item_id(prefix: str) -> str:
    return f"{prefix}_" + os.urandom(12).hex()


def usage(u: pb.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": 0},  # the SDK's types require it
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponseEncoder:
    """One reply's output items, built from the neuron's messages in order; `whole` gives
    the non-streaming body, `start` / `feed` / `failed` the event stream."""

    def __init__(self, resp_id: str, model: str, req: ParsedRequest,
                 parser: OutputParser | None) -> None:
        self.id, self.model, self.req, self.parser = resp_id, model, req, parser
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # a call piece's index -> its item
        # a custom call's item id -> its arguments as they stream, decoded as they come
        self.arguments: dict[str, custom_tools.PartialInput] = {}
        self.seq = 0
        self.texts: list[str] = []  # the open item's text not yet joined into its part
        self.tokens = Tokens() if req.logprobs else None  # the answer's logprobs, asked for

    # ------------------------------------------------------------------ the response object

    def response(self, status: str, u: pb.Usage | None = None,
                 error: ApiError | None = None) -> dict[str, Any]:
        r, sent = self.req, self.req.echoed  # sent: settings as the client sent them
        strict = sent.get("strict", {})
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": self.items,
            # OpenAI's codes for a failed response are a closed set (the SDK's types): ours is
            # `server_error` there, helexa's own code heads the message
            "error": None if error is None else {"code": "server_error",
                                                 "message": f"{error.code}: {error.message}"},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": sent.get("instructions"), "metadata": sent.get("metadata", {}),
            "parallel_tool_calls": r.parallel_tool_calls,
            "temperature": r.temperature, "top_p": r.top_p, "max_output_tokens": r.max_tokens,
            "tool_choice": r.tool_choice if r.tool_choice != "function"
            else {"type": "custom" if r.tool_name in r.custom_tools else "function",
                  "name": r.tool_name},
            "tools": [r.custom_tools.get(t["function"]["name"]) or {
                "type": "function", "name": t["function"]["name"],
                "description": t["function"].get("description"),
                "parameters": t["function"]["parameters"],
                "strict": strict.get(t["function"]["name"])} for t in r.tools],
            "reasoning": sent.get("reasoning", {"effort": None, "summary": None}),
            "text": {"format": sent.get("format", {"type": "text"})}, "store": False,
            "previous_response_id": None, "truncation": "disabled",
            "user": sent.get("user"), "usage": usage(u) if u is not None else None,
            # the tier that served it: the one there is (OpenAI's name for the standard one)
            "service_tier": "default", "prompt_cache_key": sent.get("prompt_cache_key"),
            "safety_identifier": sent.get("safety_identifier"),
            "max_tool_calls": sent.get("max_tool_calls"),
            "top_logprobs": sent.get("top_logprobs", 0)}

    def whole(self, reply: pb.GenerateResponse) -> dict[str, Any]:
        """The non-streaming body: the text fed a call at a time, so the items keep the
        order the model wrote them in; the last piece goes with the end, as chat reads a
        whole reply (a call it leaves open is text, unless the choice was forced)."""
        if self.parser is None or self.tokens is not None:
            self._feed(reply, final=True, whole=True)
        else:
            if reply.thought_open:
                self.parser.thought_opened()
            *pieces, last = _at_calls(reply.text)
            for piece in pieces:
                self._parts(self.parser.feed(piece))
            self._parts(self.parser.finish(last))
        status = _status(reply.finish_reason)
        self._close(last=status)
        return self.response(status, reply.usage)

    # ------------------------------------------------------------------ events

    def _event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}  # from 0, as OpenAI's
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"

    def start(self) -> bytes:
        r = self.response("in_progress")
        return self._event("response.created", response=r) + \
            self._event("response.in_progress", response=r)

    def feed(self, msg: pb.GenerateResponse) -> bytes:
        """The events of one neuron message (the closing ones on the last)."""
        final = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        out = self._feed(msg, final)
        if not final:
            return out
        status = _status(msg.finish_reason)
        out += self._close(stream=True, last=status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self.response(status, msg.usage))

    def ping(self) -> bytes:
        """A keep-alive while the neuron is silent: `response.in_progress` again, the
        response as it stands. An event, not an SSE comment: codex's idle timer (and any
        client's that runs per event) never sees a comment, and the SDKs take the repeat."""
        self._join_text()
        r = self.response("in_progress")
        r["output"] = [{**i, "status": "in_progress"} if i is self.open else i
                       for i in self.items]
        return self._event("response.in_progress", response=r)

    def failed(self, err: ApiError) -> bytes:
        """The last event of a stream whose neuron failed."""
        return self._close(stream=True, last="incomplete") + self._event(
            "response.failed", response=self.response("failed", error=err))

    # ------------------------------------------------------------------ building items

    def _feed(self, msg: pb.GenerateResponse, final: bool, whole: bool = False) -> bytes:
        """The events of one message's text, in the order it was written (a call, then
        text after it: OutputParser.feed_in_order); with logprobs asked for, a token's text
        at a time (responses_logprobs.py). whole: the reply that did not stream, whose
        call left open at its end is text (whole()), the items built without events."""
        stream = not whole
        cuts: list[tuple[str, list[Token]]] = [(msg.text, [])]
        if self.tokens is not None and whole and self.parser is not None:
            *calls, end = _at_calls(msg.text)  # its last piece goes whole with the end
            cuts = self.tokens.pieces("".join(calls), msg.logprobs)
            cuts.append((end, [t for _, ts in self.tokens.pieces(end, []) for t in ts]))
        elif self.tokens is not None:
            cuts = self.tokens.pieces(msg.text, msg.logprobs)
        if self.parser is None:
            return b"".join([self._parts(Parts(content=text), stream, lps) for text, lps in cuts])
        if msg.thought_open:
            self.parser.thought_opened()
        out = b""
        for i, (text, lps) in enumerate(cuts):
            if whole and final and i == len(cuts) - 1:
                out += self._parts(self.parser.finish(text), stream, lps)
                break
            *pieces, last = self.parser.feed_in_order(text)
            if final and i == len(cuts) - 1:
                rest = self.parser.finish()
                last = Parts(last.reasoning + rest.reasoning, last.content + rest.content,
                             last.calls + rest.calls)
            for j, p in enumerate([*pieces, last]):
                out += self._parts(p, stream, lps if j == 0 else [])
        return out

    def _begin(self, item: dict[str, Any], stream: bool) -> bytes:
        out = self._close(stream)
        self.open = item
        self.items.append(item)
        if not stream:
            return out
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):  # its part comes with *_part.added
            added["content"] = []
        if item["type"] == "reasoning":
            added["summary"] = []
        out += self._event("response.output_item.added", output_index=len(self.items) - 1,
                           item=added)
        part = self._part_of(item)
        if part is not None:
            out += self._event(part[0] + ".added", **self._where(), part={**part[1], "text": ""},
                               **part[2])
        return out

    def _part_of(self, item: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, int]] | None:
        """(event prefix, the part, its index fields) of an item's one text part."""
        if item["type"] == "message":
            return "response.content_part", item["content"][0], {"content_index": 0}
        if item["type"] == "reasoning" and self.req.reasoning_summary:
            return "response.reasoning_summary_part", item["summary"][0], {"summary_index": 0}
        if item["type"] == "reasoning":
            return "response.content_part", item["content"][0], {"content_index": 0}
        return None

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _close(self, stream: bool = False, last: str = "completed") -> bytes:
        """Close the open item; last: the response's status when this is its last item (one
        the output budget cut is `incomplete`, as OpenAI marks it)."""
        self._join_text()
        item, self.open = self.open, None
        if item is None:
            return b""
        item["status"] = "incomplete" if last == "incomplete" else "completed"
        rest = self._finish_input(item) if item["type"] == "custom_tool_call" else ""
        if not stream:
            return b""
        self.open = item  # for _where
        out = b""
        part = self._part_of(item)
        if item["type"] == "message":
            out += self._event("response.output_text.done", **self._where(), content_index=0,
                               text=part[1]["text"] if part else "",
                               logprobs=part[1]["logprobs"] if part else [])
        elif item["type"] == "reasoning" and part is not None:
            name = ("response.reasoning_summary_text.done" if self.req.reasoning_summary
                    else "response.reasoning_text.done")
            out += self._event(name, **self._where(), text=part[1]["text"], **part[2])
        elif item["type"] == "function_call":
            out += self._event("response.function_call_arguments.done", **self._where(),
                               name=item["name"], arguments=item["arguments"])
        elif item["type"] == "custom_tool_call":
            if rest:
                out += self._event("response.custom_tool_call_input.delta", **self._where(),
                                   delta=rest)
            out += self._event("response.custom_tool_call_input.done", **self._where(),
                               input=item["input"])
        if part is not None:
            out += self._event(part[0] + ".done", **self._where(), part=part[1], **part[2])
        out += self._event("response.output_item.done", output_index=len(self.items) - 1,
                           item=item)
        self.open = None
        return out

    def _parts(self, parts: Parts, stream: bool = False, lps: list[Token] | None = None
               ) -> bytes:
        """The items and events of one feed's parts; lps: the tokens that feed brought."""
        logprobs: list[dict[str, Any]] = []
        if self.tokens is not None:
            self.tokens.pending += lps or []
            logprobs = self.tokens.take(parts)
        out = b""
        if parts.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                text_part = {"type": "summary_text" if self.req.reasoning_summary
                             else "reasoning_text", "text": ""}
                item: dict[str, Any] = {"type": "reasoning", "id": _item_id("rs"),
                                        "summary": [], "content": [],
                                        "encrypted_content": None}
                item["summary" if self.req.reasoning_summary else "content"] = [text_part]
                out += self._begin(item, stream)
            out += self._text(parts.reasoning, stream)
        if parts.content:
            if self.open is None or self.open["type"] != "message":
                out += self._begin({"type": "message", "id": _item_id("msg"),
                                    "role": "assistant", "content": [
                                        {"type": "output_text", "text": "", "annotations": [],
                                         "logprobs": []}]}, stream)
            out += self._text(parts.content, stream, logprobs)
        for c in parts.calls:
            if c.id is not None:
                self.calls[c.index] = {"type": "function_call", "id": _item_id("fc"),
                                       "call_id": c.id, "name": c.name or "", "arguments": ""}
                if c.name in self.req.custom_tools:
                    self.calls[c.index] = {"type": "custom_tool_call", "id": _item_id("ctc"),
                                           "call_id": c.id, "name": c.name, "input": ""}
                    self.arguments[self.calls[c.index]["id"]] = custom_tools.PartialInput()
                out += self._begin(self.calls[c.index], stream)
            call = self.calls.get(c.index)
            if call is not None and c.arguments and call["type"] == "custom_tool_call":
                out += self._custom_input(call, c.arguments, stream)
            elif call is not None and c.arguments:
                call["arguments"] += c.arguments
                if stream and call is self.open:
                    out += self._event("response.function_call_arguments.delta",
                                       **self._where(), delta=c.arguments)
        return out

    def _join_text(self) -> None:
        """The open item's text part whole (its pieces so far joined)."""
        part = self._part_of(self.open) if self.open is not None else None
        if part is not None and self.texts:
            part[1]["text"] += "".join(self.texts)
        self.texts.clear()

    def _custom_input(self, call: dict[str, Any], arguments: str, stream: bool) -> bytes:
        """A custom call's arguments so far; its input grows by what of the `input` string
        they decode to (a delta event while it streams)."""
        decoding = self.arguments[call["id"]]
        delta = decoding.feed(arguments)
        if delta:
            call["input"] = decoding.decoded()
        if not (delta and stream and call is self.open):
            return b""
        return self._event("response.custom_tool_call_input.delta", **self._where(),
                           delta=delta)

    def _finish_input(self, item: dict[str, Any]) -> str:
        """Set a closing custom call's whole input (custom_tools.input_of); return what of
        it did not stream yet (nothing when it does not extend what streamed)."""
        decoding = self.arguments.pop(item["id"], None)
        whole = custom_tools.input_of(decoding.text if decoding is not None else "")
        rest = whole[len(item["input"]):] if whole.startswith(item["input"]) else ""
        item["input"] = whole
        return rest

    def _text(self, text: str, stream: bool, logprobs: list[dict[str, Any]] | None = None
              ) -> bytes:
        assert self.open is not None
        part = self._part_of(self.open)
        assert part is not None
        self.texts.append(text)  # joined at the item's end: `+=` copied it all each time
        if logprobs:
            part[1]["logprobs"] += logprobs
        if not stream:
            return b""
        if self.open["type"] == "message":
            return self._event("response.output_text.delta", **self._where(), content_index=0,
                               delta=text, logprobs=logprobs or [])
        name = ("response.reasoning_summary_text.delta" if self.req.reasoning_summary
                else "response.reasoning_text.delta")
        return self._event(name, **self._where(), delta=text, **part[2])


def _at_calls(text: str) -> list[str]:
    """text cut before each call's opening tag and after the first closing one after it;
    from an opening with none after it, the rest is one piece. One pass: a regex's lazy
    match scanned to the end again from each unclosed opening (88,000 characters of
    `<tool_call>` were 4 s of CPU)."""
    pieces, start = [], 0
    while (i := text.find(CALL_OPEN, start)) >= 0:
        j = text.find(CALL_CLOSE, i + len(CALL_OPEN))
        if j < 0:
            break
        pieces += [text[start:i], text[i:j + len(CALL_CLOSE)]]
        start = j + len(CALL_CLOSE)
    pieces.append(text[start:])
    return [p for p in pieces if p] or [""]


def _status(finish: int) -> str:
    return "incomplete" if finish == pb.FINISH_REASON_LENGTH else "completed"
