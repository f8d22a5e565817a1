"""Requests that come while a hybrid model switches profile wait for the switch and are
served, whether it re-plans or is abandoned (docs/errors.md, "The table").

A real daemon serves a tiny Qwen3.5 (Gated DeltaNet + gated attention); the switch is to a
bf16 profile with another max_in_flight, so it re-plans the pool and the state slots.
The requests go straight to the neuron, as they do when a router sent them before it
heard of the switch: they used to be refused, 503-class, `service_unavailable` at the
daemon or `shutting_down` at the engine, where the switch only held admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb

DRAIN_SECS = 5.0


@pytest.fixture(scope="module")
def hybrid(start_daemon: Callable[..., NeuronProcess], tiny_checkpoint: Callable[..., Path]
           ) -> NeuronProcess:
    return start_daemon("switch-hold", {
        "server": {"name": "switch-hold", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": DRAIN_SECS},
        "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 4},
        "admission": {"max_in_flight": 4, "kv_max_wait_secs": 60.0},
        "profiles": {"small": {"max_in_flight": 2, "kv_dtype": "bf16"}},
        "models": [{"id": "tiny", "path": str(tiny_checkpoint("qwen3_5"))}],
    })


async def _held_through_a_switch(c: NeuronClient, streams: int, end_streams: bool
                                 ) -> tuple[grpc.aio.AioRpcError | pb.SetProfileResponse,
                                            list[list[pb.GenerateResponse] | str]]:
    """`streams` long requests in flight, a switch to `small`, then three short requests
    while it switches; `end_streams`: the long ones' callers leave once the three are
    seen queued (the switch re-plans), else they run on (it is abandoned)."""
    long_runs = [asyncio.ensure_future(c.generate(chat_request(
        f"long-{end_streams}-{i}", principal=f"s{i}", max_tokens=3000, ignore_eos=True)))
        for i in range(streams)]
    await c.watch_until(lambda st: model_of(st).in_flight == streams, timeout_secs=60)
    switch = asyncio.ensure_future(c.stub.SetProfile(
        pb.SetProfileRequest(model="tiny", profile="small"), metadata=c.md))
    await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_SWITCHING)

    async def short(i: int) -> list[pb.GenerateResponse] | str:
        try:
            return await c.generate(chat_request(f"new-{end_streams}-{i}", max_tokens=2))
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name} {dict(e.trailing_metadata() or ()).get('helexa-code')}"

    news = [asyncio.ensure_future(short(i)) for i in range(3)]
    # held in the engine's queue, while the switch still waits for the long ones
    await c.watch_until(lambda st: model_of(st).queued == 3 or any(n.done() for n in news),
                        timeout_secs=30)
    if end_streams:
        for run in long_runs:
            run.cancel()
    try:
        res: grpc.aio.AioRpcError | pb.SetProfileResponse = await switch
    except grpc.aio.AioRpcError as e:
        res = e
    outs = await asyncio.gather(*news)
    for run in long_runs:
        run.cancel()
    await asyncio.gather(*long_runs, return_exceptions=True)
    return res, outs


def test_requests_during_an_abandoned_switch_are_served_after_it(
        hybrid: NeuronProcess, neuron_token: str) -> None:
    async def run() -> tuple[object, list, pb.NeuronStatus]:
        async with NeuronClient(hybrid.address, neuron_token) as c:
            res, outs = await _held_through_a_switch(c, streams=2, end_streams=False)
            return res, outs, await c.watch_until(ledger_whole, timeout_secs=60)

    res, outs, st = asyncio.run(run())
    assert isinstance(res, grpc.aio.AioRpcError), res
    assert res.code() == grpc.StatusCode.FAILED_PRECONDITION and "abandoned" in res.details()
    assert [o if isinstance(o, str) else o[-1].usage.completion_tokens for o in outs] == [2] * 3
    assert model_of(st).profile == "" and model_of(st).kv_dtype == "fp32"


def test_requests_during_a_switch_that_re_plans_are_served_on_the_new_pool(
        hybrid: NeuronProcess, neuron_token: str) -> None:
    async def run() -> tuple[object, list, pb.NeuronStatus]:
        async with NeuronClient(hybrid.address, neuron_token) as c:
            res, outs = await _held_through_a_switch(c, streams=1, end_streams=True)
            st = await c.watch_until(ledger_whole, timeout_secs=60)
            await c.stub.SetProfile(pb.SetProfileRequest(model="tiny", profile=""),
                                    metadata=c.md)  # back to the base for any test after
            return res, outs, st

    res, outs, st = asyncio.run(run())
    assert isinstance(res, pb.SetProfileResponse), res
    assert "kv_dtype: fp32 -> bf16" in res.changed
    assert [o if isinstance(o, str) else o[-1].usage.completion_tokens for o in outs] == [2] * 3
    assert model_of(st).profile == "small" and model_of(st).kv_dtype == "bf16"
