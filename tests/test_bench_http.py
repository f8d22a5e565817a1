"""`helexa bench` against a scripted OpenAI-style server: every way a request can end is a
counted outcome, tokens per chunk give per-token ITL, Ctrl-C keeps what was measured."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from helexa.loadgen.bench import main
from helexa.loadgen.load import parse_scenario
from helexa.loadgen.request import Record
from helexa.loadgen.stats import knee, pct, summarise

GAP = 0.02  # seconds between the fake's chunks


def _chunk(content: str, ids: list[int]) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": content}, "token_ids": ids}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Script:
    """A fake server whose n-th request does modes[n % len(modes)]."""

    def __init__(self, modes: list[str]) -> None:
        self.modes = modes
        self.seen = 0
        self.bodies: list[dict] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        mode = self.modes[self.seen % len(self.modes)]
        self.seen += 1
        if mode == "refuse":
            return web.json_response({"error": {"message": "too many for alice", "type": "x",
                                                "code": "rate_limit_exceeded"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "slow":
            await asyncio.sleep(5)
        # three chunks: 1 token, 2 tokens, 1 token, GAP apart
        for i, ids in enumerate(([1], [2, 3], [4])):
            if mode == "fail" and i == 1:
                await resp.write(b'data: {"error": {"message": "neuron died", '
                                 b'"code": "upstream_error"}}\n\n')
                return resp
            if mode == "drop" and i == 1:
                if request.transport is not None:
                    request.transport.close()
                return resp
            await resp.write(_chunk("w ", ids))
            await asyncio.sleep(GAP)
        usage = {"prompt_tokens": 40, "completion_tokens": 4,
                 "prompt_tokens_details": {"cached_tokens": 16}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                         + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _model(request: web.Request) -> web.Response:
    return web.json_response({"id": request.match_info["model"], "limit": {"context": 100}})


def _serve(script: Script) -> tuple[str, asyncio.AbstractEventLoop, web.AppRunner]:
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", script.chat)
    app.router.add_get("/v1/models/{model}", _model)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", loop, runner


def _close(loop: asyncio.AbstractEventLoop, runner: web.AppRunner) -> None:
    async def close() -> None:
        await runner.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:  # handlers still asleep in "slow"
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
    asyncio.run_coroutine_threadsafe(close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture
def fake() -> Iterator[tuple[str, Script]]:
    script = Script(["ok"])
    url, loop, runner = _serve(script)
    yield url, script
    _close(loop, runner)


def _records(path: Path) -> list[Record]:
    lines = path.read_text().splitlines()
    assert "run" in json.loads(lines[0])
    return [Record(**json.loads(line)) for line in lines[1:]]


def test_every_way_a_request_ends_is_counted(fake, tmp_path, capsys):
    url, script = fake
    script.modes = ["ok", "refuse", "fail", "drop", "slow", "ok"]
    out = tmp_path / "run.jsonl"
    rc = main(["--url", url, "--model", "m", "--scenario", "chat:16", "--requests", "12",
               "--timeout", "1", "--abandon", "0.17", "--out", str(out), "--no-progress",
               "--principal", "bench"])
    recs = _records(out)
    assert len(recs) == 12 and rc == 0
    by = {}
    for r in recs:
        by.setdefault(r.outcome, []).append(r)
    # every sixth request (indices 5 and 11, both "ok") hangs up after its first token
    assert {k: len(v) for k, v in by.items()} == {
        "ok": 2, "refused": 2, "upstream_error": 2, "disconnected": 2, "timeout": 2,
        "abandoned": 2}
    refused = by["refused"][0]
    assert (refused.status, refused.code, refused.reason) == (429, "rate_limit_exceeded",
                                                               "too many for alice")
    assert by["upstream_error"][0].code == "upstream_error"
    assert all(r.e2e is not None and r.e2e >= 1.0 for r in by["timeout"])
    assert all(len(r.chunks) == 1 for r in by["abandoned"])
    ok = by["ok"][0]
    assert (ok.prompt_tokens, ok.completion_tokens, ok.cached_tokens) == (40, 4, 16)
    assert [k for _, k in ok.chunks] == [1, 2, 1]
    assert all(b["user"] == "bench" and b["return_token_ids"] for b in script.bodies)
    table = capsys.readouterr().out
    assert "rate_limit_exceeded:" in table and "ttft p50" in table


def test_itl_is_per_token_not_per_chunk():
    r = Record(endpoint="e", scenario="s", index=0, t_sent=0.0, outcome="ok",
               ttft=0.1, chunks=[(0.1, 1), (0.3, 2), (0.4, 1)])
    assert r.itl() == pytest.approx([0.1, 0.1, 0.1])  # the 2-token chunk is two gaps of 0.1
    row = summarise([r])
    assert row["itl_p50_ms"] == pytest.approx(100) and row["itl_mean_ms"] == pytest.approx(100)
    assert pct([1, 2, 3, 4], 0.5) == 2 and pct([1, 2, 3, 4], 0.99) == 4 and pct([], 0.5) is None


def test_knee_is_the_first_level_over_the_bound():
    rows = [{"endpoint": "e", "concurrency": c, "ttft_p99_ms": t}
            for c, t in ((1, 20.0), (2, 40.0), (4, 900.0), (8, 2000.0))]
    assert knee(rows, 500)["concurrency"] == 4
    assert knee(rows, 5000) is None


def test_scenarios_parse_and_say_what_is_wrong():
    sc = parse_scenario("chat:512,sweep:8")
    assert [lv.concurrency for lv in sc.levels()] == [1, 2, 4, 8]
    assert parse_scenario("chat:64,rate:2.5").rate == 2.5
    assert parse_scenario("turns:3,concurrency:2").turns == 3 and parse_scenario("long").long
    with pytest.raises(Exception, match="bad scenario part `chat:x`"):
        parse_scenario("chat:x")


def test_an_unreachable_endpoint_is_an_error_outcome_not_a_traceback(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = tmp_path / "run.jsonl"
    rc = main(["--url", f"http://127.0.0.1:{port}", "--model", "m", "--scenario", "chat:8",
               "--requests", "2", "--out", str(out), "--no-progress"])
    assert rc == 1 and [r.outcome for r in _records(out)] == ["error", "error"]


def test_ctrl_c_ends_cleanly_with_what_was_measured(fake, tmp_path):
    url, script = fake
    script.modes = ["ok", "ok", "slow"]  # the third request hangs: Ctrl-C finds it in flight
    out = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", "bench", "--url", url, "--model", "m",
         "--scenario", "chat:8", "--requests", "50", "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while script.seen < 3 and time.monotonic() < deadline:  # wait on what the server saw
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    recs = _records(out)
    assert [r.outcome for r in recs] == ["ok", "ok", "interrupted"]
    assert "interrupted: 3 requests measured" in stdout


def test_sessions_resend_their_history_turn_by_turn(fake, tmp_path):
    url, script = fake
    out = tmp_path / "run.jsonl"
    assert main(["--url", url, "--model", "m", "--scenario", "chat:8,turns:3", "--requests", "2",
                 "--out", str(out), "--no-progress"]) == 0
    recs = _records(out)
    assert sorted((r.session, r.turn) for r in recs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                         (1, 2)]
    by_len: dict[int, list[dict]] = {}
    for b in script.bodies:
        by_len.setdefault(len(b["messages"]), []).append(b)
    assert sorted(by_len) == [1, 3, 5]  # user; user, assistant, user; ...
    third = by_len[5][0]["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "w w w "  # the reply of the first turn, sent back
    firsts = {b["messages"][0]["content"] for b in script.bodies}
    assert len(firsts) == 2  # one opening per session, kept through its turns
    # the next turn asks for the whole conversation so far plus a new chat:8 turn
    turn1 = next(r for r in recs if (r.session, r.turn) == (0, 1))
    assert turn1.prompt_tokens_asked == 40 + 4 + 8


def test_endpoints_are_interleaved_in_rotating_order(tmp_path):
    other = Script(["ok"])
    url_b, loop_b, runner_b = _serve(other)
    first = Script(["ok"])
    url_a, loop_a, runner_a = _serve(first)
    try:
        out = tmp_path / "run.jsonl"
        assert main(["--url", f"a={url_a}", "--url", f"b={url_b}", "--model", "m",
                     "--scenario", "chat:8", "--requests", "4", "--rounds", "2",
                     "--out", str(out), "--no-progress"]) == 0
        recs = sorted(_records(out), key=lambda r: r.t_sent)
        assert [(r.endpoint, r.index) for r in recs] == [
            ("a", 0), ("a", 2), ("b", 0), ("b", 2), ("b", 1), ("b", 3), ("a", 1), ("a", 3)]
    finally:
        _close(loop_a, runner_a)
        _close(loop_b, runner_b)


def test_long_prompts_fill_the_advertised_context_and_rate_is_recorded(fake, tmp_path):
    url, _ = fake
    out = tmp_path / "run.jsonl"
    assert main(["--url", url, "--model", "m", "--scenario", "long", "--scenario",
                 "chat:8,rate:40", "--requests", "6", "--max-tokens", "10", "--out", str(out),
                 "--no-progress"]) == 0
    recs = _records(out)
    assert {r.prompt_tokens_asked for r in recs if r.scenario == "long"} == {100 - 10 - 1}
    poisson = [r for r in recs if r.scenario == "chat:8,rate:40"]
    assert len(poisson) == 6 and all(r.rate == 40 and r.concurrency is None for r in poisson)


def test_a_prompt_near_the_context_is_found_through_a_tokenize_that_refuses_past_it():
    """helexa's /tokenize refuses a chat past the context, saying "at least N tokens" (the
    count it reached): the bench reads that as a count over its target, not as no count,
    and still finds the longest prompt under the target (a word a token here)."""
    import aiohttp

    from helexa.loadgen.prompts import exact_prompt, remote_counter

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        n = sum(len(m["content"].split()) for m in body["messages"])
        if n > 100:  # counted up to the context and a little past it, as helexa does
            return web.json_response({"error": {
                "message": "This model's maximum context length is 100 tokens; the chat has "
                           "at least 101 tokens (counted no further …)",
                "code": "context_length_exceeded", "param": "messages"}}, status=400)
        return web.json_response({"count": n, "max_model_len": 100, "tokens": [1] * n})

    async def run() -> int | None:
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with aiohttp.ClientSession() as session:
                count = await remote_counter(session, url, "m")
                assert count is not None
                _, got = await exact_prompt(count, [], 90, salt=1)
                return got
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == 90
