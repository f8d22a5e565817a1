"""One client cannot take the router's work pool from everyone: a real router over a real
neuron, with a pool of one worker and four places waiting, two of them at most one principal's
(limits.schema_per_principal). Key A floods it with bodies slow to parse (a chat of 230,000
turns, over half a second of parsing each); A's requests past its share are 429 in its API's envelope while
key B's request in the same moment is served (not 503, nor left behind A's backlog); and
when A's clients leave mid-parse, the pool's counts return to zero and A has its whole share
again. A finished reply's schema check runs in the pool's background lane, end to end."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx2
import pytest
import tomli_w
from router_procs import RouterProcess, key_of, router_over, tiny_neuron, wait_for
from support.neuron import NeuronProcess

from helexa.router.auth import hash_key

MSG = [{"role": "user", "content": "Say hello."}]
SHARE = 2
# 6.7 MB, parsed on the one worker, then 404 (no such model): the router's work, not the
# neuron's, is what the flood costs.
SLOW = json.dumps({"model": "no-such-model", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "x"}] * 230_000},
                  separators=(",", ":")).encode()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[NeuronProcess, RouterProcess]]:
    d = tmp_path_factory.mktemp("workfair")
    neuron = tiny_neuron(d, "nw", tiny_model_dir, kv_mb=4)
    (d / "keys.toml").write_text(tomli_w.dumps(
        {"keys": {hash_key(key_of(p)): p for p in ("alice", "bob")}}))
    with router_over(neuron, d, {
        "server": {"listen": "127.0.0.1:0"},
        "auth": {"keys_file": "keys.toml"},
        "neurons": {"endpoints": [{"name": "nw", "address": neuron.address}]},
        "timeouts": {"unhealthy_after_secs": 2.0, "reconnect_max_secs": 0.5},
        "limits": {"schema_workers": 1, "schema_queue_depth": 4,
                   "schema_per_principal": SHARE}}) as router:
        yield neuron, router


def headers(principal: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key_of(principal)}", "Content-Type": "application/json"}


def pool_idle(router: RouterProcess) -> bool:
    return (router.metric("helexa_router_work_tasks") == 0
            and router.metric("helexa_router_work_principals") == 0)


@dataclass
class Flood:
    """`n` slow bodies from one principal, each in its own thread; what each got and when."""

    router: RouterProcess
    principal: str
    n: int
    path: str = "/v1/chat/completions"
    answers: list[tuple[int, dict[str, str], bytes, float]] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Flood:
        def send() -> None:
            r = httpx2.post(self.router.url + self.path, content=SLOW,
                            headers=headers(self.principal), timeout=120)
            self.answers.append((r.status_code, dict(r.headers), r.content, time.monotonic()))
        self.threads = [threading.Thread(target=send, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()
        return self

    def join(self) -> None:
        for t in self.threads:
            t.join(120)

    def codes(self) -> list[int]:
        return sorted(a[0] for a in self.answers)


def flooded(router: RouterProcess, flood: Flood) -> bool:
    """Every body of the flood has been read and either refused or taken by the pool."""
    taken = router.metric("helexa_router_work_tasks")
    return taken >= SHARE and taken + len(flood.answers) >= flood.n


def test_a_flood_from_one_key_is_429_while_another_key_is_served(pair):
    _, router = pair
    wait_for(lambda: pool_idle(router), timeout=30)
    flood = Flood(router, "alice", 8).start()
    wait_for(lambda: flooded(router, flood), timeout=30, every=0.01)
    t_bob = time.monotonic()
    r = httpx2.post(router.url + "/v1/chat/completions", headers=headers("bob"), timeout=60,
                    json={"model": "tiny", "messages": MSG, "max_tokens": 4})
    assert r.status_code == 200, r.text[:300]
    flood.join()
    # In the same moment: B asked while A's share of the pool was still being parsed.
    assert max(a[3] for a in flood.answers) > t_bob
    codes = flood.codes()
    # A's share parsed (a body that came after one was done may have had its turn too).
    assert set(codes) == {404, 429} and codes.count(429) >= flood.n // 2, codes
    for status, hdrs, body, _ in flood.answers:
        if status == 429:
            err = json.loads(body)["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert "limits.schema_per_principal" in err["message"]
            assert int(hdrs["retry-after"]) >= 1
    assert router.metric("helexa_router_work_refusals_total",
                         reason="principal_share") >= flood.n - SHARE
    assert '"router.work_refused"' in router.log_path.read_text()
    wait_for(lambda: pool_idle(router), timeout=30)


def test_over_its_share_a_key_hears_429_in_each_apis_envelope(pair):
    """While A holds its share: A's Messages call is 429 in Anthropic's envelope and its
    /tokenize in OpenAI's; B's Messages call is served."""
    _, router = pair
    wait_for(lambda: pool_idle(router), timeout=30)
    flood = Flood(router, "alice", SHARE).start()
    wait_for(lambda: router.metric("helexa_router_work_tasks") >= SHARE, timeout=30, every=0.01)
    body = {"model": "tiny", "max_tokens": 4, "messages": MSG}
    got: dict[str, httpx2.Response] = {}

    def send(name: str, path: str, json_body: dict) -> None:
        got[name] = httpx2.post(router.url + path, json=json_body, headers=headers("alice"),
                                timeout=30)
    sends = [threading.Thread(target=send, args=args) for args in [
        ("a", "/v1/messages", body), ("t", "/tokenize", {"model": "tiny", "prompt": "hi"})]]
    for th in sends:
        th.start()
    for th in sends:
        th.join(30)
    a, t = got["a"], got["t"]
    b = httpx2.post(router.url + "/v1/messages", json=body, headers=headers("bob"), timeout=60)
    assert a.status_code == 429 and a.headers["retry-after"] == "1", a.text[:300]
    assert a.json()["type"] == "error" and a.json()["error"]["type"] == "rate_limit_error"
    assert t.status_code == 429 and t.json()["error"]["code"] == "rate_limit_exceeded"
    assert b.status_code == 200 and b.json()["type"] == "message", b.text[:300]
    flood.join()
    assert flood.codes() == [404] * SHARE  # parsed in turn, then no such model
    wait_for(lambda: pool_idle(router), timeout=30)


def test_counts_return_to_zero_when_the_flooding_clients_leave(pair):
    """A's clients send their slow bodies and hang up while they are parsed or wait to be:
    the pool frees what waited at once and what ran when its thread is done, and A then has
    its whole share again."""
    _, router = pair
    wait_for(lambda: pool_idle(router), timeout=30)
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer {key_of('alice')}\r\n"
            f"Content-Length: {len(SLOW)}\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(SHARE):
            s = socket.create_connection((host, int(port)))
            s.sendall(head + SLOW)
            socks.append(s)
        wait_for(lambda: router.metric("helexa_router_work_tasks") >= SHARE, timeout=30,
                 every=0.01)
    finally:
        for s in socks:
            s.close()
    # One of them ran (about a second of parsing left), the other waited: both given back.
    wait_for(lambda: pool_idle(router), timeout=10)
    codes: list[int] = []

    def send() -> None:
        codes.append(httpx2.post(router.url + "/v1/chat/completions", headers=headers("alice"),
                                 json={"model": "tiny", "messages": MSG, "max_tokens": 4},
                                 timeout=60).status_code)
    sends = [threading.Thread(target=send) for _ in range(SHARE)]
    for t in sends:
        t.start()
    for t in sends:
        t.join(60)
    assert codes == [200] * SHARE, codes
    wait_for(lambda: pool_idle(router), timeout=10)


def test_a_finished_replys_schema_check_runs_in_the_background(pair):
    """`uniqueItems` is not enforced while decoding: the grammar forces a reply of two equal
    tags, which the check after it was sent, on the pool's background lane, logs as a
    violation; the key's tasks and the background lane's then return to zero. (That the
    reply does not wait for the check: tests/router/test_reply_check.py.)"""
    _, router = pair
    wait_for(lambda: pool_idle(router), timeout=30)
    schema = {"type": "object", "required": ["tags"], "additionalProperties": False,
              "properties": {"tags": {"type": "array", "items": {"const": "a"}, "minItems": 2,
                                      "maxItems": 2, "uniqueItems": True}}}
    r = httpx2.post(router.url + "/v1/chat/completions", headers=headers("alice"), timeout=60,
                    json={"model": "tiny", "messages": MSG, "max_tokens": 32,
                          "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "t", "schema": schema}}})
    assert r.status_code == 200, r.text[:300]
    assert "tags: uniqueItems" in r.headers["x-helexa-unenforced-schema"]
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"tags": ["a", "a"]}
    req_id = r.headers["x-request-id"]

    def logged() -> list[dict]:
        lines = [json.loads(x) for x in router.log_path.read_text().splitlines()
                 if req_id in x and x.startswith("{")]
        return [x for x in lines if x.get("event", "").startswith("request.schema_")]
    wait_for(lambda: logged(), timeout=10, every=0.05)
    (line,) = logged()
    assert line["event"] == "request.schema_violation" and line["principal"] == "alice", line
    assert line["violations"] == ["$.tags: items are not unique"], line
    wait_for(lambda: pool_idle(router)
             and router.metric("helexa_router_work_background_tasks") == 0, timeout=10)
