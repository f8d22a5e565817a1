"""One client must not take the fleet down: each attack on a real router over a real neuron,
with another client's long stream open. The attack earns its 4xx within 2 s, the bystander's
stream is neither cut nor stalled (no gap of 1 s between its chunks), the neuron stays in
rotation and the pool's ledger is whole afterwards. And a client that stops reading has its
stream ended (its KV back) after timeouts.client_write_secs."""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import httpx2
import openai
import pytest
import tomli_w
from router_procs import RouterProcess, ledger_whole, start_router, tiny_neuron, wait_for
from support.neuron import NeuronProcess
from support.stalled_client import post_to_a_small_window

MSG = [{"role": "user", "content": "Write a long story about a lighthouse."}]
JSON = {"Content-Type": "application/json"}
WRITE_SECS = 1.0  # the router's timeouts.client_write_secs here
# Its required property is itself: it compiles, and the neuron's matcher failed on the first
# token (a 502 before the router checked for it).
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[NeuronProcess, RouterProcess]]:
    d = tmp_path_factory.mktemp("bystander")
    # a KV wait shorter than the router's stream_idle_secs (30 s), which ends a stalled holder
    neuron = tiny_neuron(d, "nb", tiny_model_dir, kv_mb=8, admission={"kv_max_wait_secs": 10.0})
    (d / "router.toml").write_text(tomli_w.dumps(router_config(neuron, WRITE_SECS)))
    router = start_router(d / "router.toml")
    try:
        wait_for(lambda: healthy(router), timeout=30)
        yield neuron, router
    finally:
        router.stop()
        neuron.stop(timeout_secs=15)


def router_config(neuron: NeuronProcess, write_secs: float, min_rate: float = 0.0,
                  idle_secs: float | None = None) -> dict:
    return {
        "server": {"listen": "127.0.0.1:0", "max_body_bytes": 8 * 1024 * 1024},
        "neurons": {"endpoints": [{"name": "nb", "address": neuron.address}]},
        # A neuron silent for 1 s leaves rotation: a loop held that long would show.
        "timeouts": {"unhealthy_after_secs": 1.0, "reconnect_max_secs": 0.5,
                     "client_write_secs": write_secs, "client_min_bytes_per_sec": min_rate,
                     "client_idle_secs": idle_secs or write_secs}}


@contextlib.contextmanager
def client_write_secs(neuron: NeuronProcess, router: RouterProcess, secs: float,
                      min_rate: float = 0.0, idle_secs: float | None = None) -> Iterator[None]:
    """The router's timeouts.client_write_secs at `secs`, client_min_bytes_per_sec at
    `min_rate` and client_idle_secs at `idle_secs` (or `secs`) (a reload) for the block."""
    def reload(write_secs: float, rate: float, idle: float | None) -> None:
        before = router.log_path.read_text().count('"config.reloaded"')
        router.reload(router_config(neuron, write_secs, rate, idle))
        wait_for(lambda: router.log_path.read_text().count('"config.reloaded"') > before,
                 timeout=15)
    reload(secs, min_rate, idle_secs)
    try:
        yield
    finally:
        reload(WRITE_SECS, 0.0, None)


def healthy(router: RouterProcess) -> bool:
    return httpx2.get(router.url + "/health", timeout=5).json()["neurons"]["nb"]["healthy"]


def output_limit(router: RouterProcess) -> int:
    models = httpx2.get(router.url + "/v1/models", timeout=5).json()["data"]
    return int(next(m for m in models if m["id"] == "tiny")["limit"]["output"])


@dataclass
class Bystander:
    """A long stream read in a thread: when each chunk came, and how it ended."""

    router: RouterProcess
    max_tokens: int
    arrivals: list[float] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)  # the test has seen enough
    finished: bool = False  # the stream ended by itself
    error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "tiny", "messages": MSG, "max_tokens": self.max_tokens,
                "stream": True, "ignore_eos": True}
        try:
            with httpx2.stream("POST", self.router.url + "/v1/chat/completions", json=body,
                               timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.arrivals.append(time.monotonic())
                        self.lines.append(line)
                        if len(self.arrivals) == 3:
                            self.started.set()
                    if self.stop.is_set():
                        return  # leaving closes the stream: the router cancels the call
                self.finished = True
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def longest_gap_secs(self, since: float, until: float) -> float:
        times = [t for t in self.arrivals if since <= t <= until]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}} for i in range(n)]


