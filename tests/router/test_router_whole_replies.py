"""A whole (non-streaming) Messages or Responses reply is parsed and encoded off the router's
event loop, as chat's is: the loop carries every other client's stream and every neuron's
Watch, so a reply whose parsing takes a second must not hold it for that second.

The meter is the CPU time of the loop's own thread between two ticks of a 5 ms timer (its
`time.thread_time()`): other processes on a loaded machine do not count in it, and a worker
thread holding the GIL makes the loop wait, which costs it no CPU. Python's cyclic collector
is off while it runs: a full collection of this test process's objects (0.16 s measured)
falls on whichever thread allocates past its threshold, and is no part of what is measured."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import httpx2
import pytest
import structlog.testing
from support.stalled_client import post_to_a_small_window

from helexa.router.client_stream import Pace

# A tick of the loop may hold it this much CPU. Measured on the test machine (2 loaded cores):
# with the reply built on the work pool the fleet's worst tick held 3-4 ms during these
# requests; built on the loop, 0.28-0.59 s (8,000 calls), and 3.9 s for 8,000 unclosed
# `<tool_call>` (before responses_encode cut a reply at its calls in one pass).
LOOP_TICK_CPU_SECS = 0.1
CALL = '<tool_call>{"name": "f", "arguments": {"a": "x"}}</tool_call>'
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


class LoopCpu:
    """The most CPU time the loop's thread spent between two of its ticks."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.done = False

    async def run(self) -> None:
        last = time.thread_time()
        while not self.done:
            await asyncio.sleep(0.005)
            now = time.thread_time()
            self.worst = max(self.worst, now - last)
            last = now


@pytest.fixture
def thinking(fl):
    """Both fakes' `tiny` reported as a thinking model that writes hermes calls, as a Qwen3
    neuron reports it; the router's view up to date."""
    def go() -> None:
        for n in (fl.n1, fl.n2):
            n.models["tiny"].tool_parser, n.models["tiny"].reasoning_parser = "hermes", "think"
            n.changed()

    def seen() -> bool:
        return all(link.model_status("tiny") is not None
                   and link.model_status("tiny").reasoning_parser == "think"
                   for link in fl.state.registry.links.values())
    fl.lt.call(go)
    end = time.monotonic() + 10
    while not fl.lt.call(seen):
        assert time.monotonic() < end, "the router never saw the model's parsers"
        time.sleep(0.02)
    return fl


def body(api: str, count: int, unit: str, tools: bool) -> tuple[str, dict]:
    prompt = f"[[emit:{count}:{unit}]]"
    if api == "responses":
        b: dict = {"model": "tiny", "input": prompt}
        if tools:
            b["tools"] = [{"type": "function", "name": "f", "parameters": SCHEMA}]
        return "/v1/responses", b
    b = {"model": "tiny", "max_tokens": 100, "messages": [{"role": "user", "content": prompt}]}
    if tools:
        b["tools"] = [{"name": "f", "input_schema": SCHEMA}]
    return "/v1/messages", b


@pytest.mark.parametrize(("api", "count", "unit", "tools"), [
    ("responses", 8000, CALL, True),  # 8,000 calls, each an item
    ("messages", 8000, CALL, True),  # each a tool_use block
    ("responses", 8000, "<tool_call>", False),  # the review's: never closed, no tools asked
])
def test_a_whole_reply_is_built_off_the_event_loop(thinking, api, count, unit, tools):
    path, b = body(api, count, unit, tools)
    meter = LoopCpu()
    gc.collect()
    gc.disable()
    ticking = asyncio.run_coroutine_threadsafe(meter.run(), thinking.lt.loop)
    try:
        r = httpx2.post(thinking.url + path, json=b, timeout=60)
        if r.status_code == 503:  # a starved machine missed the fleet's 0.6 s health beat
            thinking.wait_healthy()  # (test_router_fuzz.py says more): once more
            r = httpx2.post(thinking.url + path, json=b, timeout=60)
    finally:
        meter.done = True
        ticking.result(5)
        gc.enable()
    assert r.status_code == 200, r.text
    out = r.json()
    if not tools:  # the model's text, as it wrote it: one message
        assert [i["type"] for i in out["output"]] == ["message"]
        assert out["output"][0]["content"][0]["text"] == unit * count
    elif api == "responses":
        assert [i["type"] for i in out["output"]] == ["function_call"] * count
        assert out["output"][-1]["arguments"] == '{"a": "x"}'
    else:
        assert [c["type"] for c in out["content"]] == ["tool_use"] * count
        assert out["content"][-1]["input"] == {"a": "x"}
    assert meter.worst < LOOP_TICK_CPU_SECS, (
        f"one tick of the router's loop held {meter.worst:.3f} s of CPU building the reply")


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_whole_reply_nobody_reads_is_ended_as_a_stalled_stream(fl, path):
    """Written a piece at a time, as chat's is: a client that reads none of its 4 MB is ended
    after timeouts.client_write_secs, and request.done says so (client_stalled, a 499)."""
    _, b = body(path.rsplit("/", 1)[1], 400_000, "xxxxxxxxxx", False)
    pace = fl.state.client_pace
    fl.state.client_pace = Pace(0.5, pace.min_bytes_per_sec)
    try:
        with structlog.testing.capture_logs() as logs:
            sock = post_to_a_small_window(fl.url, json.dumps(b).encode(), path)
            try:
                end = time.monotonic() + 30
                while not [e for e in logs if e["event"] == "request.done"]:
                    assert time.monotonic() < end, "the reply was never ended"
                    time.sleep(0.05)
            finally:
                sock.close()
    finally:
        fl.state.client_pace = pace
    done = [e for e in logs if e["event"] == "request.done"]
    assert [e.get("outcome") for e in done] == ["client_stalled"], done
    assert done[0]["reason"].startswith("the client read nothing for "), done  # the cut's why
