"""A finished reply's schema check (helexa/router/reply_check.py) runs in the work pool's
background lane, where nobody awaits it: whatever it finds, or fails at, is logged. A reply
too deep to walk (a valid one 450 levels deep against a recursive schema, or one cut at
max_tokens that kept opening arrays) is logged as a violation saying it went unchecked; a
check that raises is `request.schema_check_failed`, with its request, and counted."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import structlog

from helexa.config.router import LimitsConfig, RouterConfig
from helexa.router import agent_request, encode, reply_check
from helexa.router.app import RouterState
from helexa.router.openai_api import ParsedRequest

RECURSIVE = {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}
CTX = {"req_id": "r1", "principal": "alice", "model": "m"}


@pytest.fixture(scope="module")
def state() -> Iterator[RouterState]:
    s = RouterState(RouterConfig(limits=LimitsConfig(schema_workers=2)), None)
    yield s
    s.work_pool.close()


def checked(state: RouterState, text: str, finish: str = "stop") -> list[dict]:
    req = ParsedRequest(kind="chat", model="m", messages=[], response_schema=RECURSIVE,
                        unenforced=["response_format: maxItems"])
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