def _attacks() -> list[tuple[str, str, bytes, str]]:
    """(name, path, body, what the refusal's message must name)."""
    deep = "[" * 1000 + "1" + "]" * 1000
    def schema(pattern_chars: int) -> dict:
        return {"name": "x", "schema": {"type": "object", "properties": {
            "s": {"type": "string", "pattern": "a" * pattern_chars}}}}
    return [
        ("30,000 tools", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "tools": _tools(30_000)}).encode(),
         "limits.max_tools"),
        ("30,000 tools, Messages", "/v1/messages", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "tools": [
                {"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(30_000)]}
        ).encode(), "limits.max_tools"),
        ("a 300 KB pattern", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": schema(300_000)}}).encode(),
         "limits.max_pattern_chars"),
        ("a 7 MB schema", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": schema(7_000_000)}}).encode(),
         "limits.max_schema_bytes"),
        ("a schema only an endless value satisfies", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}}).encode(),
         "no finite value satisfies it"),
        ("the same, Messages", "/v1/messages", json.dumps(
            {"model": "tiny", "messages": MSG, "max_tokens": 4, "output_config": {
                "format": {"type": "json_schema", "schema": ENDLESS}}}).encode(),
         "no finite value satisfies it"),
        # Each prompt of a batch is a neuron call: 10,000 of them held the loop for seconds.
        ("a batch of 10,000 prompts", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": ["a"] * 10_000, "max_tokens": 2}).encode(),
         "max_per_principal"),
        ("JSON 1,000 deep", "/v1/chat/completions",
         f'{{"model": "tiny", "messages": {json.dumps(MSG)}, "metadata": {deep}}}'.encode(),
         "deeper than 128 levels"),
        ("JSON 1,000 deep, Messages", "/v1/messages",
         f'{{"model": "tiny", "max_tokens": 4, "messages": {json.dumps(MSG)}, '
         f'"metadata": {{"user_id": {deep}}}}}'.encode(), "deeper than 128 levels"),
    ]


def test_the_engines_first_constrained_request_stalls_no_stream(pair):
    """The grammar library starts at model load, not on the first request that needs it
    (that took every running stream 3-6 s): the module's neuron has served no constrained
    request yet, and the bystander's chunks keep coming while one is compiled and decoded."""
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    by = Bystander(router, output_limit(router) // 4)  # room in the pool for one more
    thread = threading.Thread(target=by.run, daemon=True)
    thread.start()
    assert by.started.wait(60) and by.error is None, by.error
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["city", "n"]}
    t0 = time.monotonic()
    r = httpx2.post(router.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MSG, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "o", "schema": schema}}})
    t1 = time.monotonic()
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    time.sleep(0.5)  # chunks after the constrained request, too
    by.stop.set()
    thread.join(30)
    assert by.error is None and not by.finished, (by.error, by.lines[-3:])
    assert by.longest_gap_secs(t0, t1 + 0.5) < 1.0
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)


def test_each_attack_is_refused_fast_while_a_bystander_streams_on(pair):
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    attacks = _attacks()
    by = Bystander(router, output_limit(router) - 64)
    thread = threading.Thread(target=by.run, daemon=True)
    thread.start()
    assert by.started.wait(60) and by.error is None, by.error
    t_first = time.monotonic()
    with httpx2.Client(base_url=router.url, timeout=30) as http:
        for name, path, body, names in attacks:
            t0 = time.monotonic()
            r = http.post(path, content=body, headers=JSON)
            took = time.monotonic() - t0
            assert r.status_code == 400, (name, r.status_code, r.text[:300])
            assert took < 2.0, (name, took)
            err = r.json()["error"]
            assert names in err["message"], (name, err)
            if path == "/v1/messages":
                assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
            assert healthy(router), name
    t_last = time.monotonic()
    time.sleep(0.5)  # a stream cut by the last attack would show by now
    by.stop.set()
    thread.join(30)
    assert by.error is None and not by.finished, (by.error, by.lines[-3:])
    assert not any('"error"' in line for line in by.lines), by.lines[-3:]
    assert by.longest_gap_secs(t_first, t_last) < 1.0
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)


