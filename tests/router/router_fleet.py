"""The in-process test fleet: an event loop on a thread hosting fake neurons and a router.

Imported by conftest.py (fixtures) and by tests that need its constants.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import openai
from router_fake_neuron import Behaviour, FakeModel, FakeNeuron

from helexa.router import app as router_app

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

    def client(self, key: str = ALICE_KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=15, **kw)

    def reset(self) -> None:
        def go():
            for n in (self.n1, self.n2):
                n.b = Behaviour()
                n.requests.clear()
                n.rpcs.clear()
                n.loads.clear()
                n.draining = False
                n.models = {"tiny": FakeModel("tiny")}
                n.changed()
            self.n2.models["other"] = FakeModel("other", context=512, output=256)
            self.n2.changed()
        self.lt.call(go)

    def ledgers_whole(self) -> bool:
        """Every fake model's reservations back and nothing in flight."""
        def whole():
            return all(m.used_bytes == 0 and m.in_flight == 0
                       for n in (self.n1, self.n2) for m in n.models.values())
        return self.lt.call(whole)


def _wait_healthy(f: Fleet, timeout: float = 10.0) -> None:
    """Both fakes in rotation, and the router's view of their models up to date."""
    def current() -> bool:
        links = f.state.registry.links
        return len(f.state.registry.healthy_links()) == 2 and all(
            n.name in links and links[n.name].status is not None
            and links[n.name].status.draining == n.draining
            and {m.model: m.state for m in links[n.name].status.models}
            == {m.model: m.state for m in n.models.values()} for n in (f.n1, f.n2))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if f.lt.call(current):
            return
        time.sleep(0.02)
    raise AssertionError("fake neurons never became healthy")
