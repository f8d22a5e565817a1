"""Responses API replies built from a neuron's messages (router/responses_encode.py)."""

from __future__ import annotations

import json
import time

from helexa.proto import neuron_pb2 as pb
from helexa.router.agent_output import OutputParser
from helexa.router.openai_api import ParsedRequest
from helexa.router.responses_encode import ResponseEncoder

TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def whole(text: str, tool_choice: str = "auto") -> dict:
    req = ParsedRequest(kind="responses", model="m", tools=TOOLS, tool_choice=tool_choice)
    forced = tool_choice == "required"
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(tool_mode="hermes", forced=forced))
    return enc.whole(pb.GenerateResponse(
        text=text, finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=3, completion_tokens=9)))


def test_a_call_cut_short_in_a_reply_that_did_not_stream_is_text_as_in_chat():
    # docs/api.md: a reply that does not stream never has a half call (chat and
    # Anthropic read it so); codex would otherwise get arguments that are not JSON
    text = 'Sure.\n<tool_call>\n{"name": "w", "arguments": {"city": "Pa'
    out = whole(text)["output"]
    assert [o["type"] for o in out] == ["message"]
    assert out[0]["content"][0]["text"] == text


def test_a_forced_call_cut_short_is_still_a_call():
    out = whole('<tool_call>\n{"name": "w", "arguments": {"city": "Pa', "required")["output"]
    assert [(o["type"], o["name"], o["arguments"]) for o in out] == [
        ("function_call", "w", '{"city": "Pa')]


def streamed(text: str, step: int) -> dict:
    req = ParsedRequest(kind="responses", model="m", tools=TOOLS, tool_choice="auto")
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(tool_mode="hermes"))
    enc.start()
    for i in range(0, len(text), step):
        enc.feed(pb.GenerateResponse(text=text[i:i + step]))
    enc.feed(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP,
                                 usage=pb.Usage(prompt_tokens=3, completion_tokens=9)))
    return enc.response("completed")


def test_items_come_in_the_order_the_model_wrote_them_whole_or_streamed():
    # docs/api.md: output items in the order the model wrote them, text after a call
    # after it, in a reply that did not stream as in one that did
    text = ('Let me check.\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\nDone.')
    req = ParsedRequest(kind="responses", model="m", tools=TOOLS, tool_choice="auto")
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(tool_mode="hermes"))
    out = enc.whole(pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP,
                                        usage=pb.Usage(prompt_tokens=3, completion_tokens=9)))
    def shape(r: dict) -> list:  # (a gap's newlines aside: a stream drops them)
        return [(o["type"], (o.get("arguments") or o["content"][0]["text"]).strip())
                for o in r["output"]]
    assert shape(out) == [("message", "Let me check."),
                          ("function_call", '{"city": "Oslo"}'), ("message", "Done.")]
    for step in (1, 3, 7):
        assert shape(streamed(text, step)) == shape(out)


NOTE = {"type": "custom", "name": "note", "description": "n"}


def test_a_message_spanning_a_call_keeps_the_order_the_model_wrote():
    # One neuron message may hold text, a whole call and more text (coalesced deltas, a
    # speculative step's accepted run): the stream's items are still message, call,
    # message, as in the reply that did not stream, however the text is cut.
    from helexa.router import responses_api
    from helexa.router.agent_output import parser_for

    text = ('Before.<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '\nAfter.<tool_call>\n{"name": "note", "arguments": {"input": "x"}}\n</tool_call>'
            'End.')
    body = {"model": "m", "input": "hi", "stream": True, "tools": [
        {"type": "function", "name": "w", "parameters": TOOLS[0]["function"]["parameters"]},
        NOTE]}
    req = responses_api.parse_request(json.dumps(body).encode())

    def shape(r: dict) -> list:
        return [(o["type"], (o.get("arguments") or o.get("input") or
                             o["content"][0]["text"]).strip()) for o in r["output"]]

    done = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP,
                               usage=pb.Usage(prompt_tokens=3, completion_tokens=9))
    whole = shape(ResponseEncoder("r", "m", req, parser_for(req, "hermes", "")).whole(
        pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP)))
    assert [k for k, _ in whole] == ["message", "function_call", "message",
                                     "custom_tool_call", "message"]
    for cuts in [(), *[(i,) for i in range(1, len(text))]]:  # one message, or two anywhere
        enc = ResponseEncoder("r", "m", req, parser_for(req, "hermes", ""))
        enc.start()
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:], strict=False):
            enc.feed(pb.GenerateResponse(text=text[a:b]))
        enc.feed(done)
        assert shape(enc.response("completed")) == whole, cuts


