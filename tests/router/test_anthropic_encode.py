"""Anthropic Messages event streams built from a neuron's messages (anthropic_encode.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helexa.proto import neuron_pb2 as pb
from helexa.router import anthropic
from helexa.router.agent_output import OutputParser
from helexa.router.anthropic_encode import StreamEncoder, full_message


def events(texts: list[str], finish: int, tool_mode: str = "none") -> list[dict]:
    enc = StreamEncoder("msg_1", "m", OutputParser(reasoning_parser="think",
                                                   tool_mode=tool_mode), [])
    raw = b"".join(enc.feed(pb.GenerateResponse(text=t)) for t in texts) + enc.feed(
        pb.GenerateResponse(finish_reason=finish, usage=pb.Usage(completion_tokens=9)))
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ")]


@pytest.mark.parametrize("after", [
    "Hi.",  # a text block
    '<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',  # a tool_use block
    "",  # nothing: max_tokens ended the thought
])
def test_every_thinking_block_ends_with_its_signature(after):
    # Anthropic sends a signature_delta before each thinking block's content_block_stop
    # (docs/api.md lists it among the deltas)
    finish = pb.FINISH_REASON_LENGTH if not after else pb.FINISH_REASON_STOP
    evs = events(["<think>hm", "m</think>\n\n", after], finish, tool_mode="hermes")
    stop = next(i for i, e in enumerate(evs) if e["type"] == "content_block_stop")
    assert evs[stop]["index"] == 0
    assert evs[stop - 1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert sum(e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"
               for e in evs) == 1


# A hermes call as models write it: raw newlines and tabs inside the arguments' strings.
WRITE = ('<tool_call>\n{"name": "Write", "arguments": {"file_path": "a.go", '
         '"content": "func f() {\n\treturn\n}"}}\n</tool_call>')
WRITTEN = {"file_path": "a.go", "content": "func f() {\n\treturn\n}"}


def sdk_final(raw: bytes) -> Any:
    """The message the anthropic SDK's stream accumulator makes of the events."""
    from anthropic._models import construct_type  # not at collection: support/lazy_import.py
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import RawMessageStreamEvent

    snap, bufs = None, {}
    for chunk in raw.decode().split("\n\n"):
        if chunk.strip():
            data = json.loads(chunk.split("\ndata: ", 1)[1])
            snap = accumulate_event(event=construct_type(type_=RawMessageStreamEvent,
                                                         value=data),
                                    current_snapshot=snap, json_bufs=bufs)
    return snap


def test_a_call_with_raw_newlines_keeps_its_input_whole_and_streams_json_the_sdk_reads():
    r = pb.GenerateResponse(text=WRITE, finish_reason=pb.FINISH_REASON_STOP)
    assert full_message("msg", "m", r, OutputParser(tool_mode="hermes"), [])[
        "content"][0]["input"] == WRITTEN
    enc = StreamEncoder("msg", "m", OutputParser(tool_mode="hermes"), [])
    out = enc.start() + enc.feed(pb.GenerateResponse(text=WRITE[:50])) + enc.feed(
        pb.GenerateResponse(text=WRITE[50:], finish_reason=pb.FINISH_REASON_STOP))
    assert sdk_final(out).content[0].input == WRITTEN  # the SDK's jiter refuses raw ones


def test_string_arguments_come_back_as_an_object_the_next_request_takes():
    text = '<tool_call>\n{"name": "Read", "arguments": "{\\"file_path\\": \\"a.py\\"}"}\n</tool_call>'
    r = pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP)
    block = full_message("msg", "m", r, OutputParser(tool_mode="hermes"), [])["content"][0]
    assert block["input"] == {"file_path": "a.py"}
    body = {"model": "m", "max_tokens": 9, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                      "content": "x"}]}]}
    anthropic.parse_request(json.dumps(body).encode())  # a string input would be a 400


def test_text_after_a_call_in_the_same_message_follows_its_tool_use_block():
    # one neuron message may hold a whole call and text after it (coalesced deltas): each
    # delta goes to its own block, in the order written, whatever the cut
    text = ('Let me look.<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\nDone.')
    for cut in range(0, len(text)):
        evs = events([text[:cut], text[cut:]], pb.FINISH_REASON_STOP, tool_mode="hermes")
        kinds = {e["index"]: e["content_block"]["type"] for e in evs
                 if e["type"] == "content_block_start"}
        assert list(kinds.values()) == ["text", "tool_use", "text"], cut
        deltas = [(kinds[e["index"]], e["delta"]) for e in evs
                  if e["type"] == "content_block_delta"]
        assert all((k == "tool_use") == (d["type"] == "input_json_delta") for k, d in deltas)
        assert json.loads("".join(d["partial_json"] for k, d in deltas if k == "tool_use")) \
            == {"city": "Oslo"}


@pytest.mark.parametrize("depth", [129, 2000])
def test_a_calls_arguments_nested_too_deep_are_an_empty_input_not_a_500(depth):
    # a forced call's arguments go out as written; tool_use's `input` reads them, and reads
    # nothing where they nest past a body's limit (json_depth.py), as where they are no JSON
    text = '{"a":' * depth + "1" + "}" * depth
    r = pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP)
    msg = full_message("msg", "m", r, OutputParser(tool_mode="json_args", tool_name="f"), [])
    assert [(b["type"], b["name"], b["input"]) for b in msg["content"]] == [
        ("tool_use", "f", {})]
    json.dumps(msg)  # the reply can be written


def test_a_silent_prefill_inside_an_open_thought_keeps_claude_code_waiting():
    # Claude Code 2.1.197 resets its 300 s stream watchdog on every event but `ping`: a
    # prefill longer than that with only pings was dropped and started over (seen live, a
    # 47k-token prompt on the tiny model). The neuron says at admission that the prompt
    # opened a thought; its block opens then, and the keep-alives are its empty deltas.
    enc = StreamEncoder("msg", "m", OutputParser(reasoning_parser="think"), [])
    raw = enc.start() + enc.feed(pb.GenerateResponse(thought_open=True, prompt_tokens=9))
    raw += enc.ping() + enc.ping()  # the prefill
    raw += enc.feed(pb.GenerateResponse(text="hm</think>\n\nHi."))
    raw += enc.ping()  # a pause inside the answer
    raw += enc.feed(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP))
    evs = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert "ping" not in [e["type"] for e in evs]
    assert [e["type"] for e in evs[:4]] == ["message_start", "content_block_start",
                                            "content_block_delta", "content_block_delta"]
    assert evs[2]["delta"] == {"type": "thinking_delta", "thinking": ""}
    final = sdk_final(raw)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", "hm"), ("text", "Hi.")]


def test_a_silent_prefill_with_no_thought_open_sends_pings():
    enc = StreamEncoder("msg", "m", OutputParser(reasoning_parser="think"), [])
    raw = enc.start() + enc.feed(pb.GenerateResponse(prompt_tokens=9)) + enc.ping()
    assert raw.endswith(b'event: ping\ndata: {"type":"ping"}\n\n')
    enc = StreamEncoder("msg", "m", OutputParser(), [])  # a model with no thought
    raw = enc.feed(pb.GenerateResponse(thought_open=True, prompt_tokens=9)) + enc.ping()
    assert raw == b'event: ping\ndata: {"type":"ping"}\n\n'
