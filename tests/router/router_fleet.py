"""The in-process test fleet: an event loop on a thread hosting fake neurons and a router.

Imported by conftest.py (fixtures) and by tests that need its constants.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import openai
from fake_neuron import Behaviour, FakeModel, FakeNeuron
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


def _wait_healthy(f: Fleet, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(f.lt.call(f.state.registry.healthy_links)) == 2:
            return
        time.sleep(0.02)
    raise AssertionError("fake neurons never became healthy")
