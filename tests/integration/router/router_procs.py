"""Helpers for the router integration tests: start a router process, read its metrics,
the test principals' keys, the configs (imported by conftest.py and the tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import openai
import tomli_w
from prometheus_client.parser import text_string_to_metric_families
from support.neuron import NeuronProcess, start_neuron, write_neuron_config

from helexa.router.auth import hash_key

TOKEN = "router-integration-token"
FAKE_NEURON = Path(__file__).resolve().parents[2] / "router" / "router_fake_neuron.py"
PRINCIPALS = ["alice", "bob", "carol", "dave", *[f"p{i}" for i in range(8)]]


def key_of(principal: str) -> str:
    return f"sk-{principal}-integration"


@dataclass
class RouterProcess:
    proc: subprocess.Popen[str]
    url: str
    config_path: Path
    log_path: Path
    lines: list[str] = field(default_factory=list)

    def client(self, principal: str | None = "alice", **kw: Any) -> openai.OpenAI:
        key = key_of(principal) if principal else "sk-not-a-key"
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                             timeout=60, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted label items): value} from /metrics."""
        text = httpx2.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def reload(self, config: dict[str, Any]) -> None:
        self.config_path.write_text(tomli_w.dumps(config))
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_router(config_path: Path, timeout_secs: float = 60.0) -> RouterProcess:
    log_path = config_path.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "helexa.cli", "router", "--config",
                                 str(config_path)], stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("ROUTER LISTENING "):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout_secs) or not lines:
        proc.kill()
        raise RuntimeError("router did not start:\n" + log_path.read_text()[-3000:])
    return RouterProcess(proc, lines[-1].split()[-1], config_path, log_path, lines)


@contextlib.contextmanager
def router_over(neuron: NeuronProcess, d: Path, conf: dict[str, Any]
                ) -> Iterator[RouterProcess]:
    """A router process from `conf` (written to d/router.toml) over a started `neuron`,
    yielded once its /health is 200; both stopped after (the neuron also when the router
    fails to start)."""
    try:
        (d / "router.toml").write_text(tomli_w.dumps(conf))
        router = start_router(d / "router.toml")
        try:
            wait_for(lambda: httpx2.get(router.url + "/health", timeout=5).status_code == 200,
                     timeout=30)
            yield router
        finally:
            router.stop()
    finally:
        neuron.stop(timeout_secs=15)


@contextlib.contextmanager
def router_over_fake(tmp_path: Path, name: str, *fake_args: str,
                     timeouts: dict[str, float] | None = None,
                     principals: list[str] | None = None) -> Iterator[RouterProcess]:
    """A fake neuron process (tests/router/router_fake_neuron.py, serving `tiny`, started as
    `helexa up` starts its neuron: first) and a router process over it; both stopped after.
    `principals`: a keys file with their keys (key_of), auth.require_auth left off."""
    neuron = subprocess.Popen([sys.executable, str(FAKE_NEURON), "--name", name, "--models",
                               "tiny", *fake_args], stdout=subprocess.PIPE, text=True)
    try:
        assert neuron.stdout is not None
        line = neuron.stdout.readline()
        assert line.startswith("NEURON LISTENING "), line
        conf: dict[str, Any] = {
            "server": {"listen": "127.0.0.1:0"},
            "neurons": {"endpoints": [{"name": name, "address": line.split()[-1]}]}}
        if timeouts:
            conf["timeouts"] = timeouts
        if principals:
            (tmp_path / "keys.toml").write_text(tomli_w.dumps(
                {"keys": {hash_key(key_of(p)): p for p in principals}}))
            conf["auth"] = {"keys_file": "keys.toml"}
        cfg = tmp_path / "router.toml"
        cfg.write_text(tomli_w.dumps(conf))
        router = start_router(cfg)
        try:
            yield router
        finally:
            assert router.stop() == 0
    finally:
        neuron.kill()
        neuron.wait()


def sse_events(url: str, path: str, body: dict, timeout: float = 600
               ) -> list[tuple[str | None, object]]:
    """(event name or None, data) of each SSE event a router at `url` sends for body (sent
    with an Anthropic key and version header, which the other APIs ignore)."""
    events: list[tuple[str | None, object]] = []
    name = None
    with httpx2.stream("POST", url + path, json=body, timeout=timeout,
                       headers={"x-api-key": "sk-any", "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
    return events


def ledger_whole(router: RouterProcess, neuron: str, model: str = "tiny") -> bool:
    """Whether `neuron`'s pool for `model`, as the router's metrics show it, is whole again:
    no KV used or reserved, nothing in flight or queued, every block free."""
    m = router.metrics()

    def g(name: str) -> float | None:
        return m.get((name, (("model", model), ("neuron", neuron))))
    return (g("helexa_neuron_kv_used_bytes") == 0 and g("helexa_neuron_kv_reserved_bytes") == 0
            and g("helexa_neuron_in_flight") == 0 and g("helexa_neuron_queued") == 0
            and g("helexa_neuron_kv_free_bytes") == g("helexa_neuron_kv_total_bytes") > 0)


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, every: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


def neuron_cfg(name: str, models: list[dict], kv_mb: int, **admission: Any) -> dict[str, Any]:
    return {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 20.0, "heartbeat_secs": 1.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": kv_mb, "activation_headroom_mb": 0},
        "admission": {"kv_max_wait_secs": 5.0, **admission},
        "models": models,
    }


def tiny_neuron(folder: Path, name: str, model_dir: Path, kv_mb: int, max_slots: int = 4,
                **sections: dict[str, Any]) -> NeuronProcess:
    """A neuron on loopback serving ``model_dir`` as `tiny` (one torch thread, no headroom,
    quick heartbeats), its config and log in ``folder``; ``sections``: more of the config."""
    cfg = {"server": {"name": name, "listen": "127.0.0.1:0", "heartbeat_secs": 0.5},
           "engine": {"torch_threads": 1, "max_slots": max_slots},
           "kv": {"kv_budget_mb": kv_mb, "activation_headroom_mb": 0},
           "models": [{"id": "tiny", "path": str(model_dir)}], **sections}
    return start_neuron(write_neuron_config(folder / f"{name}.toml", cfg),
                        log_path=folder / f"{name}.log")


CORS_ORIGIN = "https://app.example"  # the one browser origin the test router allows


def router_config(rdir: Path, neurons: dict[str, NeuronProcess]) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "address_file": "router.addr",
                   "max_body_bytes": 64 * 1024, "cors_allowed_origins": [CORS_ORIGIN]},
        "auth": {"keys_file": "keys.toml", "require_auth": True, "load_principals": ["alice"]},
        "neurons": {"token_file": "token", "endpoints": [
            {"name": name, "address": proc.address} for name, proc in neurons.items()]},
        "aliases": {"helexa/balanced": "tiny"},
        "timeouts": {"load_wait_secs": 0.5, "reconnect_max_secs": 0.5, "request_secs": 60},
    }
