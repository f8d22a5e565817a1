"""A stream whose neuron is lost after admitting it but before its first token goes on on
the next neuron, the client none the wiser; once a token went out, or when the engine
itself failed, the loss ends the stream with an upstream_error event."""

from __future__ import annotations

import contextlib
import json
import time

import httpx2
from openai._streaming import SSEDecoder

MSG = [{"role": "user", "content": "hello there"}]


def set_b(fl, neurons=None, **kw):
    def go():
        for n in neurons or (fl.n1, fl.n2):
            for k, v in kw.items():
                setattr(n.b, k, v)
            n.changed()
    fl.lt.call(go)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def admitted_on(fl):
    """(the fake that admitted this test's request, the other one)."""
    wait_for(lambda: fl.lt.call(lambda: any(n.models["tiny"].in_flight
                                            for n in (fl.n1, fl.n2))))
    on = fl.n1 if fl.lt.call(lambda: fl.n1.models["tiny"].in_flight) else fl.n2
    return on, (fl.n2 if on is fl.n1 else fl.n1)


@contextlib.contextmanager
def idle_bound(fl, secs: float = 0.5):
    """The router's stream_idle_secs set to `secs` (and put back)."""
    fl.state.registry.stream_idle_secs = secs
    try:
        yield
    finally:
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs


