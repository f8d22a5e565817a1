"""A quantised kv_dtype profile switch under load, seen by a real router's clients.

test_neuron_ctl.py switches to fp16 and watches the neuron; this goes the
rest of the way: the pool is re-planned into int4 (packed, with group
scales) while requests stream through a real router, those requests finish
whole, the router's `/v1/models` advertises the context the new pool buys
(helexa.plan's figure), a prompt longer than the old context is then served
on the int4 pool, and switching back restores the old limits with the
ledger whole.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from support.neuron import NeuronClient, NeuronProcess, ledger_whole, model_of

from helexa.checkpoint.memory import kv_bytes_per_token
from helexa.checkpoint.shape import read_model_shape
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc

BLOCK = 16
POOL = 2**20  # kv_budget_mb = 1


def context_for(model_dir: Path, kv_dtype: str) -> int:
    """What helexa plan advertises for a 1 MiB pool (the model's positions are far more)."""
    bpt = kv_bytes_per_token(read_model_shape(model_dir / "config.json"), 1, kv_dtype)
    return POOL // (BLOCK * bpt) * BLOCK


@pytest.fixture(scope="module")
def fat_model(tiny_checkpoint: Callable[..., Path]) -> Path:
    # 4 KiB of fp32 KV per token: 256 tokens in 1 MiB; int4 packs 6.4x more. Wide MLPs
    # (KV per token unchanged) make a 100-token stream last ~0.8 s, not ~0.1: long enough
    # for two to be seen in flight together on a loaded 2-core run
    return tiny_checkpoint("qwen3", num_heads=4, num_kv_heads=4, head_dim=64,
                           hidden_size=1024, intermediate_size=4096)


@pytest.fixture(scope="module")
def neuron_switch(start_daemon: Callable[..., NeuronProcess], fat_model: Path) -> NeuronProcess:
    return start_daemon("switch", {
        "server": {"name": "switch", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 20.0, "heartbeat_secs": 1.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 1, "activation_headroom_mb": 0},
        "admission": {"max_in_flight": 4},
        "profiles": {"huge": {"kv_dtype": "int4"}},
        "models": [{"id": "fat", "path": str(fat_model)}],
    })


@pytest.fixture(scope="module")
def router_url(neuron_switch: NeuronProcess, neuron_dir: Path) -> Iterator[str]:
    import tomli_w

    cfg = neuron_dir / "switch-router.toml"
    cfg.write_text(tomli_w.dumps({
        "server": {"listen": "127.0.0.1:0"},
        "neurons": {"token_file": "token",
                    "endpoints": [{"name": "switch", "address": neuron_switch.address}]},
        "timeouts": {"reconnect_max_secs": 0.5},
    }))
    log = open(neuron_dir / "switch-router.log", "w")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "helexa.cli", "router", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ROUTER LISTENING "):
                found.append(line.split()[-1])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(60) and found, (neuron_dir / "switch-router.log").read_text()[-3000:]
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def advertised(url: str) -> dict[str, int] | None:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        data = json.load(r)["data"]
    return next((m["limit"] for m in data if m["id"] == "fat"), None)


def wait_advertised(url: str, context: int, timeout: float = 15.0) -> dict[str, int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lim = advertised(url)
        if lim is not None and lim["context"] == context:
            return lim
        time.sleep(0.05)
    raise AssertionError(f"/v1/models never showed context {context}; last {advertised(url)}")


def switch(address: str, token: str, profile: str) -> pb.SetProfileResponse:
    async def call() -> pb.SetProfileResponse:
        import grpc

        from helexa.neuron.auth import bearer

        async with grpc.aio.insecure_channel(address) as ch:
            return await neuron_pb2_grpc.NeuronStub(ch).SetProfile(
                pb.SetProfileRequest(model="fat", profile=profile), metadata=bearer(token))
    return asyncio.run(call())


def test_an_int4_switch_under_load_reaches_the_router_and_buys_context(
        neuron_switch: NeuronProcess, router_url: str, neuron_token: str, fat_model: Path) -> None:
    base, huge = context_for(fat_model, "fp32"), context_for(fat_model, "int4")
    assert (base, huge) == (256, 1632)  # 4096 vs 640 bytes per token
    assert wait_advertised(router_url, base)["output"] == base - 1
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stream(i: int) -> tuple[int, str]:
        chunks = client.chat.completions.create(
            model="fat", messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=100, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage, finish = None, ""
        for ch in chunks:
            usage = ch.usage or usage
            finish = next((c.finish_reason for c in ch.choices if c.finish_reason), finish)
        return usage.completion_tokens, finish

    async def in_flight(n: int) -> None:
        async with NeuronClient(neuron_switch.address, neuron_token) as c:
            # a loaded 2-core CI run has taken over 10 s to admit the first two
            await c.watch_until(lambda st: model_of(st, "fat").in_flight >= n,
                                timeout_secs=40)

    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(stream, i) for i in range(3)]
        asyncio.run(in_flight(2))
        res = switch(neuron_switch.address, neuron_token, "huge")
        outs = [r.result(timeout=60) for r in runs]
    assert "kv_dtype: fp32 -> int4" in res.changed
    # nothing was dropped or cut short: two fit in flight at once (each reserves ~115 of the
    # 256 tokens), the third waited in the queue, which a switch keeps
    assert outs == [(100, "length")] * 3
    lim = wait_advertised(router_url, huge)
    assert lim == {"context": huge, "input": huge - 1, "output": huge - 1}

    async def status() -> pb.NeuronStatus:
        async with NeuronClient(neuron_switch.address, neuron_token) as c:
            return await c.watch_until(lambda st: ledger_whole(st, "fat"))
    st = asyncio.run(status())
    m = model_of(st, "fat")
    assert m.kv_dtype == "int4" and m.kv.total_bytes == huge * 640 and m.profile == "huge"

    # a prompt the old pool could not hold is served on the int4 pool
    long_prompt = " ".join(["the pool holds packed blocks"] * 80)
    done = client.completions.create(model="fat", prompt=long_prompt, max_tokens=4,
                                     temperature=0)
    assert base < done.usage.prompt_tokens < huge and done.usage.completion_tokens == 4

    back = switch(neuron_switch.address, neuron_token, "")
    assert "kv_dtype: int4 -> fp32" in back.changed
    wait_advertised(router_url, base)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="fat", prompt=long_prompt, max_tokens=4)