@pytest.mark.slow  # 12 s alone, 30 s in a loaded run
def test_200000_turns_stall_no_stream(pair):
    """A chat of 200,000 short turns, and the same to /tokenize, at once: the router built
    their messages' protos (and /tokenize the JSON of 1.6 million ids) on the loop that
    carries every stream, which held the bystander's chunks for over a second."""
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    by = Bystander(router, output_limit(router) - 64)
    thread = threading.Thread(target=by.run, daemon=True)
    thread.start()
    assert by.started.wait(60) and by.error is None, by.error
    turns = [{"role": "user", "content": "x"}] * 200_000
    codes: dict[str, int] = {}

    def send(path: str, body: dict) -> None:
        codes[path] = httpx2.post(router.url + path, json=body, timeout=120).status_code
    t0 = time.monotonic()
    sends = [threading.Thread(target=send, args=(path, body)) for path, body in [
        ("/v1/chat/completions", {"model": "tiny", "messages": turns, "max_tokens": 4}),
        ("/tokenize", {"model": "tiny", "messages": turns})]]
    for t in sends:
        t.start()
    for t in sends:
        t.join(120)
    t1 = time.monotonic()
    by.stop.set()
    thread.join(30)
    # Over the context (a 400 naming it), and counted.
    assert codes == {"/v1/chat/completions": 400, "/tokenize": 200}, codes
    assert by.error is None and not by.finished, (by.error, by.lines[-3:])
    assert by.longest_gap_secs(t0, t1) < 1.0
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)


def test_a_client_that_stops_reading_is_ended_and_its_kv_returned(pair):
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": output_limit(router) - 64,
                       "stream": True, "ignore_eos": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    sock = post_to_a_small_window(router.url, body)
    try:
        assert sock.recv(256).startswith(b"HTTP/1.1 200")
        # Read nothing more. The neuron generates, the buffers fill, then within
        # client_write_secs of that the router ends the stream and the call.
        wait_for(lambda: not ledger_whole(router, "nb"), timeout=10)
        wait_for(lambda: ledger_whole(router, "nb"), timeout=60)
        assert '"client_stalled"' in router.log_path.read_text()
        assert healthy(router)
    finally:
        sock.close()