def test_every_event_validates_against_the_openai_sdks_types():
    # The SDK's types are the contract clients are typed against (openai 3.63): usage's
    # input_tokens_details.cache_write_tokens is required, response.failed's error.code is
    # one of OpenAI's, and a reasoning item comes with no part until its *_part.added (a
    # client that folds both would hold the part twice).
    import typing

    from openai.types.responses import ResponseStreamEvent

    from helexa.router import responses_api
    from helexa.router.agent_output import parser_for
    from helexa.router.errors import ApiError

    union = typing.get_args(ResponseStreamEvent)[0]  # Annotated[Union[...], discriminator]
    kinds = {typing.get_args(c.model_fields["type"].annotation)[0]: c
             for c in typing.get_args(union)}

    def check(ev: dict) -> None:  # the event's own type, strictly: its errors name fields
        kinds[ev["type"]].model_validate(ev)
    for summary in (None, "auto"):
        body = {"model": "m", "input": "hi", "stream": True, "tools": [{
            "type": "function", "name": "w", "parameters": TOOLS[0]["function"]["parameters"]}],
            "reasoning": {"effort": "max", **({"summary": summary} if summary else {})}}
        req = responses_api.parse_request(json.dumps(body).encode())
        assert req.reasoning_effort == "high"
        ends = [lambda e: e.feed(pb.GenerateResponse(
                    finish_reason=pb.FINISH_REASON_STOP,
                    usage=pb.Usage(prompt_tokens=3, completion_tokens=9, cached_tokens=2))),
                lambda e: e.failed(ApiError(502, "the neuron failed mid-stream: x",
                                            code="upstream_error"))]
        for end in ends:
            enc = ResponseEncoder("resp_1", "m", req, parser_for(req, "hermes", "think"))
            raw = enc.start() + enc.ping() + enc.feed(pb.GenerateResponse(
                text='<think>Hm.</think>Sure.<tool_call>\n{"name": "w", "arguments": '
                     '{"city": "Oslo"}}\n</tool_call>')) + end(enc)
            events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                      if line.startswith("data: ")]
            for ev in events:
                check(ev)
            added = next(e["item"] for e in events if e["type"] == "response.output_item.added")
            assert added["type"] == "reasoning" and added["summary"] == [] == added["content"]
            last = events[-1]["response"]
            if last["status"] == "failed":
                assert last["error"]["code"] == "server_error"
                assert last["error"]["message"].startswith("upstream_error: the neuron failed")
            else:
                assert last["usage"]["input_tokens_details"]["cached_tokens"] == 2


def test_the_response_repeats_the_settings_as_the_client_sent_them():
    # R2: tools came back strict false when sent true, text.format strict true when sent
    # false, instructions null when sent; OpenAI's response object repeats them as sent
    from helexa.router import responses_api

    params = {"type": "object", "properties": {}, "additionalProperties": False}
    sent = {"model": "m", "input": "hi", "instructions": "be terse", "user": "u1",
            "metadata": {"k": "v"}, "reasoning": {"effort": "minimal", "summary": "concise"},
            "tools": [{"type": "function", "name": "f", "parameters": params, "strict": True},
                      {"type": "function", "name": "g", "parameters": params}],
            "text": {"format": {"type": "json_schema", "name": "s", "strict": False,
                                "schema": {"type": "object"}}}}
    req = responses_api.parse_request(json.dumps(sent).encode())
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(tool_mode="hermes"))
    r = enc.whole(pb.GenerateResponse(text="{}", finish_reason=pb.FINISH_REASON_STOP,
                                      usage=pb.Usage(prompt_tokens=3, completion_tokens=1)))
    assert [(t["name"], t["strict"]) for t in r["tools"]] == [("f", True), ("g", None)]
    assert r["text"]["format"] == {"type": "json_schema", "name": "s", "strict": False,
                                   "schema": {"type": "object"}, "description": None}
    assert (r["instructions"], r["user"], r["metadata"]) == ("be terse", "u1", {"k": "v"})
    assert r["reasoning"] == {"effort": "minimal", "summary": "concise"}
    bare = responses_api.parse_request(b'{"model": "m", "input": "hi"}')
    r = ResponseEncoder("resp_2", "m", bare, None).response("completed")
    assert (r["instructions"], r["text"], r["tools"], r["metadata"]) == (
        None, {"format": {"type": "text"}}, [], {})


