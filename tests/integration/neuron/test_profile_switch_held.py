"""Requests held in the queue while a model switches profile: their wait, and their size.

A real daemon serves a tiny Qwen3.5 on a bf16 pool (context 28,544 in 4 MiB); its profile
`narrow` re-plans the pool to fp32, which halves the context (14,272), and gives a request
without max_tokens 8 tokens, not the base's 20,000. One long request in flight holds the
switch (it waits for in-flight work, up to drain_secs) while requests that came meanwhile
wait in the engine's queue, longer than kv_max_wait_secs. They used to be refused
`overloaded` by that bound, "waited 2.0 s for admission to resume", and, sized for the old
pool, one without max_tokens was then refused as asking 20,000 max_tokens it never asked,
and one whose max_tokens is a ceiling (Anthropic's, fit_max_tokens) as asking the old
context's worth.
docs/architecture.md, "A request's states".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb

KV_MAX_WAIT_SECS = 2.0
HELD_SECS = 4.0  # how long the test keeps the switch waiting once the newcomers queued
NARROW_OUTPUT = 8


@pytest.fixture(scope="module")
def hybrid(start_daemon: Callable[..., NeuronProcess], tiny_checkpoint: Callable[..., Path]
           ) -> NeuronProcess:
    return start_daemon("switch-held", {
        "server": {"name": "switch-held", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 120.0},
        "engine": {"torch_threads": 1},
        # grow_output off: a request without max_tokens ends at its budget, not the context
        "kv": {"kv_budget_mb": 4, "kv_dtype": "bf16", "default_output_tokens": 20000,
               "grow_output": False},
        "admission": {"max_in_flight": 4, "kv_max_wait_secs": KV_MAX_WAIT_SECS},
        "profiles": {"narrow": {"kv_dtype": "fp32",
                                "default_output_tokens": NARROW_OUTPUT}},
        "models": [{"id": "tiny", "path": str(tiny_checkpoint("qwen3_5"))}],
    })


async def _outcome(c: NeuronClient, req: pb.GenerateRequest) -> str:
    """`served N` (its completion tokens), or the refusal: gRPC status, helexa-code, text."""
    try:
        out = await c.generate(req)
    except grpc.aio.AioRpcError as e:
        code = dict(e.trailing_metadata() or ()).get("helexa-code")
        return f"{e.code().name} {code} {e.details()}"
    last = out[-1]
    return f"served {last.usage.completion_tokens} {pb.FinishReason.Name(last.finish_reason)}"


async def _fitted(c: NeuronClient, req: pb.GenerateRequest) -> str:
    """`fitted N`: the max_tokens its first message says it was fitted to (the call then
    cancelled), or the refusal as `_outcome` gives it."""
    call = c.stub.Generate(req, metadata=c.md)
    try:
        first = await call.read()
    except grpc.aio.AioRpcError as e:
        code = dict(e.trailing_metadata() or ()).get("helexa-code")
        return f"{e.code().name} {code} {e.details()}"
    call.cancel()
    return f"fitted {first.fitted_max_tokens}"


def test_requests_held_by_a_switch_wait_for_it_and_are_sized_for_the_new_profile(
        hybrid: NeuronProcess, neuron_token: str) -> None:
    too_long = chat_request("held-too-long", max_tokens=20000)  # fits 28,544, not 14,272

    def ceiling(req_id: str) -> pb.GenerateRequest:
        return chat_request(req_id, max_tokens=32000, fit_max_tokens=True)

    async def run() -> tuple[object, dict[str, str], str, pb.NeuronStatus, float]:
        async with NeuronClient(hybrid.address, neuron_token) as c:
            ctx = model_of(await c.status()).limits.context
            assert model_of(await c.status()).kv_dtype == "bf16"
            long_run = asyncio.ensure_future(c.generate(chat_request(
                "long", principal="s", max_tokens=6000, ignore_eos=True)))
            await c.watch_until(lambda st: model_of(st).in_flight == 1, timeout_secs=60)
            switch = asyncio.ensure_future(c.stub.SetProfile(
                pb.SetProfileRequest(model="tiny", profile="narrow"), metadata=c.md))
            await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_SWITCHING)
            held = {
                # no max_tokens: sized 20,000 for the old context, 8 under `narrow`
                "growable": chat_request("held-growable", max_tokens=None, ignore_eos=True),
                "short": chat_request("held-short", max_tokens=2),
                "too_long": too_long,
                # its deadline passes while the switch holds it
                "deadline": chat_request("held-deadline", max_tokens=2, deadline_unix_ms=int(
                    (time.time() + HELD_SECS / 2) * 1000)),
            }
            outs = {k: asyncio.ensure_future(_outcome(c, r)) for k, r in held.items()}
            # a ceiling fitted to the old context: 28,522 tokens; 14,250 under `narrow`
            outs["ceiling"] = asyncio.ensure_future(_fitted(c, ceiling("held-ceiling")))
            await c.watch_until(lambda st: model_of(st).queued == len(outs)
                                or any(o.done() for o in outs.values()), timeout_secs=30)
            t0 = time.monotonic()
            await asyncio.sleep(HELD_SECS)  # past kv_max_wait_secs, the switch still waiting
            still = model_of(await c.status())
            assert still.state == pb.MODEL_STATE_SWITCHING and still.in_flight == 1, still
            long_run.cancel()  # its in-flight work gone, the switch re-plans the pool
            try:
                res: object = await switch
            except grpc.aio.AioRpcError as e:
                res = e
            results = {k: await o for k, o in outs.items()}
            held_secs = time.monotonic() - t0
            # a new request as the held one was, after the switch
            _, _, fresh = await c.refusal_message(chat_request("fresh", max_tokens=20000))
            fresh_fit = await _fitted(c, ceiling("fresh-ceiling"))
            st = await c.watch_until(ledger_whole, timeout_secs=60)
            await c.stub.SetProfile(pb.SetProfileRequest(model="tiny", profile=""),
                                    metadata=c.md)  # back to the base for any test after
            assert ctx == 28544, ctx
            return res, results, (fresh, fresh_fit), st, held_secs

    res, results, (fresh, fresh_fit), st, held_secs = asyncio.run(run())
    assert isinstance(res, pb.SetProfileResponse), res
    assert "kv_dtype: bf16 -> fp32" in res.changed and "context: 28544 -> 14272" in res.changed
    assert held_secs > KV_MAX_WAIT_SECS
    assert results["short"] == "served 2 FINISH_REASON_LENGTH", results
    assert results["growable"] == f"served {NARROW_OUTPUT} FINISH_REASON_LENGTH", results
    # refused as a new request is under `narrow`, the arithmetic stated
    assert "maximum context length is 14272" in fresh
    assert results["too_long"] == f"INVALID_ARGUMENT context_length_exceeded {fresh}", results
    assert results["deadline"].startswith("UNAVAILABLE service_unavailable the model was "
                                          "switching profile"), results
    assert fresh_fit == "fitted 14250" and results["ceiling"] == fresh_fit, results
    m = model_of(st)
    assert m.profile == "narrow" and m.kv_dtype == "fp32"  # ledger_whole: nothing held
