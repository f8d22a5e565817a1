"""Anthropic Messages event streams built from a neuron's messages (anthropic_encode.py)."""

from __future__ import annotations

import json

import pytest

from helexa.proto import neuron_pb2 as pb
from helexa.router.agent_output import OutputParser
from helexa.router.anthropic_encode import StreamEncoder


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
