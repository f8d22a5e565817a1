"""Residency: loads, LRU eviction by priority, single-flight, failures, unloading a busy model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
from support.fake_engine import FakeEngineClient

from helexa.config.schema import NeuronConfig
from helexa.neuron.residency import Residency
from helexa.neuron.resident_model import ModelState
from helexa.refusal import Refusal


def _cfg(model_dir: Path, models: list[dict[str, Any]], device_memory_mb: int = 4) -> NeuronConfig:
    # each tiny model: ~0.53 MiB of weights + a 1 MiB pool, so two fit in 4 MiB, three do not
    return msgspec.convert({
        "server": {"device_memory_mb": device_memory_mb, "drain_secs": 2.0},
        "kv": {"kv_budget_mb": 1, "activation_headroom_mb": 0},
        "models": [{"path": str(model_dir), "preload": False, **m} for m in models],
    }, NeuronConfig)


def _residency(cfg: NeuronConfig, tmp_path: Path, factory: Any = None) -> Residency:
    factory = factory or FakeEngineClient.factory(lambda _p, _i: 1)
    return Residency(cfg, tmp_path / "neuron.toml", client_factory=factory,
                     tokenizer_loader=lambda _d: None)


def test_loading_a_third_model_evicts_the_least_recently_used(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    async def run() -> tuple[list[str], set[str]]:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}, {"id": "b"}, {"id": "c"}]), tmp_path)
        await res.load("a")
        await res.load("b")
        await asyncio.sleep(0.002)
        res.models["a"].touch()  # a served a request after b was loaded
        c, evicted = await res.load("c")
        assert c.state == ModelState.READY
        return evicted, set(res.models)

    assert asyncio.run(run()) == (["b"], {"a", "c"})


def test_a_busy_model_is_never_evicted(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def run() -> tuple[list[str], set[str]]:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}, {"id": "b"}, {"id": "c"}]), tmp_path)
        await res.load("a")
        await res.load("b")
        res.models["a"].begin()  # a request in flight on a, the older one
        _, evicted = await res.load("c")
        return evicted, set(res.models)

    assert asyncio.run(run()) == (["b"], {"a", "c"})


def test_no_room_among_equal_or_lower_priority_fails_the_load_saying_why(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    async def run() -> tuple[Any, set[str]]:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a", "priority": 2},
                                               {"id": "b", "priority": 2}, {"id": "c"}]), tmp_path)
        await res.load("a")
        await res.load("b")
        c, evicted = await res.load("c")
        assert evicted == []
        return c, set(res.models)

    c, resident = asyncio.run(run())
    assert c.state == ModelState.FAILED and "not enough device memory" in c.error
    assert resident == {"a", "b", "c"}  # c stays visible as failed


def test_concurrent_loads_of_one_model_start_one_engine(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    factory = FakeEngineClient.factory(lambda _p, _i: 1)

    async def run() -> list[Any]:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}]), tmp_path, factory)
        return await asyncio.gather(*(res.load("a") for _ in range(5)))

    results = asyncio.run(run())
    assert len(factory.made) == 1  # type: ignore[attr-defined]
    assert len({id(r) for r, _ in results}) == 1


def test_an_engine_that_fails_to_start_leaves_the_model_failed_with_the_reason(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    async def broken(spec: Any, **_: Any) -> Any:
        raise RuntimeError("UnsupportedArchitecture: qwen3_next has linear attention")

    async def run() -> Any:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}]), tmp_path, broken)
        r, _ = await res.load("a")
        return r

    r = asyncio.run(run())
    assert r.state == ModelState.FAILED and "qwen3_next" in r.error


@pytest.mark.parametrize("own", [False, True], ids=["server", "model"])
def test_a_cuda_card_this_host_lacks_fails_the_load_naming_its_key(
        tiny_model_dir: Path, tmp_path: Path, own: bool) -> None:
    import torch

    card = f"cuda:{torch.cuda.device_count()}"  # one past the last: on a CPU host, cuda:0
    cfg = msgspec.convert({
        "server": {"device_memory_mb": 4, **({} if own else {"devices": [card]})},
        "kv": {"kv_budget_mb": 1, "activation_headroom_mb": 0},
        "models": [{"id": "a", "path": str(tiny_model_dir), "preload": False,
                    **({"devices": [card]} if own else {})}],
    }, NeuronConfig)
    # the real engine process, which is where torch would meet the card
    res = Residency(cfg, tmp_path / "neuron.toml", tokenizer_loader=lambda _d: None)
    r, _ = asyncio.run(res.load("a"))
    key = "models[0].devices" if own else "server.devices"
    assert r.state == ModelState.FAILED
    assert r.error.startswith(f"loading a failed: RuntimeError: {key}: {card}"), r.error
    assert "torch" in r.error and "Assertion" not in r.error


def test_unloading_a_busy_model_is_refused_unless_drained(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    async def run() -> tuple[str, float, bool]:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}]), tmp_path)
        r, _ = await res.load("a")
        r.begin()
        with pytest.raises(Refusal) as e:
            await res.unload("a")
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, r.end)
        t0 = loop.time()
        done = await res.unload("a", drain=True)
        return e.value.code, loop.time() - t0, done and "a" not in res.models

    code, waited, gone = asyncio.run(run())
    assert code == "model_busy" and 0.08 <= waited < 1.0 and gone


def test_unknown_model_is_model_not_found(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _residency(_cfg(tiny_model_dir, [{"id": "a"}]), tmp_path)
    with pytest.raises(Refusal) as e:
        asyncio.run(res.load("zzz"))
    assert e.value.code == "model_not_found"


def test_a_failed_load_is_remembered_not_retried_until_backoff_or_asked(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    import time

    starts: list[str] = []

    async def broken(spec: Any, **_callbacks: Any) -> Any:
        starts.append(spec.model_id)
        raise RuntimeError("weights: model.safetensors is truncated")

    async def run() -> None:
        res = _residency(_cfg(tiny_model_dir, [{"id": "a"}]), tmp_path, factory=broken)
        r, _ = await res.load("a")
        assert r.state == ModelState.FAILED and "truncated" in r.error
        for _ in range(50):  # what a router's on-demand loads would do
            again, _ = await res.load("a")
            assert again is r and again.state == ModelState.FAILED
        assert starts == ["a"]  # no retry within the backoff
        with pytest.raises(Refusal) as e:
            res.serving("a")
        assert e.value.code == "model_failed" and "truncated" in e.value.message
        assert e.value.retry_after_ms >= 20_000  # long: waiting a second will not help
        # an operator's explicit Load retries at once
        r2, _ = await res.load("a", retry_failed=True)
        assert r2.state == ModelState.FAILED and starts == ["a", "a"]
        assert r2.failures == 2 and r2.retry_at - time.monotonic() > 50  # backoff doubled
        # after the backoff a plain Load retries
        r2.retry_at = time.monotonic() - 1
        await res.load("a")
        assert starts == ["a", "a", "a"]

    asyncio.run(run())
