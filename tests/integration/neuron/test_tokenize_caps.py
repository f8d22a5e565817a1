"""Tokenize on a real daemon: a 7 MB call runs off the loop (Watch and a bystander
stream keep flowing while it is counted) and, far past the context, is refused once the
count passes it, never tokenised whole; a call over server.max_tokenize_bytes is refused
at once with a message naming the key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole

from helexa.proto import neuron_pb2 as pb

BIG_TEXT = ("The quick brown fox jumps over the lazy dog, 12345 times. " * 130_000)[:7_000_000]


@pytest.fixture(scope="module")
def neuron_roomy(start_daemon: Callable[..., NeuronProcess], tiny_model_dir: Path) -> NeuronProcess:
    return start_daemon("roomytok", {
        "server": {"name": "roomytok", "listen": "127.0.0.1:0", "token_file": "token",
                   "max_tokenize_bytes": 16 * 1024 * 1024},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
    })


def gaps(stamps: list[float]) -> float:
    return max((b - a for a, b in zip(stamps, stamps[1:], strict=False)), default=0.0)


def peak_rss_mb(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in MB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("VmHWM:"))
    return int(line.split()[1]) // 1024


async def watch_and_stream_during_big_tokenize(address: str, token: str
                                               ) -> tuple[str, float, float, int, float]:
    """(the Tokenize call's refusal, longest Watch gap, longest bystander token gap,
    bystander tokens, the seconds the Tokenize call took)."""
    async with NeuronClient(address, token) as c:
        watch = c.stub.Watch(pb.WatchRequest(heartbeat_ms=200), metadata=c.md)
        beats: list[float] = []
        tokens: list[float] = []
        first = asyncio.Event()

        async def beat() -> None:
            async for _ in watch:
                beats.append(time.monotonic())
                first.set()

        async def bystander() -> None:
            req = chat_request("bystander", principal="bob", max_tokens=200, ignore_eos=True)
            async for r in c.stub.Generate(req, metadata=c.md):
                tokens.extend(time.monotonic() for _ in r.token_ids)

        beating = asyncio.create_task(beat())
        await first.wait()
        streaming = asyncio.create_task(bystander())
        started = time.monotonic()
        try:
            await c.stub.Tokenize(pb.TokenizeRequest(model="tiny", text=BIG_TEXT,
                                                     principal="mallory"), metadata=c.md)
            refusal = "counted whole"
        except grpc.aio.AioRpcError as e:
            refusal = e.details() or e.code().name
        beats.append(time.monotonic())
        took = beats[-1] - started
        await streaming
        watch.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await c.watch_until(ledger_whole)
    return refusal, gaps(beats), gaps(tokens), len(tokens), took


def test_watch_and_a_bystander_stream_flow_while_7_mb_tokenizes(
        neuron_roomy: NeuronProcess, neuron_token: str) -> None:
    before = peak_rss_mb(neuron_roomy.pid)
    refusal, watch_gap, token_gap, streamed, took = asyncio.run(
        watch_and_stream_during_big_tokenize(neuron_roomy.address, neuron_token))
    # 4.7M tokens, far past the context: refused once counted past it (token_bound.py),
    # not tokenised whole (4 MiB whole took 755 MB more at the peak of a process doing it)
    assert "maximum context length" in refusal and "at least" in refusal, refusal
    grew = peak_rss_mb(neuron_roomy.pid) - before
    assert grew < 300, f"the neuron's peak grew {grew} MB"
    # tokenizing on the event loop would stop both for the whole call; the bound scales
    # with it, as a loaded machine slows both (a fixed 1.0 s failed once at 1.16 s there)
    bound = max(1.0, took / 3)
    assert watch_gap < bound, f"Watch went {watch_gap:.2f} s without a message ({took:.2f} s call)"
    assert streamed == 200 and token_gap < bound, f"bystander gap {token_gap:.2f} s ({took:.2f} s)"


def test_a_call_over_max_tokenize_bytes_is_refused_naming_the_key(
        neuron_main: NeuronProcess, neuron_token: str) -> None:
    async def call() -> grpc.aio.AioRpcError:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            try:
                await c.stub.Tokenize(pb.TokenizeRequest(model="tiny", text="x" * 5_000_000),
                                      metadata=c.md, timeout=2)
            except grpc.aio.AioRpcError as e:
                return e
        raise AssertionError("a 5 MB call was tokenized under a 4 MiB cap")

    e = asyncio.run(call())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "server.max_tokenize_bytes" in (e.details() or "") and "5000" in (e.details() or "")