def test_stream_events_count_from_zero_as_openais():
    req = ParsedRequest(kind="responses", model="m")
    enc = ResponseEncoder("resp_1", "m", req, None)
    events = [json.loads(line[6:]) for line in (enc.start() + enc.feed(pb.GenerateResponse(
        text="hi", finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))).decode().split("\n")
        if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_output_text_logprobs_are_the_answer_tokens_whole_or_streamed():
    # docs/api.md: with include message.output_text.logprobs, an output_text's logprobs are
    # the tokens that wrote it: not the thought's, a call's, or the markers between; a
    # character split over two tokens (é: two bytes) goes with both, whole or streamed
    def tok(raw: bytes, lp: float) -> pb.TokenLogprob:
        return pb.TokenLogprob(token=raw.decode("utf-8", "replace"), token_bytes=raw,
                               logprob=lp, top=[pb.TopLogprob(token="x", logprob=-9.0)])
    pieces = [b"<think>", b"hm", b"</think>", b"\n\n", b"Caf", b"\xc3", b"\xa9", b" <", b"b>",
              b"<tool_call>", b'\n{"name": "w", "arguments": {}}\n', b"</tool_call>", b"\nOk"]
    tokens = [tok(raw, -i / 10) for i, raw in enumerate(pieces)]
    text = b"".join(pieces).decode()
    # the two messages' tokens (the last one's newline is the call's: its text is "Ok")
    answer = [[b"Caf", b"\xc3", b"\xa9", b" <", b"b>"], [b"\nOk"]]
    req = ParsedRequest(kind="responses", model="m", tools=TOOLS, tool_choice="auto",
                        logprobs=True, top_logprobs=1)

    def logprobs(r: dict) -> list[list[bytes]]:
        return [[bytes(t["bytes"]) for t in o["content"][0]["logprobs"]]
                for o in r["output"] if o["type"] == "message"]
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(reasoning_parser="think",
                                                           tool_mode="hermes"))
    r = enc.whole(pb.GenerateResponse(text=text, logprobs=tokens,
                                      finish_reason=pb.FINISH_REASON_STOP,
                                      usage=pb.Usage(prompt_tokens=3, completion_tokens=9)))
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call",
                                                "message"]
    assert logprobs(r) == answer
    assert r["output"][1]["content"][0]["logprobs"][0]["top_logprobs"] == [
        {"token": "x", "logprob": -9.0, "bytes": [120]}]
    enc = ResponseEncoder("resp_1", "m", req, OutputParser(reasoning_parser="think",
                                                           tool_mode="hermes"))
    enc.start()
    # a token a message, its text as the neuron sends it: a split character's first byte
    # held back, sent whole with its second
    said = {b"\xc3": "", b"\xa9": "é"}
    msgs = [pb.GenerateResponse(text=said.get(t.token_bytes, t.token), logprobs=[t])
            for t in tokens]
    msgs.append(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))
    assert "".join(m.text for m in msgs) == text
    events = [json.loads(e.split(b"data: ", 1)[1]) for m in msgs
              for e in enc.feed(m).split(b"\n\n") if e]
    deltas = [[bytes(t["bytes"]) for t in e["logprobs"]] for e in events
              if e["type"] == "response.output_text.delta"]
    assert [b for d in deltas for b in d] == [b for a in answer for b in a]
    assert logprobs(events[-1]["response"]) == answer


def test_a_whole_reply_costs_in_proportion_to_its_length():
    """A model may write anything: 8,000 `<tool_call>` never closed were 4.4 s of CPU (a regex
    split that scanned to the end again from each), 24,000 calls read as text 1.1 s (each
    piece copied the message's text so far); now 0.06 s at most. The bound leaves room on a
    loaded machine and is still far under either."""
    plain = ParsedRequest(kind="responses", model="m")
    call = '<tool_call>{"name": "w", "arguments": {"city": "x"}}</tool_call>'
    for text in ("<tool_call>" * 8000, call * 24000):
        enc = ResponseEncoder("resp_1", "m", plain, OutputParser(reasoning_parser="think"))
        reply = pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP)
        t0 = time.thread_time()  # this thread's own CPU: other processes do not count
        out = enc.whole(reply)
        secs = time.thread_time() - t0
        assert [o["content"][0]["text"] for o in out["output"]] == [text]  # as written
        assert secs < 0.3, f"{len(text)} characters took {secs:.2f} s of CPU"