def test_a_whole_reply_nobody_reads_is_dropped_not_held(pair):
    """A non-streaming reply of megabytes (16 choices with 20 top logprobs a token) to a
    client that reads none of it: after client_write_secs the router aborts the connection
    and frees the reply. It kept every such reply in its memory for as long as the client
    kept the socket open, so a client sending request after request grew it without end."""
    _, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 200, "n": 16,
                       "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()

    def done() -> int:
        return router.log_path.read_text().count('"request.done"')
    before = done()
    sock = post_to_a_small_window(router.url, body)
    try:
        # Read nothing: the reply (about 4 MB) outgrows the kernel's buffers. Once it is
        # made, give the router a few client_write_secs, then read what is left.
        wait_for(lambda: done() > before, timeout=60)
        time.sleep(3 * WRITE_SECS)
        sock.settimeout(5)
        got, ended = 0, False
        try:
            while chunk := sock.recv(1 << 16):
                got += len(chunk)
            ended = True
        except ConnectionResetError:
            ended = True
        except TimeoutError:
            pass  # still open: the router holds the reply's connection
        assert ended and got < 3_000_000, (ended, got)
        # written a piece at a time (client_stream.send_whole), it ends as a stalled stream
        assert '"outcome":"client_stalled"' in router.log_path.read_text()
        assert healthy(router)
    finally:
        sock.close()
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.slow
def test_stalled_streams_hold_little_router_memory(tmp_path, tiny_model_dir):
    """8 clients that read nothing, for 15 s (under client_write_secs): the router's memory
    stays flat. It grew 43 MB in 20 s when each stream kept every logprob it had sent."""
    neuron = tiny_neuron(tmp_path, "nm", tiny_model_dir, kv_mb=32, max_slots=8)
    (tmp_path / "router.toml").write_text(tomli_w.dumps({
        "server": {"listen": "127.0.0.1:0"},
        "neurons": {"endpoints": [{"name": "nm", "address": neuron.address}]},
        "timeouts": {"client_write_secs": 60}}))
    router = start_router(tmp_path / "router.toml")
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: httpx2.get(router.url + "/health").json()["neurons"]["nm"]["healthy"],
                 timeout=30)
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 3000,
                           "stream": True, "ignore_eos": True, "logprobs": True,
                           "top_logprobs": 20}).encode()
        before = _rss_mb(router.proc.pid)
        for _ in range(8):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        peak, end = before, time.monotonic() + 15
        while time.monotonic() < end:  # a measurement over a span: sampled, not awaited
            peak = max(peak, _rss_mb(router.proc.pid))
            time.sleep(0.5)
        assert peak - before < 16, (before, peak)
    finally:
        for s in socks:
            s.close()
        router.stop()
        neuron.stop(timeout_secs=15)


@pytest.mark.slow
def test_a_whole_reply_of_megabytes_stalls_no_stream(tmp_path, tiny_model_dir):
    """16 choices of 1,500 tokens with 20 top logprobs each, not streamed: about 32 MB of
    JSON. The router built and encoded it on the loop that carries every stream, which held
    a bystander's chunks for over 2 s."""
    neuron = tiny_neuron(tmp_path, "nw", tiny_model_dir, kv_mb=64, max_slots=20,
                         admission={"max_in_flight": 20, "anon_max_in_flight": 20})
    (tmp_path / "router.toml").write_text(tomli_w.dumps({
        "server": {"listen": "127.0.0.1:0"},
        "neurons": {"endpoints": [{"name": "nw", "address": neuron.address}]}}))
    router = start_router(tmp_path / "router.toml")
    try:
        wait_for(lambda: httpx2.get(router.url + "/health").json()["neurons"]["nw"]["healthy"],
                 timeout=30)
        by = Bystander(router, 12_000)
        thread = threading.Thread(target=by.run, daemon=True)
        thread.start()
        assert by.started.wait(60) and by.error is None, by.error
        host, port = router.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": 1500, "n": 16,
                           "ignore_eos": True, "logprobs": True, "top_logprobs": 20}).encode()
        t0 = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=120) as s:
            # A raw socket: reading the reply costs this process (the bystander's) little.
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            first, got = s.recv(64), 0
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        t1 = time.monotonic()
        by.stop.set()
        thread.join(30)
        assert first.startswith(b"HTTP/1.1 200") and got > 20_000_000, (first, got)
        assert by.error is None and not by.finished, (by.error, by.lines[-3:])
        assert by.longest_gap_secs(t0, t1) < 1.0
    finally:
        router.stop()
        neuron.stop(timeout_secs=15)


