"""In-process router tests: two fake neurons and one router in an event loop on a thread.

Tests stay synchronous (the official openai client, httpx2) and reach into
the fakes to set behaviour; `fleet` resets every fake after each test.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).parent))

from fake_neuron import Behaviour, FakeModel, FakeNeuron  # noqa: E402
from helexa.router import app as router_app  # noqa: E402
from helexa.router.auth import hash_key  # noqa: E402

from helexa.config import load_router_config  # noqa: E402

ALICE_KEY = "sk-alice-test-key"


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        async def go():
            return fn(*args)
        return self.run(go())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Fleet:
    lt: LoopThread
    n1: FakeNeuron
    n2: FakeNeuron
    state: router_app.RouterState
    url: str

    def client(self, key: str = "sk-anything", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=15, **kw)

    def reset(self) -> None:
        def go():
            for n in (self.n1, self.n2):
                n.b = Behaviour()
                n.requests.clear()
                n.loads.clear()
                n.draining = False
                n.models = {"tiny": FakeModel("tiny")}
                n.changed()
            self.n2.models["other"] = FakeModel("other", context=512, output=256)
            self.n2.changed()
        self.lt.call(go)


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
        "auth": {"keys_file": str(keys)},
        "neurons": {"token_file": str(tmp / "token"), "endpoints": [
            {"name": "n1", "address": a1}, {"name": "n2", "address": a2}]},
        "aliases": {"helexa/balanced": "tiny"},
        "timeouts": {"unhealthy_after_secs": 0.6, "load_wait_secs": 2.0, "request_secs": 30},
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


def _wait_healthy(f: Fleet, timeout: float = 10.0) -> None:
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(f.lt.call(f.state.registry.healthy_links)) == 2:
            return
        time.sleep(0.02)
    raise AssertionError("fake neurons never became healthy")


@pytest.fixture
def fl(fleet: Fleet):
    """The session fleet, reset and healthy before and after each test."""
    fleet.reset()
    fleet.wait_healthy()
    yield fleet
    fleet.reset()
