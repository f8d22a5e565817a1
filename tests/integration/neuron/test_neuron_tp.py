"""Tensor parallelism through the real daemon: a tp = 2 model on CPU (gloo), its KV per
card halved, and a killed rank failing the model cleanly — FAILED in Watch, the daemon
up, a reload serving again, and no process left behind when the daemon exits."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (a child started from a worker thread is
    listed under that thread only)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _spawned(pid: int) -> list[int]:
    """Descendants of `pid` started by multiprocessing (engine processes and their ranks)."""
    out = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(child)
        except FileNotFoundError:
            continue
        out += _spawned(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_tp2_serves_halves_kv_per_card_and_survives_a_killed_rank(
        start_daemon: Callable[..., NeuronProcess], neuron_main: NeuronProcess,
        base_neuron_config: Callable[..., dict[str, Any]], neuron_token: str,
        tiny_model_dir: Path) -> None:
    cfg = base_neuron_config("tp", tiny_model_dir)
    cfg["server"]["devices"] = ["cpu", "cpu"]
    cfg["models"][0].update(tp=2, devices=["cpu", "cpu"])
    daemon = start_daemon("tp", cfg)
    engine_pids = _spawned(daemon.pid)
    assert len(engine_pids) == 2  # the engine process (rank 0) and rank 1

    async def run() -> None:
        async with NeuronClient(neuron_main.address, neuron_token) as one:
            bpt_one = model_of(await one.status()).kv.bytes_per_token
        async with NeuronClient(daemon.address, neuron_token) as c:
            st = await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_READY)
            assert model_of(st).tp == 2
            assert model_of(st).kv.bytes_per_token * 2 == bpt_one  # 2 kv heads, one per card
            out = await c.generate(chat_request("tp-ok"))
            assert out[-1].usage.completion_tokens > 0

            rank1 = next(p for p in engine_pids if p not in _children(daemon.pid))
            os.kill(rank1, signal.SIGKILL)
            try:
                out = await c.generate(chat_request("tp-dead"))
                assert out[-1].finish_reason == pb.FINISH_REASON_ERROR
            except grpc.aio.AioRpcError as e:  # refused once the model is marked failed
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
            st = await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_FAILED)
            assert "rank 1" in model_of(st).error

            # an operator's Load retries at once (a plain one waits out the failure's backoff)
            await c.stub.Load(pb.LoadRequest(model="tiny", retry_failed=True), metadata=c.md)
            await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_READY
                                and ledger_whole(st))
            out = await c.generate(chat_request("tp-again"))
            assert out[-1].usage.completion_tokens > 0

    asyncio.run(run())
    reloaded = _spawned(daemon.pid)
    assert len(reloaded) == 2
    assert daemon.stop(timeout_secs=30) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in engine_pids + reloaded):
        time.sleep(0.1)
    assert not any(_alive(p) for p in engine_pids + reloaded), "a process outlived the neuron"