def _dechunk(raw: bytes) -> bytes | None:
    """An HTTP/1.1 chunked body, whole; None while its last chunk has not come."""
    out, i = bytearray(), 0
    while (j := raw.find(b"\r\n", i)) >= 0:
        size = int(raw[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        if len(raw) < j + 2 + size + 2:
            return None
        out += raw[j + 2:j + 2 + size]
        i = j + 2 + size + 2
    return None


def _read_to_the_end(sock: socket.socket, buf: bytes = b"") -> tuple[bytes, bytes]:
    """The response's head and whole (chunked) body, read from the start (`buf`: what was
    read of it before), the client reading on at full speed: its receive buffer grown (a
    4 KiB window on loopback moves some 100 KB/s, acknowledgements waiting on delayed
    ACKs, and 2 MB took 20 s), the body joined once its last chunk came."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.settimeout(30)
    pieces = [buf]
    while not b"".join(pieces[-2:]).endswith(b"\r\n0\r\n\r\n"):
        if not (chunk := sock.recv(1 << 20)):
            break
        pieces.append(chunk)
    buf = b"".join(pieces)
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if sep and (body := _dechunk(rest)) is not None:
        return head, body
    raise AssertionError(f"the stream was closed before its end: {buf[-300:]!r}")


def _events(body: bytes) -> list[dict]:
    """A stream's events; it ends with exactly one [DONE]."""
    data = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1, data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _text(events: list[dict]) -> str:
    return "".join(c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])


def _tokens(events: list[dict]) -> list[str]:
    return [t["token"] for e in events for c in e["choices"] if c.get("logprobs")
            for t in c["logprobs"]["content"]]


def _paused(router: RouterProcess) -> float:
    return router.metric("helexa_neuron_paused", model="tiny", neuron="nb")


def test_a_client_that_stops_reading_pauses_its_request_until_it_reads(pair):
    """Two clients stop reading a long stream: the neuron pauses both (it makes no tokens
    for them and they hold no decode row) while a third client's stream flows on. One
    reads again and gets its whole stream, the text the third got for the same greedy
    request; the other never does, and is ended after client_write_secs with every KV
    block back. Before, both kept generating into the router's gRPC channel."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    n = 1000
    stall = {"model": "tiny", "messages": MSG, "stream": True, "ignore_eos": True,
             "temperature": 0, "logprobs": True, "top_logprobs": 20,
             "stream_options": {"include_usage": True}}
    body = json.dumps({**stall, "max_tokens": n}).encode()
    paused_before = {r["req_id"] for r in neuron.logs("request.paused")}
    socks: list[socket.socket] = []
    # 15 s: the window now runs from the client's last byte taken (for these, the stream's
    # first), not from when the buffers filled; on a loaded box filling them and seeing
    # both paused (the gauge comes through Watch) took more than 5 s
    with client_write_secs(neuron, router, 15.0):
        reference: list[bytes] = []
        arrivals: list[float] = []

        def read_reference() -> None:  # the same request (lighter to read), as it comes
            with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60,
                               json={**stall, "max_tokens": 1600, "logprobs": False,
                                     "top_logprobs": None}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        reference.append(line.encode() + b"\n")
                        arrivals.append(time.monotonic())
        thread = threading.Thread(target=read_reference, daemon=True)
        thread.start()
        try:
            socks = [post_to_a_small_window(router.url, body) for _ in range(2)]
            # (the reference too may be paused a moment where this process reads it slower
            # than the neuron makes it: the same rule)
            wait_for(lambda: _paused(router) >= 2, timeout=30)
            t0 = time.monotonic()
            time.sleep(0.5)
            assert _paused(router) >= 2  # still: neither stalled client read a byte
            flowing = [t for t in arrivals if t >= t0]
            assert len(flowing) > 10, len(flowing)  # the third stream went on meanwhile
            assert max(b - a for a, b in zip([t0, *flowing], flowing, strict=False)) < 1.0
            head, whole = _read_to_the_end(socks[0])  # one reads again
            assert head.startswith(b"HTTP/1.1 200")
            events = _events(whole)
            usage = events[-1]["usage"]
            assert usage["completion_tokens"] == n, usage
            assert [c["finish_reason"] for e in events for c in e["choices"]
                    if c["finish_reason"]] == ["length"]
            assert len(_tokens(events)) == n  # a logprob a token
            thread.join(60)
            assert not thread.is_alive()
            text = _text(events)
            assert text and _text(_events(b"".join(reference))).startswith(text)  # in order
            # the other never reads again: ended, its KV back
            wait_for(lambda: ledger_whole(router, "nb") and _paused(router) == 0, timeout=30)
        finally:
            for s in socks:
                s.close()
    # the neuron's word on both stalled requests
    ids = {r["req_id"] for r in neuron.logs("request.paused")} - paused_before
    done = [(r["finish_reason"], r["completion_tokens"]) for r in neuron.logs("request.done")
            if r["req_id"] in ids]
    assert ("length", n) in done, done
    gone = [t for why, t in done if why == "client_gone"]
    assert len(gone) == 1 and gone[0] < 0.8 * n, done  # paused: it made little
    # each request's done line counts its pauses and the time they took, paused ones too
    # (the reference may have paused a moment too, where this process read it slowly)
    paced = [(r["finish_reason"], r.get("pauses", 0), r.get("paused_ms", 0))
             for r in neuron.logs("request.done") if r["req_id"] in ids]
    assert all(k >= 1 and ms > 0 for _, k, ms in paced), paced
    stalled = [ms for why, _, ms in paced if why == "client_gone"]
    assert len(stalled) == 1 and stalled[0] > 400, paced  # paused until it was ended
    assert healthy(router)


def test_a_stream_of_two_choices_completes_when_one_must_wait_for_the_others_kv(pair):
    """A stalled stream (paused, its client reads nothing) holds most of the pool; each
    choice of an n=2 stream fits what is left, not both, so choice 1 waits for the KV choice
    0 holds. The router reads choice 0 ahead meanwhile, so it runs to its end and frees
    that KV. Before, nobody read it until every choice was admitted: the neuron paused it,
    and choice 1 got 503 after kv_max_wait_secs (10 s here)."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    n = 1000
    hog = json.dumps({"model": "tiny", "messages": MSG, "ignore_eos": True, "stream": True,
                      "logprobs": True, "top_logprobs": 20,
                      "max_tokens": output_limit(router) - 3 * n // 2}).encode()
    with client_write_secs(neuron, router, 60.0):  # the holder stays, paused
        holder = post_to_a_small_window(router.url, hog)
        try:
            wait_for(lambda: _paused(router) == 1, timeout=30)
            with httpx2.stream("POST", router.url + "/v1/chat/completions", timeout=60,
                               json={"model": "tiny", "messages": MSG, "max_tokens": n,
                                     "n": 2, "stream": True, "ignore_eos": True,
                                     "logprobs": True, "top_logprobs": 20}) as r:
                assert r.status_code == 200, r.read()
                body = b"".join(r.iter_bytes())
            events = _events(body)
            got = [sum(len(c["logprobs"]["content"]) for e in events for c in e["choices"]
                       if c["index"] == i and c.get("logprobs")) for i in (0, 1)]
            assert got == [n, n]
        finally:
            holder.close()  # its call is cancelled: its KV back
        wait_for(lambda: ledger_whole(router, "nb"), timeout=30)


# A trickle, scaled to run in seconds: the window is 8 s and the floor 256 KiB/s (2 MiB a
# window); the trickle takes 12 KiB every 0.25 s (48 KiB/s), a fifth of the floor. That is
# enough to let each of the router's writes finish well within the window: the kernel frees
# the router's send buffer for it a third at a time (some 170 KB), every 3.5 s here. The tiny
# model with 20 top logprobs makes more than the trickle takes, so much waits for it.
TRICKLE_WINDOW_SECS = 8.0
TRICKLE_FLOOR = 256 * 1024
SDK_WINDOW_SECS = 2.0  # the SDK reader's: several windows in 12 s of reading


def _trickle(sock: socket.socket, piece: int, every_secs: float, for_secs: float,
             fast: threading.Event | None = None) -> tuple[int, float | None]:
    """Read `piece` bytes every `every_secs` for `for_secs` (all there is at once, once
    `fast` is set): (bytes read, when the router ended the connection, or None)."""
    got, end = 0, time.monotonic() + for_secs
    sock.settimeout(2)
    while time.monotonic() < end:
        want = piece if fast is None or not fast.is_set() else 1 << 30
        try:
            while want > 0:
                chunk = sock.recv(want)
                if not chunk:
                    return got, time.monotonic()
                got += len(chunk)
                want -= len(chunk)
        except ConnectionResetError:
            return got, time.monotonic()
        except TimeoutError:
            pass  # nothing more in the window yet: try again at the next tick
        if fast is None or not fast.is_set():
            time.sleep(every_secs)
    return got, None


def test_a_trickle_is_ended_once_a_request_waits_for_its_kv(pair):
    """A client that reads, but under timeouts.client_min_bytes_per_sec once it is behind,
    holds its request (paused, its KV kept) while nobody waits for that KV: a slow reader is
    paced, not cut. Once a request waits for admission behind it, it is ended within a few
    seconds, its KV comes back and the waiting request is admitted (its wait, 10 s here,
    would have ended in a 503). Before, each write waited client_write_secs afresh: a
    trickle that let one finish now and then held its KV until its deadline; and then the
    floor cut every slow reader, waited for or not."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": output_limit(router) - 64,
                       "stream": True, "ignore_eos": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    answer: list[httpx2.Response] = []

    def stalls() -> int:
        return router.log_path.read_text().count('"outcome":"client_stalled"')
    stalls_before = stalls()

    def bystander() -> None:  # 200 tokens: more than the trickle's request leaves free
        answer.append(httpx2.post(router.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": MSG, "max_tokens": 200, "ignore_eos": True}))
    with client_write_secs(neuron, router, TRICKLE_WINDOW_SECS, TRICKLE_FLOOR):
        sock = post_to_a_small_window(router.url, body)
        try:
            # behind: its buffers full, the neuron paused the request
            wait_for(lambda: _paused(router) >= 1, timeout=60)
            # 24 KiB/s, a tenth of the floor, some 400 KB behind all the while
            got, _ = _trickle(sock, 12 * 1024, 0.5, for_secs=TRICKLE_WINDOW_SECS + 4)
            # (the router's log: an ended client reads on what its kernel had, some 400 KB)
            assert stalls() == stalls_before, f"a trickle of {got} bytes was ended"
            assert got > 128 * 1024, got  # it did read: more than a window's worth of drains
            trickled: list[tuple[int, float | None]] = []
            ended = threading.Event()
            reader = threading.Thread(target=lambda: trickled.append(
                _trickle(sock, 12 * 1024, 0.5, for_secs=60, fast=ended)), daemon=True)
            reader.start()
            thread = threading.Thread(target=bystander, daemon=True)
            thread.start()
            # ended within the bystander's KV wait (10 s); the client reads on what the
            # kernel still held for it (some 400 KB, 16 s of this trickle: here at once),
            # then the end
            wait_for(lambda: stalls() > stalls_before, timeout=8)
            ended.set()
            thread.join(60)
            reader.join(60)
            assert trickled and trickled[0][1] is not None, trickled
            assert answer and answer[0].status_code == 200, answer and answer[0].text[:300]
            assert answer[0].json()["usage"]["completion_tokens"] == 200
            wait_for(lambda: ledger_whole(router, "nb") and _paused(router) == 0, timeout=60)
            log = router.log_path.read_text()
            assert '"outcome":"client_stalled"' in log
            # the log says it was a trickle, and the floor it missed
            assert "timeouts.client_min_bytes_per_sec over timeouts.client_write_secs" in log
        finally:
            sock.close()
    assert healthy(router)


def test_an_sdk_client_slower_than_the_floor_is_not_ended_when_nobody_waits(pair):
    """The openai SDK reading a long stream, doing 20 ms of work a chunk: 50 chunks a
    second, far behind the model (which has finished before the client read half), and
    well under the floor for several windows (each chunk carries 20 top logprobs, some
    1.7 KB: about 85 KB/s against 256 KiB/s, scaled as the trickle's). Nobody waits for
    what it holds, so it gets its whole stream. Before, it was ended at the first window (a
    review saw it at the defaults: 3.2 KB/s under 4 KiB/s, then APIConnectionError). The
    stream (1 MB) is more than the router's buffers hold (some 600 KB: a shorter one is
    all in its kernel's send buffer once made, its request done, and nothing is judged)."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    n = 600  # 12 s of reading at 50 chunks a second, behind for three windows and more
    # A 16 KiB receive buffer (a phone's, a proxy's): loopback's own sizing took most of
    # the stream into this process's kernel, where it counted as read.
    http = httpx.Client(transport=httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)]), timeout=120)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0,
                           http_client=http)
    stalls_before = router.log_path.read_text().count('"client_stalled"')
    tokens, usage, req_id, half_at = 0, None, "", 0.0
    # (taking nothing: client_idle_secs, longer than this SDK client's TCP steps apart)
    with client_write_secs(neuron, router, SDK_WINDOW_SECS, TRICKLE_FLOOR, idle_secs=30.0):
        t0 = time.monotonic()
        stream = client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=n, stream=True, logprobs=True,
            top_logprobs=20, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        for chunk in stream:
            req_id = chunk.id.removeprefix("chatcmpl-")
            for c in chunk.choices:
                tokens += len(c.logprobs.content or []) if c.logprobs else 0
            usage = chunk.usage or usage
            if tokens >= n // 2 and not half_at:
                half_at = time.time()
            time.sleep(0.02)  # the client's work on each chunk
        secs = time.monotonic() - t0
    assert tokens == n and usage is not None and usage.completion_tokens == n, (tokens, usage)
    assert secs > 3 * SDK_WINDOW_SECS, secs
    assert router.log_path.read_text().count('"client_stalled"') == stalls_before
    # behind: the neuron finished it before the client had read half of it
    done = [r for r in neuron.logs("request.done") if r["req_id"] == req_id]
    assert done and done[0]["completion_tokens"] == n, done
    finished = datetime.datetime.fromisoformat(done[0]["ts"].replace("Z", "+00:00"))
    assert finished.timestamp() < half_at, (done[0]["ts"], half_at)
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)


