"""Callers that go away, and deadlines: the ledger comes back whole every time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb


def test_100_callers_cancelling_at_random_stages_leave_the_ledger_whole(
        neuron_main: NeuronProcess, neuron_token: str) -> None:
    """Cancellations are triggered by what the callers observe, never by the clock, so
    neither a slow client (cancelling before its call arrived) nor a fast engine (finishing
    before the cancel) changes what is tested."""
    rng = random.Random(7)

    async def run() -> tuple[pb.NeuronStatus, int]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            got_tokens = 0
            deep_queue = asyncio.Event()

            async def streamed(i: int) -> None:
                # cut off after 1..5 messages of a request of at least 100 tokens: queued
                # (the first message is the first token), mid-prefill or mid-decode
                nonlocal got_tokens
                req = chat_request(f"storm-{i}", principal=f"p{i % 5}",
                                   max_tokens=rng.randint(100, 400), ignore_eos=True)
                leave_after = rng.randint(1, 5)
                call = c.stub.Generate(req, metadata=c.md)
                async for r in call:
                    got_tokens += len(r.token_ids)
                    leave_after -= 1
                    if not leave_after:
                        call.cancel()
                        return

            async def unary(i: int) -> None:
                # Complete says nothing before the end: leave once the neuron holds a deep
                # queue (so most of these are queued, some running), at a random moment
                nonlocal got_tokens
                req = chat_request(f"storm-{i}", principal=f"p{i % 5}",
                                   max_tokens=rng.randint(200, 400), ignore_eos=True)
                call = asyncio.ensure_future(c.complete(req))
                await deep_queue.wait()
                await asyncio.sleep(rng.uniform(0.0, 0.2))
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    got_tokens += len((await call).token_ids)

            tasks = [asyncio.ensure_future(streamed(i) if i % 2 == 0 else unary(i))
                     for i in range(100)]
            await c.watch_until(lambda st: model_of(st).queued >= 20, timeout_secs=30)
            deep_queue.set()
            await asyncio.gather(*tasks)
            st = await c.watch_until(ledger_whole, timeout_secs=30)
        return st, got_tokens

    st, got_tokens = asyncio.run(run())
    assert model_of(st).running == 0 and got_tokens > 0
    started = {r["req_id"] for r in neuron_main.logs("request.start")
               if r["req_id"].startswith("storm-")}
    ended = [r for r in neuron_main.logs("request.done") + neuron_main.logs("request.rejected")
             if r["req_id"].startswith("storm-")]
    assert sorted(r["req_id"] for r in ended) == sorted(started)  # every span closed, once
    gone = [int(r["req_id"].split("-")[1]) for r in ended if r.get("client_gone")]
    assert sum(1 for i in gone if i % 2 == 0) >= 25  # streams left early
    assert any(i % 2 for i in gone)  # Complete callers leaving abort alike


def test_a_request_past_its_deadline_is_aborted_running_or_queued(neuron_main: NeuronProcess,
                                                                  neuron_token: str) -> None:
    """The engine ends a request whose deadline passed wherever it is. The engine is paused
    (SIGSTOP) once two requests are seen running and one queued, and resumed after the
    deadline: so neither a slow machine (nothing ran yet) nor a fast one (all finished)
    can change what is tested."""
    async def run() -> tuple[list[list[pb.GenerateResponse]], list[int]]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            deadline = time.time() + 4.0  # room to start all three on a loaded machine
            first: list[asyncio.Event] = [asyncio.Event() for _ in range(3)]

            async def one(i: int) -> list[pb.GenerateResponse]:
                out = []
                # max_in_flight 2 (and the pool holds two of these): two run, a third waits
                async for r in c.stub.Generate(chat_request(
                        f"late-{i}", principal=f"d{i}", max_tokens=900, ignore_eos=True,
                        deadline_unix_ms=int(deadline * 1000)), metadata=c.md):
                    out.append(r)
                    first[i].set()
                return out

            calls = [asyncio.ensure_future(one(i)) for i in range(3)]
            await c.watch_until(lambda st: model_of(st).queued == 1
                                and sum(e.is_set() for e in first) == 2, timeout_secs=4.0)
            engines = neuron_main.engine_pids()
            for pid in engines:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(max(0.0, deadline - time.time()) + 0.1)
            finally:
                for pid in engines:
                    os.kill(pid, signal.SIGCONT)
            outs = await asyncio.gather(*calls)
            await c.watch_until(ledger_whole)
        return outs, engines

    outs, engines = asyncio.run(run())
    assert engines
    finals = [o[-1] for o in outs]
    assert all(f.finish_reason == pb.FINISH_REASON_ABORT for f in finals), finals
    assert all(f.stop_reason == "deadline" for f in finals), finals
    assert sorted(f.usage.completion_tokens > 0 for f in finals) == [False, True, True]
