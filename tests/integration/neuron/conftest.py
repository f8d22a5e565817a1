"""Real `helexa neuron` daemons on tiny checkpoints, shared across the test session.

- `neuron_main`: the default tiny model, admission roomy enough for fairness,
  cancellation storms and deadlines (max_in_flight 2, so work queues).
- `neuron_tight`: a model with fat KV tokens in a 1 MiB pool (256 tokens),
  a short queue, a low per-principal cap and a short KV wait — for refusals.

Each test must leave its daemon idle. Clients: support.neuron.NeuronClient.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.neuron import NeuronProcess, start_neuron, stop_all, write_neuron_config

TOKEN = "integration-token"
# Short, so a queued request times out well before a 200-token request holding
# the pool finishes (~0.5 s on the tiny model even when the machine is idle).
TIGHT_KV_WAIT_SECS = 0.15
ASSET = Path(__file__).resolve().parents[3] / "asset"


@pytest.fixture(scope="session")
def neuron_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("neurons")
    (d / "token").write_text(TOKEN + "\n")
    return d


def _base(name: str, model_dir: Path, **over: dict[str, Any]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token",
                   "address_file": f"{name}.addr", "metrics_listen": "127.0.0.1:0",
                   "drain_secs": 10.0, "heartbeat_secs": 1.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    }
    for section, body in over.items():
        cfg[section] = {**cfg.get(section, {}), **body} if isinstance(body, dict) else body
    return cfg


@pytest.fixture(scope="session")
def start_daemon(neuron_dir: Path) -> Iterator[Callable[..., NeuronProcess]]:
    """Start a daemon from a config dict; every one started is stopped at session end."""
    started: list[NeuronProcess] = []

    def start(name: str, config: dict[str, Any]) -> NeuronProcess:
        path = write_neuron_config(neuron_dir / f"{name}.toml", config)
        proc = start_neuron(path, log_path=neuron_dir / f"{name}.log")
        started.append(proc)
        return proc

    yield start
    stop_all(started)


@pytest.fixture(scope="session")
def neuron_main_config(tiny_model_dir: Path) -> dict[str, Any]:
    cfg = _base("main", tiny_model_dir,
                admission={"max_in_flight": 2, "max_queue_depth": 200, "max_per_principal": 150,
                           "anon_max_in_flight": 2, "kv_max_wait_secs": 30.0},
                profiles={"wide": {"max_in_flight": 3}, "long": {"kv_dtype": "fp16"}})
    # a second catalogue entry, loaded only on demand (ctl load / unload)
    cfg["models"].append({"id": "tiny-b", "path": str(tiny_model_dir), "preload": False})
    return cfg


@pytest.fixture(scope="session")
def neuron_main(start_daemon: Callable[..., NeuronProcess],
                neuron_main_config: dict[str, Any]) -> NeuronProcess:
    return start_daemon("main", neuron_main_config)


@pytest.fixture(scope="session")
def fat_kv_model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    # 2 layers × 2 (K, V) × 4 kv heads × 64 dims × 4 B = 4 KiB per token: 256 tokens per MiB.
    # A wide MLP (2 × 3 × 64 × 32768 weights, 50 MB a step) makes decode slow on purpose
    # (~3 ms a token here): requests that hold the pool in these tests hold it for long
    # enough to be seen in Watch and to outlast kv_max_wait_secs.
    return tiny_checkpoint("qwen3", num_heads=4, num_kv_heads=4, head_dim=64,
                           intermediate_size=32768)


@pytest.fixture(scope="session")
def hybrid_model_dir(neuron_dir: Path, tiny_model_dir: Path) -> Path:
    """The 27B hybrid's config.json (no weights) with a tiny tokenizer: plans, cannot load."""
    d = neuron_dir / "hybrid"
    d.mkdir(exist_ok=True)
    shutil.copy(ASSET / "models/Qwen/Qwen3.5-27B/config.json", d / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, d / name)
    return d


@pytest.fixture(scope="session")
def neuron_tight(start_daemon: Callable[..., NeuronProcess], fat_kv_model_dir: Path,
                 hybrid_model_dir: Path) -> NeuronProcess:
    cfg = _base("tight", fat_kv_model_dir,
                admission={"max_in_flight": 4, "max_queue_depth": 2, "max_per_principal": 3,
                           "kv_max_wait_secs": TIGHT_KV_WAIT_SECS})
    # beast's hybrid config without its weights: plans, fails to load, the daemon stays up
    cfg["models"].append({"id": "hybrid", "path": str(hybrid_model_dir), "kv_budget_mb": 256})
    return start_daemon("tight", cfg)


@pytest.fixture(scope="session")
def neuron_token() -> str:
    return TOKEN


@pytest.fixture(scope="session")
def base_neuron_config() -> Callable[..., dict[str, Any]]:
    """`_base(name, model_dir, **sections)`: the shared daemon settings, for tests that
    start a daemon of their own."""
    return _base
