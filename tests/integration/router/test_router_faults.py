"""Faults and spreading with real processes: a client leaving frees KV, a neuron draining or
killed mid-stream, or killed before its streams' first tokens (they go on elsewhere), a
refused request failing over, a burst spreading over two neurons."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket

import httpx2
import openai
import pytest
from router_procs import key_of, ledger_whole, neuron_cfg, router_config, wait_for
from support.neuron import start_neuron, start_neurons, stop_all, write_neuron_config

MSG = [{"role": "user", "content": "Write a long story about a lighthouse."}]


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
    wait_for(lambda: ledger_whole(router, busy[0]), timeout=10)
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
    wait_for(lambda: ledger_whole(router, busy[0]), timeout=10)
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


def test_an_engine_failure_tells_the_client_where_the_cause_is_not_what_it_is(
        router, neurons, rdir, tiny_model_dir):
    """The engine dies under a stream that has tokens out: the client's error event says the
    engine failed and under which req_id the neuron logged why, never the engine's own words
    (an exception's text can hold paths); the neuron's request.done for that id has them."""
    cfg = {"server": {"name": "ne", "listen": "127.0.0.1:0", "token_file": "token",
                      "heartbeat_secs": 1.0},
           "engine": {"torch_threads": 1}, "kv": {"kv_budget_mb": 1},
           "models": [{"id": "fragile", "path": str(tiny_model_dir)}]}
    ne = start_neuron(write_neuron_config(rdir / "ne.toml", cfg), log_path=rdir / "ne.log")
    base = router_config(rdir, neurons)
    try:
        router.reload({**base, "neurons": {**base["neurons"], "endpoints": [
            *base["neurons"]["endpoints"], {"name": "ne", "address": ne.address}]}})
        wait_for(lambda: "fragile" in {m.id for m in router.client().models.list()}, timeout=15)
        with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60, headers={
                "Authorization": f"Bearer {key_of('carol')}"}, json={
                "model": "fragile", "messages": MSG, "max_tokens": 2000, "stream": True,
                "ignore_eos": True}) as r:
            req_id = r.headers["x-request-id"]
            lines = r.iter_lines()
            next(lines)
            next(lines)  # a token is out
            (engine,) = ne.engine_pids()
            os.kill(engine, signal.SIGKILL)
            last = [line for line in lines if line][-1]
        err = json.loads(last.removeprefix("data: "))["error"]
        assert err["code"] == "upstream_error"
        assert err["message"] == ("the neuron failed while generating: the engine failed on "
                                  "this request; the neuron's log has the cause under req_id "
                                  f"{req_id}")
        done = ne.wait_for_log("request.done", where=lambda rec: rec["req_id"] == req_id)
        assert done["finish_reason"] == "error"
        assert done["error"].startswith("the engine process exited")
    finally:
        ne.stop(timeout_secs=5)
        router.reload(base)


def _refused_shutting_down(router) -> bool:
    try:
        router.client("bob").chat.completions.create(model="doomed", messages=MSG, max_tokens=1)
    except openai.InternalServerError as e:
        return e.code == "shutting_down" and int(e.response.headers["retry-after"]) >= 1
    return False


@pytest.mark.slow  # two neurons of its own (~10 s to start on a busy 2-core machine)
def test_streams_whose_neuron_dies_before_their_first_token_go_on_on_another(
        router, neurons, rdir, tiny_model_dir):
    """nv has one batch row. A holder stream runs in it; a chat stream, an Anthropic stream
    and a non-streaming call are admitted there and wait for the row (their openings sent:
    the first message comes at admission). ns then joins and nv is killed: the three go on
    on ns, whole and as a greedy run there writes them; the holder, which had tokens out,
    ends with an upstream_error event."""
    def cfg(name: str) -> dict:
        c = neuron_cfg(name, [{"id": "resumable", "path": str(tiny_model_dir)}], 16,
                       max_in_flight=4)
        c["engine"]["max_slots"] = 1
        return c
    pair = start_neurons({n: (write_neuron_config(rdir / f"{n}.toml", cfg(n)), rdir / f"{n}.log")
                          for n in ("nv", "ns")})
    nv = pair["nv"]
    base = router_config(rdir, neurons)

    def with_(*names: str) -> dict:
        return {**base, "neurons": {**base["neurons"], "endpoints": [
            *base["neurons"]["endpoints"],
            *({"name": n, "address": pair[n].address} for n in names)]}}

    def healthy(name: str) -> bool:
        return httpx2.get(router.url + "/health").json()["neurons"].get(
            name, {}).get("healthy", False)

    def auth(p: str) -> dict:
        return {"Authorization": f"Bearer {key_of(p)}"}

    chat = {"model": "resumable", "messages": MSG, "max_tokens": 12, "temperature": 0}
    anth = {"model": "resumable", "messages": MSG, "max_tokens": 12, "temperature": 0,
            "stream": True}
    holder_lines: list[str] = []
    try:
        router.reload(with_("nv"))
        wait_for(lambda: healthy("nv"), timeout=15)
        with concurrent.futures.ThreadPoolExecutor(2) as pool, \
                httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60,
                              headers=auth("p0"), json={**chat, "max_tokens": 8000,
                                                        "stream": True, "ignore_eos": True}) as h:
            holder = h.iter_lines()
            holder_lines += [next(holder), next(holder)]  # the role chunk, then a token
            drain = pool.submit(lambda: holder_lines.extend(holder))
            with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60,
                               headers=auth("p1"), json={**chat, "stream": True}) as c, \
                    httpx2.stream("POST", router.url + "/v1/messages", timeout=60,
                                  headers={"x-api-key": key_of("p2")}, json=anth) as a:
                streamed = [c.iter_lines(), a.iter_lines()]
                openings = [next(streamed[0]), next(streamed[1])]  # admitted on nv
                whole = pool.submit(lambda: httpx2.post(
                    router.url + "/v1/chat/completions", timeout=60, headers=auth("p3"),
                    json=chat))
                wait_for(lambda: router.metric("helexa_neuron_in_flight", neuron="nv",
                                               model="resumable") == 4, timeout=10)
                router.reload(with_("nv", "ns"))
                wait_for(lambda: healthy("ns"), timeout=15)
                nv.proc.kill()
                chat_lines = [openings[0], *streamed[0]]
                anth_raw = "\n".join([openings[1], *streamed[1]])
            drain.result(timeout=30)
            reply = whole.result(timeout=30)
        greedy = router.client("bob").chat.completions.create(**chat).choices[0].message.content
        assert greedy
        chat_lines = [line for line in chat_lines if line]
        assert chat_lines[-1] == "data: [DONE]", chat_lines[-1]
        assert sum('"role"' in line for line in chat_lines) == 1
        assert "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in chat_lines[:-1]) == greedy
        events = [(e.split("\n")[0].removeprefix("event: "), e.split("data: ", 1)[1])
                  for e in anth_raw.split("\n\n") if e.strip()]
        assert events[0][0] == "message_start" and events[-1][0] == "message_stop", events
        assert "".join(json.loads(d)["delta"].get("text", "") for n, d in events
                       if n == "content_block_delta") == greedy
        assert reply.status_code == 200 and \
            reply.json()["choices"][0]["message"]["content"] == greedy
        # the holder had tokens out when nv died: an error event ends its stream
        last = [line for line in holder_lines if line][-1]
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "upstream_error"
        lost = [json.loads(line) for line in router.log_path.read_text().splitlines()
                if '"request.neuron_lost"' in line and '"neuron":"nv"' in line]
        assert len(lost) == 2 and all(r["retry_on"] == "ns" for r in lost), lost
        wait_for(lambda: ledger_whole(router, "ns", "resumable"), timeout=10)
    finally:
        router.reload(base)
        stop_all(pair.values(), timeout_secs=5)
