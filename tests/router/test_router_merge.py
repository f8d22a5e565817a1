"""A streamed request of several choices (`n`) reads its neuron calls only as fast as its
client takes the events: a client that stops reading stops every call's reads, so gRPC's
flow control reaches the neuron, which pauses the requests (docs/http.md). While some
choices wait to be admitted, those already admitted are read ahead (serve._open_all)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx2
from router_fake_neuron import FakeModel
from support.stalled_client import post_to_a_small_window, until_flat

from helexa.router import serve


class Call:
    """An OpenStream stand-in: `n` messages, counting how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    async def messages(self) -> Any:
        for k in range(self.n):
            self.read += 1
            yield k


def test_a_client_that_stops_reading_stops_every_choices_reads():
    calls = [Call(500), Call(500), Call(3)]

    async def main() -> None:
        merged = serve._merge(calls)  # type: ignore[arg-type]
        got = [await anext(merged)]
        await asyncio.sleep(0.1)  # the client reads nothing meanwhile
        assert all(c.read <= 2 for c in calls), [c.read for c in calls]  # one ahead at most
        got += [x async for x in merged]  # it reads again: everything, each call in order
        for i, call in enumerate(calls):
            assert [k for j, k in got if j == i] == list(range(call.n))

    asyncio.run(main())


# 20 logprobs a token: ~330 bytes a message, so 1,000 tokens overfill the router's 64 KiB
# gRPC window (neuron_channel.channel_options) many times over.
LONG = {"stream": True, "n": 2, "logprobs": True, "top_logprobs": 20}


def _other(fl, **model: Any) -> None:
    """`other` (on n2 alone) with these limits; n2 waits for KV as a neuron's admission does."""
    def go() -> None:
        fl.n2.models["other"] = FakeModel("other", **model)
        fl.n2.b.kv_wait_secs = 3.0
        fl.n2.changed()
    fl.lt.call(go)

    def seen() -> bool:  # the router's view of n2 has the new limits
        status = fl.state.registry.links["n2"].status
        return any(m.model == "other" and m.limits.context == model["context"]
                   for m in status.models) if status else False
    end = time.monotonic() + 10
    while not fl.lt.call(seen):
        assert time.monotonic() < end, "the router never saw n2's new limits"
        time.sleep(0.02)


def test_a_choice_waiting_for_kv_is_not_blocked_by_its_own_sibling(fl):
    # The pool holds one choice's reservation (1,008 tokens of 1,600), not two: choice 1 is
    # admitted once choice 0 ends. Before, nobody read choice 0 until every choice was
    # admitted, so its window filled and it stopped (a neuron pauses it), holding the KV
    # choice 1 waited for: 503 overloaded after kv_max_wait_secs.
    _other(fl, context=2048, output=1024, num_blocks=100)
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", timeout=30, json={
            "model": "other", "max_tokens": 1000, **LONG,
            "messages": [{"role": "user", "content": "[[tokens:1000]] go"}]}) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    tokens = [sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == i
                  and c["choices"][0]["logprobs"]) for i in (0, 1)]
    finish = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"]}
    assert tokens == [1000, 1000] and finish == {0: "length", 1: "length"}


def test_once_every_choice_is_admitted_a_stalled_client_stops_them_all(fl, monkeypatch):
    # Choice 0 is read ahead until choice 1 is admitted (0.2 s later), then no more: a
    # client that reads nothing stops every choice's reads (and the neuron: it pauses them)
    _other(fl, context=32768, output=20000, num_blocks=4096)
    fl.n2.b.late_choice_secs = 0.2
    opened: list[Any] = []
    ahead_at_open: list[tuple[bool, bool]] = []  # (read ahead, still reading ahead) a choice
    open_all = serve._open_all

    async def recorded(*args: Any, **kw: Any) -> Any:
        got = await open_all(*args, **kw)
        opened.extend(got)
        ahead_at_open.extend((c.reader is not None, c.reading_ahead) for c in got)
        return got
    monkeypatch.setattr(serve, "_open_all", recorded)
    body = json.dumps({"model": "other", "max_tokens": 20000, **LONG, "messages": [
        {"role": "user", "content": "[[tokens:20000]] go"}]}).encode()
    sock = post_to_a_small_window(fl.url, body)
    try:
        assert sock.recv(256).startswith(b"HTTP/1.1 200")
        # choice 0 was read ahead while choice 1 waited; once both were in, neither is
        assert ahead_at_open == [(True, False), (False, False)], ahead_at_open

        def readers_done() -> bool:  # the read in flight when it stopped brought one more
            return fl.lt.call(lambda: all(c.reader is None or c.reader.done() for c in opened))
        end = time.monotonic() + 10
        while not readers_done():
            assert time.monotonic() < end, "a choice is still read ahead"
            time.sleep(0.02)
        ids = [g.req_id for g in fl.n2.requests[-2:]]
        # the buffers fill, then the reads stop
        now = until_flat(lambda: fl.lt.call(lambda: [fl.n2.sent.get(i, 0) for i in ids]))
        assert max(now) < 20000, now  # both stopped, neither read to its end
    finally:
        sock.close()
