"""A client's strings come back, and go to the router's log, at a bounded size: a refusal
names the key or value at fault, but a 4 MB unknown key was an 8 MB reply, and a 4 MB
`model` 12 MB of router log (every request line carries the model)."""

from __future__ import annotations

import json

import pytest
import structlog.testing

from helexa.router.request_model import MAX_MODEL_CHARS

BIG = "x" * 60_000  # within the fleet's 64 KiB body cap
MSG = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"anthropic-version": "2023-06-01"}
REPLY_BYTES = 4096  # a refusal's whole reply, its message and param clipped
LOG_CHARS = 4096  # a request's log lines together
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def _post(http, path: str, body: dict):
    """The reply, and the size of what the router logged of it (a generation endpoint's
    refusal is a request.rejected line, with the model and the message)."""
    with structlog.testing.capture_logs() as logs:
        r = http.post(path, json=body, headers=ANTHROPIC)
    logged = sum(len(json.dumps(e, default=str)) for e in logs)
    assert len(r.content) < REPLY_BYTES and logged < LOG_CHARS, (len(r.content), logged)
    if path in GENERATION:  # the meter read the line that carries them
        assert "request.rejected" in [e["event"] for e in logs], logs
    return r


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": BIG, "messages": MSG}),
    ("/v1/completions", {"model": BIG, "prompt": "hi"}),
    ("/v1/messages", {"model": BIG, "max_tokens": 4, "messages": MSG}),
    ("/v1/messages/count_tokens", {"model": BIG, "messages": MSG}),
    ("/v1/responses", {"model": BIG, "input": "hi"}),
    ("/tokenize", {"model": BIG, "prompt": "hi"}),
    ("/detokenize", {"model": BIG, "tokens": [1]}),
])
def test_a_model_name_longer_than_any_id_is_a_400_that_does_not_echo_it(fl, http, path, body):
    r = _post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert f"{MAX_MODEL_CHARS}" in err["message"] and err.get("param", "model") == "model"
    ok = http.post(path, json={**body, "model": "tiny"}, headers=ANTHROPIC)
    assert ok.status_code == 200, ok.text  # the same body with a real name is served


@pytest.mark.parametrize(("path", "body", "param"), [
    # an unknown key: named (its head and tail), not echoed whole
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, BIG: 1}, "x"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG,
                              "stream_options": {BIG: True}}, "stream_options.x"),
    # a value out of its enum, a tool the choice names that is not there
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": BIG, "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": BIG}}}, "tool_choice"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": BIG}]}]}, "messages[0].content[0]"),
])
def test_a_refusal_quoting_a_client_string_is_bounded(fl, http, path, body, param):
    r = _post(http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param") is None or err["param"].startswith(param), err.get("param")
    assert "characters]" in err["message"]  # says how much it left out
