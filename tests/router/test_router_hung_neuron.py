"""A neuron that stops answering: the router ends the calls in flight on it (an SSE
upstream_error event, or a retry elsewhere before the first byte), and a stream with no
message for stream_idle_secs ends with an upstream_error event."""

from __future__ import annotations

import json
import time

import httpx2

MSG = [{"role": "user", "content": "hello there"}]


def set_b(fl, **kw):
    def go():
        for n in (fl.n1, fl.n2):
            for k, v in kw.items():
                setattr(n.b, k, v)
            n.changed()
    fl.lt.call(go)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def serving(fl):
    return next(n for n in (fl.n1, fl.n2) if n.requests)


def test_a_neuron_leaving_rotation_ends_its_streams_with_an_error_event(fl):
    set_b(fl, token_delay_secs=0.2)
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": MSG, "max_tokens": 200, "stream": True,
            }) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        hung = serving(fl)
        fl.lt.call(lambda: setattr(hung.b, "silent", True))  # its Watch falls silent
        rest = [line for line in lines if line]
    assert rest[-1] != "data: [DONE]"
    err = json.loads(rest[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "stopped answering" in err["message"]
    wait_for(lambda: hung.cancelled == 1)  # the call was ended on the neuron too
    wait_for(lambda: fl.lt.call(lambda: hung.models["tiny"].used_bytes == 0))


def test_a_non_streaming_call_on_a_neuron_leaving_rotation_is_served_elsewhere(fl):
    set_b(fl, first_delay_secs=30.0)

    def sent() -> int:
        return len(fl.n1.requests) + len(fl.n2.requests)

    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(fl.client().chat.completions.create, model="tiny", messages=MSG,
                            max_tokens=2)
        wait_for(lambda: sent() == 1)
        hung = serving(fl)
        other = fl.n2 if hung is fl.n1 else fl.n1
        fl.lt.call(lambda: setattr(other.b, "first_delay_secs", 0.0))
        fl.lt.call(lambda: setattr(hung.b, "silent", True))
        assert reply.result(timeout=20).choices[0].message.content == "w0 w1 "
    assert len(hung.requests) == 1 and len(other.requests) == 1


def test_a_stream_silent_past_the_idle_bound_ends_with_an_error_event(fl):
    fl.state.registry.stream_idle_secs = 0.5
    set_b(fl, token_delay_secs=60.0)  # the first token comes, then nothing (a wedged engine)
    try:
        with httpx2.stream("POST", fl.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    finally:
        fl.state.registry.stream_idle_secs = fl.state.cfg.timeouts.stream_idle_secs
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == "upstream_error" and "no message from neuron" in err["message"]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "w0 "
