"""Callers that go away, and deadlines: the ledger comes back whole every time."""

from __future__ import annotations

import asyncio
import random
import time

from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb


def test_100_callers_cancelling_at_random_stages_leave_the_ledger_whole(
        neuron_main: NeuronProcess, neuron_token: str) -> None:
    rng = random.Random(7)

    async def run() -> tuple[pb.NeuronStatus, int]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            got_tokens = 0

            async def caller(i: int) -> None:
                nonlocal got_tokens
                # up to 400 tokens: with decode at ~1 ms a step, a storm of short ones
                # would mostly finish before its cancel time instead of being cut off
                req = chat_request(f"storm-{i}", principal=f"p{i % 5}",
                                   max_tokens=rng.randint(4, 400), ignore_eos=True)
                if i % 2:  # half of them unary: cancelling Complete must abort alike
                    got_tokens += len((await c.complete(req)).token_ids)
                    return
                async for r in c.stub.Generate(req, metadata=c.md):
                    got_tokens += len(r.token_ids)

            tasks = []
            for i in range(100):
                t = asyncio.ensure_future(caller(i))
                # queued (most), in flight, mid-decode, or after it finished
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.6), t.cancel)
                tasks.append(t)
            await asyncio.gather(*tasks, return_exceptions=True)
            st = await c.watch_until(ledger_whole, timeout_secs=10)
        return st, got_tokens

    st, got_tokens = asyncio.run(run())
    assert model_of(st).running == 0 and got_tokens > 0
    gone = [r["req_id"] for r in neuron_main.logs("request.done")
            if r.get("client_gone") and r["req_id"].startswith("storm-")]
    assert len(gone) >= 50
    assert sum(int(r.split("-")[1]) % 2 for r in gone) >= 20  # Complete callers among them


def test_a_request_past_its_deadline_is_aborted_running_or_queued(neuron_main: NeuronProcess,
                                                                  neuron_token: str) -> None:
    async def run() -> tuple[list, list, float]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            deadline = int((time.time() + 0.4) * 1000)
            t0 = time.monotonic()
            # max_in_flight 2 (and the pool holds two of these): two run, a third waits queued
            outs = await asyncio.gather(*(c.generate(chat_request(
                f"late-{i}", principal=f"d{i}", max_tokens=900, ignore_eos=True,
                deadline_unix_ms=deadline)) for i in range(3)))
            secs = time.monotonic() - t0
            await c.watch_until(ledger_whole)
        return outs, [o[-1] for o in outs], secs

    outs, finals, secs = asyncio.run(run())
    assert all(f.finish_reason == pb.FINISH_REASON_ABORT for f in finals)
    assert all(f.stop_reason == "deadline" for f in finals)
    assert secs < 3.0
    assert sorted(f.usage.completion_tokens > 0 for f in finals) == [False, True, True]
