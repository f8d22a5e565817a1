"""Folding a Generate stream into Complete's one message."""

from __future__ import annotations

from helexa.proto import neuron_pb2 as pb
from helexa.responses import merge_responses


def lp(token_id: int) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, token=f"t{token_id}", logprob=-0.5,
                           top=[pb.TopLogprob(token_id=token_id, token=f"t{token_id}")])


def test_merge_concatenates_deltas_and_takes_the_end_from_the_last_message():
    stream = [
        pb.GenerateResponse(prompt_token_ids=[1, 2, 3]),  # prompt ids before any token
        pb.GenerateResponse(text="Hel", token_ids=[7, 8], logprobs=[lp(7), lp(8)]),
        pb.GenerateResponse(text="lo", token_ids=[9], logprobs=[lp(9)]),
        pb.GenerateResponse(text="!", finish_reason=pb.FINISH_REASON_STOP, stop_reason="END",
                            usage=pb.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=2,
                                           prefill_ms=1.5, decode_ms=2.5, queue_ms=0.5)),
    ]
    got = merge_responses(stream)
    assert got == pb.GenerateResponse(
        text="Hello!", token_ids=[7, 8, 9], logprobs=[lp(7), lp(8), lp(9)],
        prompt_token_ids=[1, 2, 3], finish_reason=pb.FINISH_REASON_STOP, stop_reason="END",
        usage=stream[-1].usage)
    assert stream[1].text == "Hel"  # the inputs are left as they were


def test_merge_of_one_message_is_that_message_and_of_none_is_empty():
    one = pb.GenerateResponse(text="a", token_ids=[1], finish_reason=pb.FINISH_REASON_LENGTH)
    assert merge_responses([one]) is one
    assert merge_responses([]) == pb.GenerateResponse()


def test_an_unfinished_stream_merges_to_an_unfinished_message():
    got = merge_responses([pb.GenerateResponse(text="a", token_ids=[1]),
                           pb.GenerateResponse(text="b", token_ids=[2])])
    assert got.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not got.HasField("usage")
    assert (got.text, list(got.token_ids)) == ("ab", [1, 2])


def test_merge_keeps_the_prompts_text_and_logprobs():
    """An echo's: the prompt's text (first message) and its tokens' logprobs (the message
    of the first token) reach Complete's caller too."""
    got = merge_responses([
        pb.GenerateResponse(prompt_text="the sea", prompt_tokens=2),
        pb.GenerateResponse(text="!", token_ids=[9], prompt_logprobs=[lp(1), lp(2)]),
        pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)])
    assert got.prompt_text == "the sea"
    assert list(got.prompt_logprobs) == [lp(1), lp(2)] and list(got.token_ids) == [9]
