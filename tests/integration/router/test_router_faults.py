"""Faults and spreading with real processes: a client leaving frees KV, a neuron draining or
killed mid-stream, a refused request failing over, a burst spreading over two neurons."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket

import httpx2
import openai
import pytest
from router_procs import key_of, router_config, wait_for
from support.neuron import start_neuron, write_neuron_config

MSG = [{"role": "user", "content": "Write a long story about a lighthouse."}]


def kv_whole(router, neuron: str, model: str = "tiny") -> bool:
    m = router.metrics()

    def g(name):
        return m.get((name, (("model", model), ("neuron", neuron))))
    return (g("helexa_neuron_kv_used_bytes") == 0 and g("helexa_neuron_kv_reserved_bytes") == 0
            and g("helexa_neuron_in_flight") == 0 and g("helexa_neuron_queued") == 0
            and g("helexa_neuron_kv_free_bytes") == g("helexa_neuron_kv_total_bytes") > 0)


def test_client_disconnect_frees_kv_on_the_neuron(router):
    with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {key_of('carol')}"}, json={
            "model": "tiny", "messages": MSG, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        # While it streams, the router's mirror shows the reservation on some neuron.
        busy = wait_for(lambda: [n for n in ("na", "nb") if router.metric(
            "helexa_neuron_in_flight", neuron=n, model="tiny") == 1], timeout=5)
    # Gone: the router cancels the call, the neuron releases every block.
    wait_for(lambda: kv_whole(router, busy[0]), timeout=10)
    assert router.metric("helexa_router_requests_total", model="tiny", code="499") >= 1
    # The span closes as docs/observability.md says: request.done with client_gone, for the journal.
    done = [json.loads(line) for line in router.log_path.read_text().splitlines()
            if '"request.done"' in line and '"principal":"carol"' in line]
    assert done and done[-1]["client_gone"] is True and done[-1]["component"] == "router"


def test_client_disconnect_of_a_non_streaming_request_frees_kv_on_the_neuron(router):
    def gone_lines() -> int:
        return sum(1 for line in router.log_path.read_text().splitlines()
                   if '"request.done"' in line and '"principal":"carol"' in line
                   and '"client_gone":true' in line)
    before, gone_before = router.metric("helexa_router_requests_total", model="tiny",
                                        code="499"), gone_lines()
    body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 1500,
                       "ignore_eos": True}).encode()
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:  # a client that will hang up
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                     b"Authorization: Bearer " + key_of("carol").encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Running on some neuron (over Complete: nothing comes back until the end).
        busy = wait_for(lambda: [n for n in ("na", "nb") if router.metric(
            "helexa_neuron_in_flight", neuron=n, model="tiny") == 1], timeout=5)
    wait_for(lambda: kv_whole(router, busy[0]), timeout=10)
    assert router.metric("helexa_router_requests_total", model="tiny", code="499") == before + 1
    wait_for(lambda: gone_lines() == gone_before + 1, timeout=5)


def test_refusal_before_first_byte_fails_over_to_the_other_neuron(router):
    # One request per principal per neuron: dave's second request is refused (429) by the
    # neuron his conversation hashes to, where his first one runs, and retried on the other.
    before = router.metric("helexa_router_refusals_total", neuron="na", model="tiny",
                           code="rate_limit_exceeded") + router.metric(
        "helexa_router_refusals_total", neuron="nb", model="tiny", code="rate_limit_exceeded")
    with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {key_of('dave')}"}, json={
            "model": "tiny", "messages": MSG, "max_tokens": 1500, "stream": True,
            "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        wait_for(lambda: sum(router.metric("helexa_neuron_in_flight", neuron=n, model="tiny")
                             for n in ("na", "nb")) == 1, timeout=5)
        reply = router.client("dave").chat.completions.create(model="tiny", messages=MSG,
                                                              max_tokens=3)
        assert reply.choices[0].message.content is not None
    after = router.metric("helexa_router_refusals_total", neuron="na", model="tiny",
                          code="rate_limit_exceeded") + router.metric(
        "helexa_router_refusals_total", neuron="nb", model="tiny", code="rate_limit_exceeded")
    assert after == before + 1


def test_burst_spreads_over_both_neurons(router):
    def sel(n):
        return router.metric("helexa_router_selections_total", neuron=n, model="tiny")
    before = {n: sel(n) for n in ("na", "nb")}

    def one(i: int):
        return router.client(f"p{i}").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "the same opening"}],
            max_tokens=100, extra_body={"ignore_eos": True})

    # 100 tokens each, so the eight overlap at the router even when a loaded machine
    # starts the client threads one after another
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    assert all(r.usage.completion_tokens == 100 for r in replies)
    got = {n: sel(n) - before[n] for n in ("na", "nb")}
    assert sum(got.values()) == 8 and min(got.values()) >= 2, got


def test_draining_then_killed_neuron_mid_stream(router, neurons, rdir, tiny_model_dir):
    cfg = {"server": {"name": "nd", "listen": "127.0.0.1:0", "token_file": "token",
                      "drain_secs": 30.0, "heartbeat_secs": 1.0},
           "engine": {"torch_threads": 1}, "kv": {"kv_budget_mb": 1},
           "models": [{"id": "doomed", "path": str(tiny_model_dir)}]}
    nd = start_neuron(write_neuron_config(rdir / "nd.toml", cfg), log_path=rdir / "nd.log")
    base = router_config(rdir, neurons)
    try:
        with_nd = {**base, "neurons": {**base["neurons"], "endpoints": [
            *base["neurons"]["endpoints"], {"name": "nd", "address": nd.address}]}}
        router.reload(with_nd)  # SIGHUP: a new neuron joins without a restart
        wait_for(lambda: "doomed" in {m.id for m in router.client().models.list()}, timeout=15)
        stream = router.client("alice").chat.completions.create(
            model="doomed", messages=MSG, max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        nd.signal(signal.SIGTERM)  # drain: in-flight work goes on, new work is refused
        wait_for(lambda: _refused_shutting_down(router), timeout=10)
        nd.proc.kill()  # now it dies mid-stream
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert e.value.body["code"] == "upstream_error"
        # Nobody serves it now: 503 service_unavailable (the model is known, not gone).
        with pytest.raises(openai.InternalServerError) as e:
            router.client("bob").chat.completions.create(model="doomed", messages=MSG)
        assert e.value.code == "service_unavailable" and e.value.response.headers["retry-after"]
    finally:
        nd.stop(timeout_secs=5)
        router.reload(base)


def _refused_shutting_down(router) -> bool:
    try:
        router.client("bob").chat.completions.create(model="doomed", messages=MSG, max_tokens=1)
    except openai.InternalServerError as e:
        return e.code == "shutting_down" and int(e.response.headers["retry-after"]) >= 1
    return False