def test_a_client_that_pauses_over_a_window_with_nobody_waiting_reads_on(pair):
    """A client that stops reading a long stream for two windows (client_write_secs), behind
    all the while (its request paused), then reads on gets all of it while nobody waits
    behind it: taking nothing ends it only after client_idle_secs then (a slow reader's TCP
    shows its taking in steps over a window apart). Before, taking nothing for a window
    ended it whoever waited."""
    neuron, router = pair
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
    n = 1500  # 2.5 MB with its logprobs: far more than the buffers hold
    body = json.dumps({"model": "tiny", "messages": MSG, "max_tokens": n, "stream": True,
                       "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
                       "stream_options": {"include_usage": True}}).encode()
    window = 3.0
    stalls_before = router.log_path.read_text().count('"client_stalled"')
    done_before = {r["req_id"] for r in neuron.logs("request.done")}
    with client_write_secs(neuron, router, window, TRICKLE_FLOOR, idle_secs=60.0):
        sock = post_to_a_small_window(router.url, body)
        sock.settimeout(30)
        try:
            read = sock.recv(1 << 16)
            # behind from its first read (its 4 KiB window is full at once): the pause is
            # counted from there
            time.sleep(2 * window)
            head, whole = _read_to_the_end(sock, read)
        finally:
            sock.close()
    assert head.startswith(b"HTTP/1.1 200")
    events = _events(whole)
    assert events[-1]["usage"]["completion_tokens"] == n
    assert len(_tokens(events)) == n
    assert router.log_path.read_text().count('"client_stalled"') == stalls_before
    # it was behind: the neuron paused its request for most of the two windows
    done = [r for r in neuron.logs("request.done") if r["req_id"] not in done_before]
    assert len(done) == 1 and done[0].get("paused_ms", 0) > 1000 * window, done
    wait_for(lambda: ledger_whole(router, "nb"), timeout=15)
