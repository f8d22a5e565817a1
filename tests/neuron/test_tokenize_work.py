"""TokenizeGate: a Tokenize call is held to generation's per-principal caps (the model's
max_per_principal, anonymous callers together anon_max_in_flight) and to
server.max_tokenize_bytes, each refusal naming its cap; a place comes back when the pool
is done with the call, also when its caller left first."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from helexa.neuron.engine import messages as m
from helexa.neuron.tokenize_work import TokenizeGate
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal


class BlockingTokenizer:
    vocab_size = 100

    def __init__(self) -> None:
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert self.release.wait(10)
        return [1] * len(text)


def model(max_per_principal: int = 2, anon: int = 1) -> SimpleNamespace:
    return SimpleNamespace(tokenizer=BlockingTokenizer(), limits=None,
                           admission=m.Limits(max_per_principal=max_per_principal,
                                              anon_max_in_flight=anon))


def call(principal: str, text: str = "abc") -> pb.TokenizeRequest:
    return pb.TokenizeRequest(model="tiny", text=text, principal=principal)


def test_a_principal_past_max_per_principal_is_refused_others_are_not():
    async def run() -> None:
        gate, r = TokenizeGate(), model()
        held = [asyncio.create_task(gate.run(r, call("mallory"), 1 << 20)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refusal) as e:
            await gate.run(r, call("mallory"), 1 << 20)
        assert e.value.code == "rate_limit_exceeded"
        assert "(max_per_principal 2)" in e.value.message
        other = asyncio.create_task(gate.run(r, call("alice"), 1 << 20))
        await asyncio.sleep(0)
        with pytest.raises(Refusal, match=r"anon_max_in_flight 1"):
            await asyncio.gather(gate.run(r, call(""), 1 << 20), gate.run(r, call(""), 1 << 20))
        r.tokenizer.release.set()
        assert [len(o.token_ids) for o in await asyncio.gather(*held, other)] == [3, 3, 3]
        await asyncio.sleep(0.05)  # the anonymous call that got in finishes too
        assert gate.held("mallory") == gate.held("alice") == gate.held("") == 0

    asyncio.run(run())


def test_a_place_comes_back_when_the_pool_is_done_not_when_the_caller_leaves():
    async def run() -> None:
        gate, r = TokenizeGate(), model(max_per_principal=1)
        first = asyncio.create_task(gate.run(r, call("mallory"), 1 << 20))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert gate.held("mallory") == 1  # its work still runs on the pool
        with pytest.raises(Refusal, match="max_per_principal 1"):
            await gate.run(r, call("mallory"), 1 << 20)
        r.tokenizer.release.set()
        while gate.held("mallory"):
            await asyncio.sleep(0.01)
        assert len((await gate.run(r, call("mallory"), 1 << 20)).token_ids) == 3

    asyncio.run(run())


def test_a_call_over_the_byte_cap_is_refused_naming_the_key():
    async def run() -> None:
        with pytest.raises(Refusal) as e:
            await TokenizeGate().run(model(), call("alice", "x" * 2000), 1000)
        assert e.value.code == "invalid_request_error"
        assert "server.max_tokenize_bytes" in e.value.message and "at most 1000" in e.value.message

    asyncio.run(run())
