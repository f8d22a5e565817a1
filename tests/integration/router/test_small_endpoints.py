"""The small endpoints clients probe: tokenize, detokenize, version, max_model_len, 404s."""

from __future__ import annotations

import time

import httpx2
import pytest
from router_procs import key_of
from support.lazy_import import Lazy

from helexa import __version__

anthropic = Lazy("anthropic")

AUTH = {"Authorization": f"Bearer {key_of('alice')}"}
MSG = [{"role": "user", "content": "Tell me about the sea."}]


def test_tokenize_detokenize_round_trip_and_counts_match_usage(router):
    r = httpx2.post(router.url + "/tokenize", headers=AUTH,
                    json={"model": "tiny", "prompt": "hello sea"})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0
    d = httpx2.post(router.url + "/detokenize", headers=AUTH,
                    json={"model": "helexa/balanced", "tokens": body["tokens"]})
    assert d.json() == {"prompt": "hello sea"}
    chat = httpx2.post(router.url + "/tokenize", headers=AUTH,
                       json={"model": "tiny", "messages": MSG}).json()
    usage = router.client().chat.completions.create(model="tiny", messages=MSG,
                                                    max_tokens=2).usage
    assert chat["count"] == usage.prompt_tokens


def test_tokenize_errors_name_the_problem(router):
    r = httpx2.post(router.url + "/tokenize", headers=AUTH, json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx2.post(router.url + "/detokenize", headers=AUTH,
                    json={"model": "tiny", "tokens": [10**6]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx2.post(router.url + "/tokenize", headers=AUTH, json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # tools checked as chat's: parameters that are not an object were the neuron's
    # AttributeError, a 502 with nothing in its log
    for tools, param in (([{"type": "function", "function": {"name": "f", "parameters": [1]}}],
                          "tools[0].function.parameters"),
                         ([{"type": "function"}], "tools[0].function"), ("f", "tools")):
        r = httpx2.post(router.url + "/tokenize", headers=AUTH,
                        json={"model": "tiny", "messages": MSG, "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx2.post(router.url + "/tokenize", json={"model": "tiny",
                                                        "prompt": "x"}).status_code == 401


def test_version_models_max_model_len_and_a_404_naming_the_path(router):
    assert httpx2.get(router.url + "/version").json() == {"version": __version__}
    models = httpx2.get(router.url + "/v1/models", headers=AUTH).json()["data"]
    assert all(m["max_model_len"] == m["limit"]["context"] for m in models)
    # kv.prefix_sharing's default: a key's cached prefixes are its own
    assert {m["id"]: m.get("prefix_sharing") for m in models}["tiny"] == "principal"
    # `created`: when the model became ready on its neuron (this session's), the same again
    assert all(time.time() - 3600 < m["created"] <= time.time() for m in models)
    again = httpx2.get(router.url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["created"] for m in again] == [m["created"] for m in models]
    r = httpx2.post(router.url + "/v1/chat/completion", headers=AUTH, json={})
    assert r.status_code == 404 and "/v1/chat/completion" in r.json()["error"]["message"]


def test_a_text_past_the_context_is_refused_without_counting_it_all(router):
    """`tiny-grow` holds 64 tokens: /tokenize and count_tokens refuse a longer text or chat
    as a prompt is refused (400 context_length_exceeded, "at least": counting stopped past
    the context), rather than tokenise all of it to report the count; a text of the context
    or less is counted as before."""
    long = "the sea is wide and deep " * 40
    for body, param in (({"prompt": long}, "prompt"),
                        ({"messages": [{"role": "user", "content": long}]}, "messages")):
        r = httpx2.post(router.url + "/tokenize", headers=AUTH,
                        json={"model": "tiny-grow", **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert err["param"] == param, err
        assert "maximum context length is 64 tokens" in err["message"], err
        assert "at least" in err["message"], err
    ok = httpx2.post(router.url + "/tokenize", headers=AUTH,
                     json={"model": "tiny-grow", "prompt": "the sea"}).json()
    assert ok["count"] == len(ok["tokens"]) > 0 and ok["max_model_len"] == 64
    a = anthropic.Anthropic(base_url=router.url, api_key=key_of("alice"), max_retries=0,
                            timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.count_tokens(model="tiny-grow", messages=[{"role": "user", "content": long}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "maximum context length is 64 tokens" in e.value.body["error"]["message"]
