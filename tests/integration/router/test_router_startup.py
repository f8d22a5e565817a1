"""A router process says it listens only once it has heard its neurons: a request sent the
moment `ROUTER LISTENING` is printed is served (processes started as `helexa up` starts them:
the neuron first, then the router)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomli_w
from router_procs import start_router

FAKE = Path(__file__).resolve().parents[2] / "router" / "router_fake_neuron.py"


def test_a_request_sent_as_the_router_says_listening_is_served(tmp_path):
    neuron = subprocess.Popen([sys.executable, str(FAKE), "--name", "slow", "--models", "tiny",
                               "--first-report-delay", "1.0"], stdout=subprocess.PIPE, text=True)
    try:
        line = neuron.stdout.readline()
        assert line.startswith("NEURON LISTENING "), line
        cfg = tmp_path / "router.toml"
        cfg.write_text(tomli_w.dumps({
            "server": {"listen": "127.0.0.1:0"},
            "neurons": {"endpoints": [{"name": "slow", "address": line.split()[-1]}]}}))
        router = start_router(cfg)
        try:
            r = router.client(None).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            assert r.choices[0].message.content == "w0 "
        finally:
            assert router.stop() == 0
    finally:
        neuron.kill()
        neuron.wait()
