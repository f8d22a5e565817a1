"""A router and two real neurons, as `helexa up` runs them, for what operators look at:
the status page (in Chromium) and `helexa bench` (against real admission).

- `oa` serves `tiny` (fast).
- `ob` serves `tiny` and `slow`: fat KV tokens (4 KiB) and a wide MLP, so a token takes
  a few ms and a long request stays in flight for seconds; `slow` runs the profile
  `one`: one request in flight, the rest queue (a TTFT knee at concurrency 2).
- admission: at most 3 requests (queued + in flight) per principal, then 429.
- the router: auth optional, keys for alice and bench (principal `bench`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))

from router_procs import RouterProcess, start_router, wait_for  # noqa: E402
from support.neuron import (  # noqa: E402
    NeuronProcess,
    start_neurons,
    stop_all,
    write_neuron_config,
)

from helexa.router.auth import hash_key  # noqa: E402

TOKEN = "ops-token"
KEYS = {"alice": "sk-ops-alice", "bench": "sk-ops-bench"}
MAX_PER_PRINCIPAL = 3


@dataclass
class Ops:
    router: RouterProcess
    neurons: dict[str, NeuronProcess]
    tiny_dir: Path
    keys: dict[str, str]

    @property
    def url(self) -> str:
        return self.router.url

    def status(self) -> dict[str, Any]:
        return httpx2.get(self.url + "/status.json", timeout=10).json()

    def model(self, neuron: str, model: str) -> dict[str, Any]:
        n = next(n for n in self.status()["neurons"] if n["name"] == neuron)
        return next(m for m in n["models"] if m["model"] == model)


def _neuron(name: str, models: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token",
                   "metrics_listen": "127.0.0.1:0", "drain_secs": 10.0, "heartbeat_secs": 1.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 2, "activation_headroom_mb": 0},
        "admission": {"max_in_flight": 4, "max_queue_depth": 8,
                      "max_per_principal": MAX_PER_PRINCIPAL, "kv_max_wait_secs": 30.0},
        "profiles": {"one": {"max_in_flight": 1}},
        "models": models,
    }


@pytest.fixture(scope="session")
def ops(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
        tiny_checkpoint: Callable[..., Path]) -> Iterator[Ops]:
    d = tmp_path_factory.mktemp("ops")
    (d / "token").write_text(TOKEN + "\n")
    (d / "keys.toml").write_text(tomli_w.dumps({"keys": {hash_key(k): p for p, k in KEYS.items()}}))
    slow = tiny_checkpoint("qwen3", num_heads=4, num_kv_heads=4, head_dim=64,
                           intermediate_size=32768)
    configs = {
        "oa": _neuron("oa", [{"id": "tiny", "path": str(tiny_model_dir)}]),
        "ob": _neuron("ob", [{"id": "tiny", "path": str(tiny_model_dir)},
                             {"id": "slow", "path": str(slow), "profile": "one",
                              "kv_budget_mb": 4}]),
    }
    started: dict[str, NeuronProcess] = {}
    router = None
    try:
        started = start_neurons({name: (write_neuron_config(d / f"{name}.toml", cfg),
                                        d / f"{name}.log") for name, cfg in configs.items()})
        (d / "router.toml").write_text(tomli_w.dumps({
            "server": {"listen": "127.0.0.1:0"},
            "auth": {"keys_file": "keys.toml", "require_auth": False, "load_principals": []},
            "neurons": {"token_file": "token", "endpoints": [
                {"name": n, "address": p.address} for n, p in started.items()]},
            "timeouts": {"reconnect_max_secs": 0.5, "request_secs": 120},
        }))
        router = start_router(d / "router.toml")
        url = router.url
        wait_for(lambda: all(n["up"] and n["models"] and
                             all(m["state"] == "ready" for m in n["models"])
                             for n in httpx2.get(url + "/status.json").json()["neurons"]),
                 timeout=120)
        yield Ops(router, started, tiny_model_dir, KEYS)
    finally:
        if router is not None:
            router.stop()
        stop_all(started.values())
