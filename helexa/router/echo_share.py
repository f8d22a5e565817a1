"""The prompt logprobs of an `n > 1` completion that echoes its prompt with logprobs, asked
of the neuron once a prompt: they are the same for every choice (the prompt's, not the
choice's), and scoring them costs each call a prefill that keeps every row's logits (the
neuron's helexa/neuron/engine/prompt_logprobs.py), so forward.generate_requests asks for
them on each prompt's first choice alone and its siblings prefill as any request does.
Here every sibling is given the first choice's entries, so each choice's reply is as it
would be had it scored them itself: the whole reply's (`whole`), and the stream's
(`streamed`: a sibling's messages wait until its prompt's entries have come, which the
neuron sends on the message that ends the first choice's prefill, then its first one
carries them, so its first chunk is the echo with them as the first choice's is)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from helexa.proto import neuron_pb2 as pb
from helexa.router.openai_api import ParsedRequest


def shared(req: ParsedRequest) -> bool:
    """The request's choices share their prompt's logprobs: an echo with logprobs, n > 1."""
    return req.echo and req.logprobs and req.n > 1


def whole(req: ParsedRequest, replies: list[pb.GenerateResponse]) -> None:
    """Every sibling's reply given its prompt's first choice's entries (replies in choice
    order: the k-th prompt's i-th choice is k * n + i)."""
    if not shared(req):
        return
    for k in range(0, len(replies), req.n):
        for sibling in replies[k + 1:k + req.n]:
            if not sibling.prompt_logprobs:
                sibling.prompt_logprobs.extend(replies[k].prompt_logprobs)


async def streamed(req: ParsedRequest, messages: AsyncIterator[tuple[int, pb.GenerateResponse]]
                   ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """`messages` (choice index, message), a sibling's held until its prompt's first choice
    has sent the prompt's entries (or finished without them: it ended before its prefill
    did, and so do they go without), its first then carrying them."""
    if not shared(req):
        async for item in messages:
            yield item
        return
    n = req.n
    got: dict[int, list[pb.TokenLogprob]] = {}  # prompt -> its entries, once they came
    held: dict[int, list[pb.GenerateResponse]] = {}  # sibling -> its messages until then
    given: set[int] = set()  # siblings that have been given them

    def release(i: int, msgs: list[pb.GenerateResponse]) -> list[tuple[int, pb.GenerateResponse]]:
        if msgs and i not in given:
            given.add(i)
            msgs[0].prompt_logprobs.extend(got[i // n])
        return [(i, m) for m in msgs]

    async for i, msg in messages:
        k = i // n
        if i % n == 0:
            yield i, msg
            if k not in got and (msg.prompt_logprobs
                                 or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED):
                got[k] = list(msg.prompt_logprobs)
                for j in range(i + 1, i + n):
                    for item in release(j, held.pop(j, [])):
                        yield item
        elif k in got:
            for item in release(i, [msg]):
                yield item
        else:
            held.setdefault(i, []).append(msg)
    for i, msgs in sorted(held.items()):  # (the stream ended: what was held, as it came)
        for m in msgs:
            yield i, m
