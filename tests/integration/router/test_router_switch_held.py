"""Requests the router holds while a model switches profile, as an operator sees them.

A real router over a real neuron serving a tiny Qwen3.5 on a bf16 pool; its profile
`narrow` re-plans the pool to fp32. One long stream in flight holds the switch (it waits for
in-flight work), and requests that come meanwhile wait at the router, which sends nothing
to a model it sees `switching`: no neuron queue counts them. They used to show nowhere
(`helexa ctl status` read `switching … queue 0` with requests waiting); now
`helexa_router_held_requests`, the status page's `router.held` and a line of
`helexa ctl status` show them, and each ends at the router's bound
(`timeouts.load_wait_secs` here) with a 503 naming the switch.
docs/operating.md, "Tuning admission and profiles".
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from router_procs import RouterProcess, router_over, wait_for
from support.neuron import NeuronProcess, start_neuron, write_neuron_config

LOAD_WAIT_SECS = 3.0
HELD = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Callable[..., Path]
         ) -> Iterator[tuple[NeuronProcess, RouterProcess]]:
    d = tmp_path_factory.mktemp("switch-held")
    neuron = start_neuron(write_neuron_config(d / "ns.toml", {
        "server": {"name": "ns", "listen": "127.0.0.1:0", "heartbeat_secs": 0.5,
                   "drain_secs": 120.0},
        "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 4, "kv_dtype": "bf16", "activation_headroom_mb": 0},
        "profiles": {"narrow": {"kv_dtype": "fp32"}},
        "models": [{"id": "tiny", "path": str(tiny_checkpoint("qwen3_5"))}],
    }), log_path=d / "ns.log")
    with router_over(neuron, d, {
        "server": {"listen": "127.0.0.1:0"},
        "neurons": {"endpoints": [{"name": "ns", "address": neuron.address}]},
        "timeouts": {"load_wait_secs": LOAD_WAIT_SECS, "request_secs": 120,
                     "reconnect_max_secs": 0.5}}) as router:
        yield neuron, router


def _ctl(neuron: NeuronProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "helexa.cli", "ctl", "--address",
                           neuron.address, *args], capture_output=True, text=True, timeout=300)


def _model(router: RouterProcess) -> dict[str, Any]:
    st = httpx2.get(router.url + "/status.json", timeout=10).json()
    return next(m for n in st["neurons"] for m in n["models"] if m["model"] == "tiny")


def test_requests_held_by_the_router_during_a_switch_are_seen_and_end_at_its_bound(pair):
    neuron, router = pair
    url = router.url + "/v1/chat/completions"
    stop_long = threading.Event()

    def long_stream() -> None:  # in flight until told to leave: the switch waits for it
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 20000, "ignore_eos": True, "stream": True}
        with httpx2.stream("POST", url, json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop_long.is_set():
                    return

    holder = threading.Thread(target=long_stream, daemon=True)
    holder.start()
    wait_for(lambda: _model(router)["in_flight"] == 1, timeout=30)
    switch: dict[str, Any] = {}
    switcher = threading.Thread(target=lambda: switch.setdefault(
        "out", _ctl(neuron, "profile", "tiny", "narrow")), daemon=True)
    switcher.start()
    wait_for(lambda: _model(router)["state"] == "switching", timeout=30)
    answers: list[tuple[int, dict[str, Any], float, str | None]] = []

    def held_request() -> None:
        t0 = time.monotonic()
        r = httpx2.post(url, json={"model": "tiny", "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]},
                        timeout=60)
        answers.append((r.status_code, r.json(), time.monotonic() - t0,
                        r.headers.get("retry-after")))

    held = [threading.Thread(target=held_request, daemon=True) for _ in range(HELD)]
    for t in held:
        t.start()
    try:
        wait_for(lambda: router.metric("helexa_router_held_requests", model="tiny") == HELD,
                 timeout=LOAD_WAIT_SECS)
        seen = httpx2.get(router.url + "/status.json", timeout=10).json()
        model = _model(router)
        status = _ctl(neuron, "status")
        for t in held:
            t.join(timeout=60)
        after = router.metric("helexa_router_held_requests", model="tiny")
    finally:
        stop_long.set()
        switcher.join(timeout=180)
    assert seen["router"]["held"] == {"tiny": HELD}
    # the neuron's queue never saw them: the router holds them
    assert model["state"] == "switching" and model["queued"] == 0, model
    assert "switching: requests sent meanwhile wait at each router" in status.stdout, status
    assert len(answers) == HELD and after == 0
    for code, body, secs, retry_after in answers:
        assert code == 503 and body["error"]["code"] == "service_unavailable", body
        assert retry_after is not None and int(retry_after) >= 1
        assert body["error"]["message"] == (
            f"`tiny` is switching profile (on ns) and was not ready within "
            f"timeouts.load_wait_secs ({LOAD_WAIT_SECS:g} s); retry shortly"), body
        assert secs >= LOAD_WAIT_SECS - 0.5
    out = switch["out"]
    assert out.returncode == 0 and "kv_dtype: bf16 -> fp32" in out.stdout, out
