"""Refusals that say what is so: a request no neuron could ever serve is a 400 that says why
(sent to no neuron), a bug of the router is a 500 in the envelope counted as 500."""

from __future__ import annotations

import json
import time

import httpx2
import openai
import pytest
import structlog
import structlog.testing

from helexa.router import serve

MSG = [{"role": "user", "content": "hello there"}]


def set_model(fl, seen_as=None, **kw):
    """Set the fake neurons' model fields ``kw``, then wait until the router's candidates
    show them (or ``seen_as``: the candidates' fields that follow from them)."""
    def go():
        for n in (fl.n1, fl.n2):
            for k, v in kw.items():
                setattr(n.models["tiny"], k, v)
            n.changed()
    fl.lt.call(go)

    def seen():
        cands = fl.state.registry.candidates("tiny")
        return len(cands) == 2 and all(getattr(c, k) == v for c in cands
                                       for k, v in (seen_as or kw).items())
    end = time.monotonic() + 10
    while not fl.lt.call(seen):  # the router has the new report
        assert time.monotonic() < end
        time.sleep(0.02)


def sent(fl) -> int:
    return len(fl.n1.requests) + len(fl.n2.requests)


def test_n_over_the_principal_cap_is_400_not_429(fl):
    set_model(fl, max_per_principal=2)  # on each of the two neurons: 4 choices at most
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1, n=5)
    assert e.value.body["param"] == "n" and "max_per_principal 4 in all" in e.value.message
    assert sent(fl) == 0
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1, n=4)
    assert len(r.choices) == 4


def test_n_over_what_the_neurons_hold_at_once_is_400_not_a_503_forever(fl):
    """A neuron holds max_in_flight + max_queue_depth requests at once, whoever sends them:
    more choices than that on every neuron would get a 503 on every retry."""
    set_model(fl, max_in_flight=1, max_queue_depth=1, max_per_principal=64,
              seen_as={"max_held": 2, "max_per_principal": 64})
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1, n=5)
    assert e.value.body["param"] == "n" and "send at most 4" in e.value.message
    assert "max_in_flight + max_queue_depth" in e.value.message
    assert sent(fl) == 0
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1, n=4)
    assert len(r.choices) == 4
    set_model(fl, max_in_flight=64, max_queue_depth=256, seen_as={"max_held": 320})


def test_a_prompt_that_cannot_fit_is_refused_before_any_neuron(fl):
    set_model(fl, context=100)
    # 100 tokens of at most 256 bytes each: 25,600 bytes. Over that, it can never fit.
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "é" * 13_000}])
    assert e.value.code == "context_length_exceeded" and "100" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().completions.create(model="tiny", prompt=list(range(100)))
    assert e.value.code == "context_length_exceeded" and "has 100 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().completions.create(model="tiny", prompt=list(range(50)), max_tokens=51)
    assert e.value.body["param"] == "max_tokens"
    assert sent(fl) == 0
    # What might fit (long tokens could make 25,000 bytes fewer than 100 tokens) goes on: the
    # neuron, which tokenises, decides.
    with pytest.raises(openai.BadRequestError):
        fl.client().completions.create(model="tiny", prompt="a" * 25_000)
    fl.client().completions.create(model="tiny", prompt=list(range(50)), max_tokens=50)
    assert sent(fl) == 2


def test_a_router_bug_is_a_500_in_the_envelope_counted_as_500(fl, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(serve, "_reply", broken)
    before = httpx2.get(fl.url + "/metrics").text.count('code="500"')
    # Captured from structlog itself: which stream the in-process router prints to depends on
    # what earlier tests configured.
    with structlog.testing.capture_logs() as logs:
        r = httpx2.post(fl.url + "/v1/chat/completions",
                        json={"model": "tiny", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    m = httpx2.get(fl.url + "/metrics").text
    assert 'helexa_router_requests_total{code="500",model="tiny"} 1.0' in m and before == 0
    assert r.headers["x-request-id"]
    done = [e for e in logs if e["event"] == "request.done"
            and r.headers["x-request-id"] in str(e.get("req_id"))]
    assert len(done) == 1 and done[0]["outcome"] == "error" and done[0]["status"] == 500, done


def test_a_router_bug_mid_stream_ends_the_stream_with_an_error_event(fl, monkeypatch):
    real = serve.encode.delta_chunk
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return real(*a, **kw)
    monkeypatch.setattr(serve.encode, "delta_chunk", broken)
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MSG, "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] != "data: [DONE]"
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "internal_error"