def lose_after_admission(fl, path: str, body: dict, **other_b) -> tuple[list[str], object,
                                                                        object]:
    """Stream `body` to `path` on a fleet whose neurons admit it and leave it waiting 30 s
    for a batch row (a stream with no clock of its own); once the client has the stream's
    opening, the neuron holding the request falls silent (its Watch: a hung neuron, whose
    calls without a clock the router ends after stream_idle_secs of it, 0.5 s here) and the
    other one is given `other_b` (by default: a row and its first token at once). Returns
    the stream's lines, the lost fake, the other."""
    set_b(fl, admission_message_secs=30.0, row_wait_secs=30.0)
    with idle_bound(fl), httpx2.stream("POST", fl.url + path, timeout=30, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        opening = [next(lines)]  # it opens only once a neuron admitted the request
        lost, other = admitted_on(fl)
        set_b(fl, [other], **(other_b or {"admission_message_secs": 0.0,
                                          "row_wait_secs": None}))
        set_b(fl, [lost], silent=True)
        return opening + list(lines), lost, other


CHAT = {"model": "tiny", "messages": MSG, "max_tokens": 3, "stream": True}


def chat_text(lines) -> str:
    out = ""
    for line in lines:
        if line.startswith('data: {"id"'):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            out += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return out


def test_a_chat_stream_whose_neuron_is_lost_before_its_first_token_goes_on_elsewhere(fl):
    before = {n: fl.lt.call(lambda n=n: n.cancelled) for n in (fl.n1, fl.n2)}
    text, lost, other = lose_after_admission(fl, "/v1/chat/completions", CHAT)
    text = [line for line in text if line]
    assert text[-1] == "data: [DONE]", text[-1]
    assert not any('"error"' in line for line in text)
    assert chat_text(text) == "w0 w1 w2 "
    roles = [line for line in text if '"role"' in line]
    assert len(roles) == 1  # one opening, as from one neuron
    assert len(lost.requests) == 1 and len(other.requests) == 1
    wait_for(lambda: fl.lt.call(lambda: lost.cancelled) > before[lost])  # ended there
    assert fl.lt.call(lambda: other.cancelled) == before[other]  # finished here
    wait_for(lambda: fl.lt.call(lambda: all(n.models["tiny"].used_bytes == 0
                                            and n.models["tiny"].in_flight == 0
                                            for n in (fl.n1, fl.n2))))
    metrics = httpx2.get(fl.url + "/metrics").text
    assert (f'helexa_router_refusals_total{{code="service_unavailable",model="tiny",'
            f'neuron="{lost.name}"}}') in metrics


def test_an_anthropic_stream_whose_neuron_is_lost_before_its_first_token_goes_on(fl):
    lines, lost, other = lose_after_admission(fl, "/v1/messages", {
        "model": "tiny", "messages": MSG, "max_tokens": 3, "stream": True})
    events = list(SSEDecoder().iter_bytes(iter(["\n".join(lines).encode() + b"\n\n"])))
    names = [e.event for e in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert "error" not in names and names.count("message_start") == 1
    deltas = [e.json()["delta"] for e in events if e.event == "content_block_delta"]
    assert "".join(d.get("text", "") + d.get("thinking", "") for d in deltas) == "w0 w1 w2 "
    assert len(lost.requests) == 1 and len(other.requests) == 1


def test_an_engine_failure_before_the_first_token_is_not_retried(fl):
    set_b(fl, admission_message_secs=0.05)
    with httpx2.stream("POST", fl.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "[[fail:0]]", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "fake engine failure" in err["message"]
    assert len(fl.n1.requests) + len(fl.n2.requests) == 1


def test_a_retry_whose_neuron_disagrees_on_the_prompt_ends_the_stream(fl):
    # the other neuron's first message says no thought opened and no prompt tokens: the
    # client was told otherwise, so the stream ends rather than go on inconsistent
    lines, lost, other = lose_after_admission(fl, "/v1/chat/completions", CHAT,
                                              admission_message_secs=None)
    lines = [line for line in lines if line]
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error"
    assert "disagrees on prompt_tokens, thought_open" in err["message"], err["message"]
    assert chat_text(lines) == ""
    wait_for(lambda: fl.lt.call(lambda: all(n.models["tiny"].used_bytes == 0
                                            for n in (fl.n1, fl.n2))))


def test_no_retry_past_the_request_deadline(fl):
    fl.state.request_secs = 0.3  # the loss is seen 0.5 s in (stream_idle_secs, here)
    try:
        lines, lost, other = lose_after_admission(fl, "/v1/chat/completions", CHAT)
        lines = [line for line in lines if line]
    finally:
        fl.state.request_secs = fl.state.cfg.timeouts.request_secs
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "its deadline passed" in err["message"]
    assert len(other.requests) == 0


def refusals(fl) -> dict[str, float]:
    """helexa_router_refusals_total by neuron (code service_unavailable)."""
    out: dict[str, float] = {}
    for line in httpx2.get(fl.url + "/metrics").text.splitlines():
        if line.startswith("helexa_router_refusals_total{") and \
                'code="service_unavailable"' in line:
            neuron = line.split('neuron="')[1].split('"')[0]
            out[neuron] = out.get(neuron, 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_second_loss_before_the_first_token_is_counted_and_not_retried(fl):
    # the stream goes on on the other neuron, which is lost too before its first token:
    # no third try, and both losses are counted (and logged as request.neuron_lost)
    set_b(fl, admission_message_secs=30.0, row_wait_secs=30.0)
    before = refusals(fl)
    with idle_bound(fl), httpx2.stream("POST", fl.url + "/v1/chat/completions", timeout=30,
                                       json=CHAT) as r:
        lines = r.iter_lines()
        next(lines)
        lost, other = admitted_on(fl)
        set_b(fl, [lost], silent=True)
        wait_for(lambda: len(other.requests) == 1)  # retried there
        set_b(fl, [other], silent=True)
        rest = [line for line in lines if line]
    err = json.loads(rest[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "its one retry was used" in err["message"]
    after = refusals(fl)
    assert {n: after.get(n, 0) - before.get(n, 0) for n in (lost.name, other.name)} == \
        {lost.name: 1, other.name: 1}
    set_b(fl, silent=False)
    wait_for(lambda: fl.lt.call(lambda: all(n.models["tiny"].used_bytes == 0
                                            for n in (fl.n1, fl.n2))))


def test_a_neuron_that_does_not_end_a_request_at_its_deadline_is_named_so(fl, monkeypatch):
    # the neuron checks the deadline between steps; one whose step outlasts the router's
    # margin is cut by the call's gRPC deadline, whose own words ("Deadline Exceeded") say
    # nothing a client can act on: streamed or not, the error names the deadline
    import helexa.router.dispatch as dispatch
    monkeypatch.setattr(dispatch, "DEADLINE_MARGIN_SECS", 0.2)
    set_b(fl, token_delay_secs=0.15, default_tokens=40)
    fl.state.request_secs = 0.5
    try:
        with httpx2.stream("POST", fl.url + "/v1/chat/completions", timeout=30,
                           json={"model": "tiny", "messages": MSG, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        whole = httpx2.post(fl.url + "/v1/completions", timeout=30,
                            json={"model": "tiny", "prompt": "hi"})
    finally:
        fl.state.request_secs = fl.state.cfg.timeouts.request_secs
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error", err
    assert "ran past its deadline" in err["message"] and "Deadline Exceeded" not in \
        err["message"], err["message"]
    assert whole.status_code == 504, whole.text
    assert "ran past its deadline" in whole.json()["error"]["message"], whole.text
    wait_for(lambda: fl.lt.call(lambda: all(n.models["tiny"].used_bytes == 0
                                            for n in (fl.n1, fl.n2))))
