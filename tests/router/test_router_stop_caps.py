"""The stop conditions a client may ask for are bounded (docs/api.md, "Chat and completions:
shared fields"): a stop string of more than MAX_STOP_CHARS characters, or more than
MAX_STOP_TOKEN_IDS stop_token_ids, is a 400 naming the field on every front end that takes
it, and a neuron is sent each stop id once."""

from __future__ import annotations

import httpx2
import pytest

from helexa.router.request_model import MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

MSG = [{"role": "user", "content": "hello"}]
LONG = "x" * (MAX_STOP_CHARS + 1)


def err(r: httpx2.Response) -> dict:
    assert r.status_code == 400, r.text[:300]
    return r.json()["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MSG, "stop": LONG}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["\n", LONG]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": [LONG]}, "stop[0]"),
    ("/v1/messages", {"messages": MSG, "max_tokens": 3, "stop_sequences": [LONG]},
     "stop_sequences[0]"),
    ("/v1/chat/completions", {"messages": MSG,
                              "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
     "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids"),
])
def test_stop_conditions_over_their_cap_are_a_400_naming_the_field(fl, path, body, param):
    r = httpx2.post(fl.url + path, timeout=30, json={"model": "tiny", **body})
    if path == "/v1/messages":
        e = r.json()["error"]
        assert r.status_code == 400 and e["type"] == "invalid_request_error"
        assert param in e["message"], e
    else:
        e = err(r)
        assert e["param"] == param and e["code"] == "invalid_request_error", e
    assert not fl.n1.requests and not fl.n2.requests  # no neuron was asked


def test_at_the_caps_the_request_is_served_and_each_stop_id_goes_once(fl):
    ids = [5, 3, 5, *range(100, 100 + MAX_STOP_TOKEN_IDS - 4), 3]
    assert len(ids) == MAX_STOP_TOKEN_IDS
    r = httpx2.post(fl.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MSG, "max_tokens": 2, "n": 2,
        "stop": ["y" * MAX_STOP_CHARS], "stop_token_ids": ids})
    assert r.status_code == 200, r.text[:300]
    sent = fl.n1.requests + fl.n2.requests
    assert len(sent) == 2
    for g in sent:
        assert list(g.stop_token_ids) == list(dict.fromkeys(ids))  # first-seen order
        assert list(g.stop) == ["y" * MAX_STOP_CHARS]
