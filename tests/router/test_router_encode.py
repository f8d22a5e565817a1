"""router.encode: OpenAI logprobs from the neuron's messages."""

from __future__ import annotations

from helexa.proto import neuron_pb2 as pb
from helexa.router.encode import _chat_logprobs


def test_chat_logprobs_bytes_are_the_tokens_own_bytes():
    # "ż" is c5 bc: a byte-level model may emit it as two tokens, each shown as U+FFFD
    lps = [pb.TokenLogprob(token_id=1, token="\ufffd", token_bytes=b"\xc5", logprob=-0.5,
                           top=[pb.TopLogprob(token_id=2, token="\ufffd", token_bytes=b"\xc4",
                                              logprob=-1.0)]),
           pb.TokenLogprob(token_id=3, token="\ufffd", token_bytes=b"\xbc", logprob=-0.1),
           pb.TokenLogprob(token_id=4, token=" hi", logprob=-0.2)]  # an older neuron: no bytes
    content = _chat_logprobs(lps)["content"]
    assert [c["bytes"] for c in content] == [[0xC5], [0xBC], list(b" hi")]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "ż"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xC4]
