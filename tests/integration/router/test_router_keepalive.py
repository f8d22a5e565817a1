"""A neuron whose Python is busy is not a hung one: gRPC's core threads answer the router's
keepalive pings without the GIL, so a neuron process that holds its GIL for longer than the
router's keepalive bound (keepalive_secs + keepalive_timeout_secs) keeps its stream, which
goes on to its end once the neuron runs again. (A SIGSTOPped neuron answers no ping and
loses its stream within that bound: test_router_hostile.py.)"""

from __future__ import annotations

import json
import time

import httpx2
from router_procs import router_over_fake

KEEPALIVE_SECS, KEEPALIVE_TIMEOUT_SECS = 1.0, 1.0
HOLD_SECS = 6.0  # three times the router's keepalive bound


def test_a_neuron_holding_its_gil_past_the_keepalive_bound_keeps_its_stream(tmp_path):
    with router_over_fake(tmp_path, "busy", timeouts={
            "unhealthy_after_secs": 1.0, "reconnect_max_secs": 0.5, "stream_idle_secs": 120.0,
            "keepalive_secs": KEEPALIVE_SECS,
            "keepalive_timeout_secs": KEEPALIVE_TIMEOUT_SECS}) as router:
        texts, gaps, last = [], [], None
        with httpx2.stream("POST", router.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": f"[[tokens:4]] [[hold:{HOLD_SECS}]] go",
                "max_tokens": 4, "stream": True}) as r:
            for raw in r.iter_lines():
                if not raw.startswith("data: {"):
                    continue
                body = json.loads(raw.removeprefix("data: "))
                assert "error" not in body, body
                texts.append(body["choices"][0]["text"])
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
        assert "".join(texts) == "w0 w1 w2 w3 "
        # the neuron was silent past the keepalive bound: its pings had to be answered
        assert max(gaps) > KEEPALIVE_SECS + KEEPALIVE_TIMEOUT_SECS
        assert "ping timeout" not in router.log_path.read_text()
