"""SIGHUP's config comparison: what changed, and which changes apply without a restart."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
from support.fake_engine import run_fake_neuron
from support.neuron import write_neuron_config

from helexa.config.schema import NeuronConfig
from helexa.neuron.auth import bearer
from helexa.neuron.daemon import config_diff, merge_reloadable
from helexa.proto import neuron_pb2 as pb


def _cfg(**over: dict) -> NeuronConfig:
    base = {
        "server": {"listen": "127.0.0.1:0"},
        "admission": {"max_in_flight": 4},
        "kv": {"block_size": 16},
        "models": [{"id": "a", "path": "a", "priority": 1}, {"id": "b", "path": "b"}],
        "profiles": {"batch": {"max_slots": 8}},
    }
    for k, v in over.items():
        base[k] = v
    return msgspec.convert(base, NeuronConfig)


def test_diff_names_changed_keys_with_models_matched_by_id() -> None:
    old = _cfg()
    new = _cfg(admission={"max_in_flight": 9}, kv={"block_size": 32},
               models=[{"id": "b", "path": "b", "priority": 3}, {"id": "a", "path": "a",
                                                                 "priority": 1}])
    changes = {key: (schema_key, a, b) for key, schema_key, a, b in config_diff(old, new)}
    assert changes == {
        "admission.max_in_flight": ("admission.max_in_flight", 4, 9),
        "kv.block_size": ("kv.block_size", 16, 32),
        "models.b.priority": ("models.priority", 0, 3),
    }


def test_merge_takes_reload_fields_and_keeps_restart_fields() -> None:
    old = _cfg()
    new = _cfg(admission={"max_in_flight": 9}, kv={"block_size": 32},
               server={"listen": "127.0.0.1:5", "drain_secs": 3.0},
               models=[{"id": "a", "path": "elsewhere", "priority": 7}, {"id": "b", "path": "b"}],
               profiles={"fast": {"max_in_flight": 2}})
    merged = merge_reloadable(old, new)
    assert merged.admission.max_in_flight == 9
    assert merged.server.drain_secs == 3.0
    assert merged.kv.block_size == 16  # restart
    assert merged.server.listen == "127.0.0.1:0"  # restart
    assert merged.model("a").priority == 7 and merged.model("a").path == "a"
    assert set(merged.profiles) == {"fast"}


def test_a_reload_holds_the_event_loop_for_milliseconds_not_seconds(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGHUP runs on the event loop that serves every stream: with a catalogue of a few
    models a reload must not stall the streams (a router would declare the neuron down).
    Each of three reloads during a stream costs the loop's thread little CPU (its own
    time, so other processes on the machine do not count), and the stream runs on."""
    (tmp_path / "token").write_text("t")
    cfg: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "token_file": "token"},
        "admission": {"max_queue_depth": 100},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}] + [
            {"id": f"extra{i}", "path": str(tiny_model_dir), "preload": False}
            for i in range(2)],
    }
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        loop = asyncio.get_running_loop()
        held: list[float] = []

        def reload() -> None:  # as the SIGHUP handler runs it: on the loop
            t0 = time.thread_time()
            daemon.reload()
            held.append(time.thread_time() - t0)

        async def hups() -> None:
            for depth in (101, 102, 103):
                await asyncio.sleep(0.1)
                cfg["admission"]["max_queue_depth"] = depth
                write_neuron_config(path, cfg)
                loop.call_soon(reload)

        req = pb.GenerateRequest(req_id="s", model="tiny", text="hi", max_tokens=250,
                                 ignore_eos=True)
        reloads = asyncio.ensure_future(hups())
        out = [r async for r in stub.Generate(req, metadata=bearer("t"))]
        await reloads
        return held, engine.limits, out[-1]

    held, limits, last = run_fake_neuron(path, body, script=lambda _p, _i: 7, step_secs=0.002)
    assert limits.max_queue_depth == 103 and len(held) == 3  # the reloads applied
    assert last.usage.completion_tokens == 250
    assert max(held) < 0.2, f"a reload held the event loop for {max(held):.2f} s of CPU"
