"""A flood of connections does not freeze a real router over a real neuron: past
server.max_connections (a small cap here) a new connection is answered 503
too_many_connections at once, unread, while a stream already open runs to its last token;
once the flood closes new requests are served and the pool's ledger is whole. The cap per
client address holds one address to its share while another is served, a cap the fd limit
cannot hold is refused with the arithmetic, and the router raises its soft fd limit."""

from __future__ import annotations

import json
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import tomli_w
from router_procs import RouterProcess, ledger_whole, router_over, tiny_neuron, wait_for
from support.neuron import NeuronProcess

CAP = 6
MSG = [{"role": "user", "content": "Write a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[NeuronProcess, RouterProcess]]:
    d = tmp_path_factory.mktemp("conncap")
    neuron = tiny_neuron(d, "nc", tiny_model_dir, kv_mb=8)
    with router_over(neuron, d, router_config(neuron)) as router:
        yield neuron, router


def router_config(neuron: NeuronProcess, **server: int) -> dict:
    # idle sockets outlive the test: read_timeout_secs would close them after 15 s
    return {"server": {"listen": "127.0.0.1:0", "max_connections": CAP,
                       "read_timeout_secs": 120.0, **server},
            "neurons": {"endpoints": [{"name": "nc", "address": neuron.address}]},
            "timeouts": {"reconnect_max_secs": 0.5}}


def reload(router: RouterProcess, config: dict) -> None:
    before = router.log_path.read_text().count('"config.reloaded"')
    router.reload(config)
    wait_for(lambda: router.log_path.read_text().count('"config.reloaded"') > before,
             timeout=15)


def idle_sockets(router: RouterProcess, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    host, port = router.url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
            for _ in range(n)]


def refused(router: RouterProcess, source: str = "127.0.0.1") -> tuple[int, dict, dict]:
    """A request on a new connection: (status, headers, body)."""
    with httpx2.Client(transport=httpx2.HTTPTransport(local_address=source), timeout=10) as c:
        r = c.post(router.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": MSG, "max_tokens": 2})
        return r.status_code, dict(r.headers), r.json()


def test_a_connection_over_the_cap_gets_a_503_and_an_open_stream_finishes(pair):
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nc"), timeout=15)
    refused_before = router.metric("helexa_router_connections_refused_total",
                                   reason="max_connections")
    # A stream in flight (its first chunk read), then the rest of the cap taken by idle sockets.
    with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MSG, "max_tokens": 600, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        flood = idle_sockets(router, CAP - 1)
        try:
            status, headers, body = refused(router)
            assert status == 503, body
            assert body["error"]["code"] == "too_many_connections"
            assert f"server.max_connections = {CAP}" in body["error"]["message"], body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            # The stream goes on under the cap: every token, then [DONE].
            rest = [first, *(line for line in lines if line.startswith("data: "))]
        finally:
            for s in flood:
                s.close()
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 600
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # The flood closed: served again, the refusal counted, every connection let go.
    r = wait_for(lambda: refused(router)[0] == 200, timeout=15)
    assert r
    assert router.metric("helexa_router_connections_refused_total",
                         reason="max_connections") >= refused_before + 1
    assert router.metric("helexa_router_connections_open") == 1  # this scrape's
    log = router.log_path.read_text()
    assert '"http.connection_refused"' in log and '"reason":"max_connections"' in log
    wait_for(lambda: ledger_whole(router, "nc"), timeout=15)


def test_a_flood_held_open_is_refused_and_new_requests_are_served_after_it(pair):
    _, router = pair
    wait_for(lambda: router.metric("helexa_router_connections_open") == 1, timeout=15)
    flood = idle_sockets(router, 40)  # far past the cap: the rest get the 503, unread
    try:
        answered: dict[socket.socket, bytes] = {}
        with selectors.DefaultSelector() as sel:
            for s in flood:
                sel.register(s, selectors.EVENT_READ)
            # every refusal, then a moment for one too many to show
            end = time.monotonic() + 15
            while time.monotonic() < end:
                for key, _ in sel.select(0.5):
                    answered[key.fileobj] = key.fileobj.recv(4096)  # type: ignore[union-attr]
                    sel.unregister(key.fileobj)
                if len(answered) >= 40 - CAP:
                    end = min(end, time.monotonic() + 0.5)
        assert len(answered) == 40 - CAP, len(answered)
        assert all(a.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in a
                   for a in answered.values())
        assert refused(router)[0] == 503
    finally:
        for s in flood:
            s.close()
    wait_for(lambda: refused(router)[0] == 200, timeout=15)
    wait_for(lambda: ledger_whole(router, "nc"), timeout=15)
    assert router.metric("helexa_router_connections_open") == 1


def test_a_refused_client_that_sends_its_whole_body_before_reading_gets_the_503(pair):
    """The refusal's socket is not closed under a request still arriving (a close with unread
    bytes is a reset, which loses the 503 the client has not read yet)."""
    _, router = pair
    wait_for(lambda: router.metric("helexa_router_connections_open") == 1, timeout=15)
    flood = idle_sockets(router, CAP)
    try:
        body = b"x" * (4 * 1024 * 1024)
        with idle_sockets(router, 1)[0] as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in got, got[:200]
    finally:
        for s in flood:
            s.close()
    wait_for(lambda: refused(router)[0] == 200, timeout=15)


def test_the_cap_per_address_holds_one_address_while_another_is_served(pair):
    neuron, router = pair
    reload(router, router_config(neuron, max_connections_per_address=2))
    try:
        mine = idle_sockets(router, 2)
        try:
            status, _, body = refused(router)
            assert status == 503, body
            assert "server.max_connections_per_address = 2" in body["error"]["message"]
            assert refused(router, source="127.0.0.2")[0] == 200  # another address
        finally:
            for s in mine:
                s.close()
        wait_for(lambda: refused(router)[0] == 200, timeout=15)
        assert router.metric("helexa_router_connections_refused_total",
                             reason="per_address") >= 1
    finally:
        reload(router, router_config(neuron))


def test_a_cap_the_fd_limit_cannot_hold_is_refused_with_the_arithmetic(pair, tmp_path):
    neuron, router = pair
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the router raises its soft one so
    too_many = hard + 1
    bad = router_config(neuron, max_connections=too_many)
    # On reload: refused, the running cap kept.
    before = router.log_path.read_text().count('"config.reload_refused"')
    router.reload(bad)
    wait_for(lambda: router.log_path.read_text().count('"config.reload_refused"') > before,
             timeout=15)
    assert f"server.max_connections = {too_many} needs" in router.log_path.read_text()
    flood = idle_sockets(router, CAP)
    try:
        assert refused(router)[0] == 503
    finally:
        for s in flood:
            s.close()
    reload(router, router_config(neuron))
    # At start: the router exits 1 saying why.
    (tmp_path / "bad.toml").write_text(tomli_w.dumps(bad))
    out = subprocess.run([sys.executable, "-m", "helexa.cli", "router", "--config",
                          str(tmp_path / "bad.toml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert re.search(rf"server.max_connections = {too_many} needs {too_many} \+ \d+ .* "
                     rf"may open {hard} .* at most {hard} - \d+ = \d+", out.stderr), out.stderr


@pytest.mark.parametrize("daemon", ["router", "neuron"])
def test_each_daemon_raises_its_soft_fd_limit_to_the_hard_one(tmp_path, tiny_model_dir, daemon):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    config = {"server": {"listen": "127.0.0.1:0"}} if daemon == "router" else {
        "server": {"name": "nl", "listen": "127.0.0.1:0"}, "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 2, "activation_headroom_mb": 0},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}]}
    (tmp_path / "d.toml").write_text(tomli_w.dumps(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", daemon, "--config", str(tmp_path / "d.toml")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        assert proc.stdout is not None
        listening = f"{daemon.upper()} LISTENING "
        assert any(line.startswith(listening) for line in proc.stdout), daemon
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert re.search(rf"Max open files\s+{hard}\s+{hard}", limits), limits
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    line = next(json.loads(x) for x in err.splitlines() if '"process.fd_limit"' in x)
    assert (line["soft_before"], line["limit"], line["hard"]) == (256, hard, hard)
