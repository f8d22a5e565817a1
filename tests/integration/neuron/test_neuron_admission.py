"""Admission seen from outside: fair shares under a flood, and refusals with codes and retry-after."""

from __future__ import annotations

import asyncio
import time

import grpc
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.config.schema import load_neuron_config
from helexa.proto import neuron_pb2 as pb


def test_a_flooding_principal_does_not_starve_another(neuron_main: NeuronProcess,
                                                      neuron_token: str) -> None:
    """max_in_flight 2: 16 queued requests of `flood`, then 4 of `polite`; order of completion.
    Each generates 120 tokens, so the flood's queue outlives a few Watch reports (at 10
    tokens the native decode drained it before Watch showed 10 queued)."""
    async def run() -> None:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            async def one(principal: str, i: int) -> None:
                out = await c.generate(chat_request(f"{principal}-{i}", principal=principal,
                                                    max_tokens=120, ignore_eos=True))
                assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH

            flood = [asyncio.ensure_future(one("flood", i)) for i in range(16)]
            await c.watch_until(lambda st: model_of(st).queued >= 10)
            polite = [asyncio.ensure_future(one("polite", i)) for i in range(4)]
            await asyncio.gather(*flood, *polite)
            await c.watch_until(ledger_whole)

    asyncio.run(run())
    # The order the neuron saw, from its own log (not the client's, which a loaded machine
    # delays): the requests that finished after the last polite request reached the engine.
    ours = [r for r in neuron_main.logs()
            if str(r.get("req_id", "")).split("-")[0] in ("flood", "polite")]
    arrived = max(i for i, r in enumerate(ours)
                  if r["event"] == "request.start" and r["req_id"].startswith("polite-"))
    after = [r["req_id"].split("-")[0] for r in ours[arrived:] if r["event"] == "request.done"]
    # Round-robin from polite's arrival: once polite's first request is admitted, the two
    # take turns, so polite's 4 finish within ~2 (already running) + 2 × 4 completions;
    # FIFO would put them after all the flood requests still queued.
    first, last = after.index("polite"), len(after) - 1 - after[::-1].index("polite")
    share = after[first:last + 1].count("polite") / (last - first + 1)
    print(f"completion order after polite arrived: {after}; polite share while both "
          f"queued: {share:.2f}")
    assert last <= 12 and share >= 0.4, (share, after)
    assert after[-1] == "flood"


def test_queue_full_and_kv_timeout_are_overloaded_with_retry_after(neuron_tight: NeuronProcess,
                                                                   neuron_token: str) -> None:
    """A 256-token pool: one 215-token request holds it; two wait (queue depth 2), a fourth
    is refused at once (queue full); the waiting two are refused after kv_max_wait_secs.
    Complete is refused alike: one waiter and one of two refused at once use it."""
    async def run() -> tuple[list, tuple, tuple]:
        async with NeuronClient(neuron_tight.address, neuron_token) as c:
            hog = asyncio.ensure_future(c.generate(chat_request(
                "hog", principal="p0", max_tokens=200, ignore_eos=True)))
            await c.watch_until(lambda st: model_of(st).in_flight == 1)

            async def waiter(i: int) -> tuple:
                t0 = time.monotonic()
                r = await c.refusal_message(chat_request(f"wait-{i}", principal=f"p{i}",
                                                         max_tokens=150),
                                            "Complete" if i == 2 else "Generate")
                return (*r, time.monotonic() - t0)

            waiters = [asyncio.ensure_future(waiter(i)) for i in (1, 2)]
            await c.watch_until(lambda st: model_of(st).queued == 2)
            # together, while the two wait: the queue is full for both
            full, full_unary = await asyncio.gather(
                c.refusal_message(chat_request("full", principal="p3", max_tokens=150)),
                c.refusal_message(chat_request("full-c", principal="p3", max_tokens=150),
                                  "Complete"))
            timed_out = await asyncio.gather(*waiters)
            await hog
            await c.watch_until(ledger_whole)
        return timed_out, full, full_unary

    timed_out, (code, md, why), full_unary = asyncio.run(run())
    assert full_unary[0] == code and full_unary[1]["helexa-code"] == "overloaded"
    assert int(full_unary[1]["helexa-retry-after-ms"]) > 0
    wait_secs = load_neuron_config(neuron_tight.config_path).admission.kv_max_wait_secs
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md["helexa-code"] == "overloaded"
    # refused at once for the full queue, not after a wait (the engine says which limit)
    assert "max_queue_depth" in why and "max_queue_depth" in full_unary[2], (why, full_unary)
    assert int(md["helexa-retry-after-ms"]) > 0
    for code, md, why, secs in timed_out:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and md["helexa-code"] == "overloaded"
        assert "kv_max_wait_secs" in why, why
        assert int(md["helexa-retry-after-ms"]) > 0 and secs >= wait_secs


def test_a_principal_over_its_cap_is_refused_429_at_once(neuron_tight: NeuronProcess,
                                                         neuron_token: str) -> None:
    """max_per_principal 3: a fourth concurrent request of one principal is refused."""
    async def run() -> list:
        async with NeuronClient(neuron_tight.address, neuron_token) as c:
            async def one(i: int) -> object:
                try:
                    return await c.generate(chat_request(f"greedy-{i}", principal="greedy",
                                                         max_tokens=60, ignore_eos=True))
                except grpc.aio.AioRpcError as e:
                    return e.code(), dict(e.trailing_metadata() or ())

            held = [asyncio.ensure_future(one(i)) for i in range(3)]
            await c.watch_until(lambda st: model_of(st).in_flight + model_of(st).queued == 3)
            # together, while the three are held: both are over the cap
            fourth, unary = await asyncio.gather(
                c.refusal(chat_request("greedy-3", principal="greedy", max_tokens=4)),
                c.refusal(chat_request("greedy-4", principal="greedy", max_tokens=4), "Complete"))
            await asyncio.gather(*held)
            await c.watch_until(ledger_whole)
        return [fourth, unary]

    for code, md in asyncio.run(run()):  # Generate, then Complete: the same refusal
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert md["helexa-code"] == "rate_limit_exceeded" and int(md["helexa-retry-after-ms"]) > 0
