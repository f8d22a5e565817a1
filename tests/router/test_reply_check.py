"""A finished reply's schema check (helexa/router/reply_check.py) runs in the work pool's
background lane, where nobody awaits it: `check_schema` returns before it runs, it counts
toward no principal's share, and whatever it finds, or fails at, is logged. A reply
too deep to walk (a valid one 450 levels deep against a recursive schema, or one cut at
max_tokens that kept opening arrays) is logged as a violation saying it went unchecked; a
check that raises is `request.schema_check_failed`, with its request, and counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import structlog
from router_fleet import ALICE_KEY

from helexa.config.router import LimitsConfig, RouterConfig
from helexa.router import agent_request, encode, reply_check
from helexa.router.app import RouterState
from helexa.router.openai_api import ParsedRequest

RECURSIVE = {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}
TAGS = {"type": "object", "required": ["tags"], "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
CTX = {"req_id": "r1", "principal": "alice", "model": "m"}


@pytest.fixture(scope="module")
def state() -> Iterator[RouterState]:
    s = RouterState(RouterConfig(limits=LimitsConfig(schema_workers=2)), None)
    yield s
    s.work_pool.close()


def checked(state: RouterState, text: str, finish: str = "stop",
            schema: dict = RECURSIVE, dropped: str = "maxItems") -> list[dict]:
    req = ParsedRequest(kind="chat", model="m", messages=[], response_schema=schema,
                        unenforced=[f"response_format: {dropped}"])
    choice = encode.Choice(index=0, text=[text], finish_reason=finish)
    with structlog.testing.capture_logs() as logs:
        reply_check.check_schema(state, req, "m", [], [choice], CTX)
        deadline = time.monotonic() + 10
        while state.work_pool.background and time.monotonic() < deadline:
            time.sleep(0.005)
    assert state.work_pool.background == 0
    return [x for x in logs if x["event"].startswith("request.schema_")]


@pytest.mark.parametrize(("text", "finish"), [
    ("[" * 450 + "]" * 450, "stop"),  # valid, and as deep as the schema allows
    ("[" * 3000, "length"),  # cut at max_tokens while it kept opening arrays
])
def test_a_reply_too_deep_to_walk_is_logged_as_not_checked(state, text, finish):
    (line,) = checked(state, text, finish)
    assert line["event"] == "request.schema_violation" and line["req_id"] == "r1"
    assert line["violations"] == ["$: not checked (the JSON nests deeper than 128 levels)"]


def test_a_reply_within_the_depth_limit_is_checked(state):
    (line,) = checked(state, "[" * 126 + "[[], []]" + "]" * 126)  # 128 levels
    assert line["violations"] == ["$" + "[0]" * 126 + ": more than 1 items"]
    assert checked(state, "[" * 128 + "]" * 128) == []


def test_a_keyword_the_grammar_dropped_is_checked(state):
    (line,) = checked(state, '{"tags": ["a", "b", "a"]}', schema=TAGS, dropped="uniqueItems")
    assert line["event"] == "request.schema_violation"
    assert line["violations"] == ["$.tags: items are not unique"]
    assert checked(state, '{"tags": ["a", "b"]}', schema=TAGS, dropped="uniqueItems") == []


def test_check_schema_returns_before_the_check_runs_and_counts_in_no_share(state, monkeypatch):
    returned, release, ran = threading.Event(), threading.Event(), []

    def held(*args: object) -> list[str]:
        ran.append(returned.wait(5))  # run inline, check_schema has not returned: False
        release.wait(5)
        return ["$: held"]
    monkeypatch.setattr(agent_request, "reply_violations", held)
    req = ParsedRequest(kind="chat", model="m", messages=[], response_schema=TAGS,
                        unenforced=["response_format: uniqueItems"])
    choice = encode.Choice(index=0, text=["{}"], finish_reason="stop")
    with structlog.testing.capture_logs() as logs:
        reply_check.check_schema(state, req, "m", [], [choice], CTX)
        returned.set()
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.005)
        # running: the background lane's, not alice's share nor the pool's bound
        pool = state.work_pool
        assert (ran, pool.background, pool.tasks_of("alice"), pool.tasks) == ([True], 1, 0, 0)
        assert [x for x in logs if x["event"].startswith("request.schema_")] == []
        release.set()
        while pool.background and time.monotonic() < deadline:
            time.sleep(0.005)
    assert pool.background == 0
    (line,) = [x for x in logs if x["event"].startswith("request.schema_")]
    assert line["event"] == "request.schema_violation" and line["violations"] == ["$: held"]


def test_a_check_that_raises_is_logged_with_its_request_and_counted(state, monkeypatch):
    def bug(*args: object) -> list[str]:
        raise KeyError("a bug of ours")
    monkeypatch.setattr(agent_request, "reply_violations", bug)
    (line,) = checked(state, "[]")
    assert line["event"] == "request.schema_check_failed" and line["req_id"] == "r1"
    assert line["principal"] == "alice" and line["error"] == "KeyError('a bug of ours')"
    assert line["exc_info"] is True  # the traceback goes with the line
    text = state.metrics.render().decode()
    assert "helexa_router_work_background_failures_total 1.0" in text


def test_the_reply_is_sent_while_its_check_still_runs(fl, http, monkeypatch):
    """Through the router: the client has its reply (and alice her next one) while the
    finished reply's check is still held, and the check then logs what it found."""
    release, ran = threading.Event(), threading.Event()

    def held(*args: object) -> list[str]:
        ran.set()
        release.wait(10)  # run inline, this holds the reply (the client gives up at 5 s)
        return ["$: held"]
    monkeypatch.setattr(agent_request, "reply_violations", held)
    alice = {"Authorization": f"Bearer {ALICE_KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with structlog.testing.capture_logs() as logs:
        try:
            r = http.post("/v1/chat/completions", headers=alice, timeout=5, json=body | {
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "t", "schema": TAGS}}})
            assert r.status_code == 200, r.text[:300]
            assert "tags: uniqueItems" in r.headers["x-helexa-unenforced-schema"]
            assert ran.wait(5)
            pool = fl.state.work_pool
            assert (pool.background, pool.tasks_of("alice")) == (1, 0)
            assert http.post("/v1/chat/completions", headers=alice, timeout=5,
                             json=body).status_code == 200
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while fl.state.work_pool.background and time.monotonic() < deadline:
            time.sleep(0.005)
    assert fl.state.work_pool.background == 0
    (line,) = [x for x in logs if x["event"].startswith("request.schema_")]
    assert line["violations"] == ["$: held"] and line["principal"] == "alice"
