"""In-process router tests: two fake neurons and one router in an event loop on a thread.

Tests stay synchronous (the official openai client, httpx2) and reach into
the fakes to set behaviour; `fleet` resets every fake after each test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx2
import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).parent))

from router_fake_neuron import FakeNeuron  # noqa: E402
from router_fleet import ALICE_KEY, Fleet, LoopThread, _wait_healthy  # noqa: E402

from helexa.config.schema import load_router_config  # noqa: E402
from helexa.router import app as router_app  # noqa: E402
from helexa.router.auth import hash_key  # noqa: E402


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("router")
    keys = tmp / "keys.toml"
    keys.write_text(f'[keys]\n"{hash_key(ALICE_KEY)}" = "alice"\n')
    (tmp / "token").write_text("neuron-secret\n")
    lt = LoopThread()
    n1 = FakeNeuron("n1", ["tiny"], catalogue=["lazy"], token="neuron-secret")
    n2 = FakeNeuron("n2", ["tiny", "other"], token="neuron-secret")
    a1 = lt.run(n1.start())
    a2 = lt.run(n2.start())
    raw = {
        "server": {"listen": "127.0.0.1:0", "max_body_bytes": 64 * 1024},
        "auth": {"keys_file": str(keys), "load_principals": ["*"]},
        "neurons": {"token_file": str(tmp / "token"), "endpoints": [
            {"name": "n1", "address": a1}, {"name": "n2", "address": a2}]},
        "aliases": {"helexa/balanced": "tiny"},
        "timeouts": {"unhealthy_after_secs": 0.6, "load_wait_secs": 1.0, "request_secs": 30},
    }
    (tmp / "router.toml").write_text(tomli_w.dumps(raw))
    cfg = load_router_config(tmp / "router.toml")
    runner, state, address = lt.run(router_app.start(cfg, tmp / "router.toml"))
    f = Fleet(lt, n1, n2, state, f"http://{address}")
    f.reset()
    f.wait_healthy = lambda: _wait_healthy(f)
    _wait_healthy(f)
    yield f
    lt.run(router_app.stop(runner, state))
    lt.run(n1.stop())
    lt.run(n2.stop())
    lt.close()


@pytest.fixture
def fl(fleet: Fleet):
    """The session fleet, reset and healthy before and after each test."""
    fleet.reset()
    fleet.wait_healthy()
    yield fleet
    fleet.reset()


@pytest.fixture(scope="module")
def http(fleet: Fleet):
    """A plain HTTP client of the session fleet's router, a module's."""
    with httpx2.Client(base_url=fleet.url, timeout=30) as c:
        yield c
