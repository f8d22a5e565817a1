"""Routing behaviour against fake neurons: failover, refusals, mid-stream failure, disconnects,
health, on-demand loads and bursts."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx2
import openai
import pytest

from helexa.proto import neuron_pb2 as pb
from helexa.router.dispatch import DispatchSettings

MSG = [{"role": "user", "content": "hello there"}]


def set_b(fl, neuron, **kw):
    def go():
        for k, v in kw.items():
            setattr(neuron.b, k, v)
        neuron.changed()
    fl.lt.call(go)


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("status,code", [("RESOURCE_EXHAUSTED", "overloaded"),
                                         ("UNAVAILABLE", "shutting_down"),
                                         ("NOT_FOUND", "model_not_found")])  # a stale report
def test_refusal_before_first_byte_fails_over_to_the_other_neuron(fl, status, code):
    set_b(fl, fl.n1, refuse=(status, code, 1000))
    set_b(fl, fl.n2, refuse=(status, code, 1000))
    fl.lt.call(lambda: setattr(fl.n2.b, "refuse_times", 0))  # n2 accepts
    for _ in range(4):
        r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
        assert r.choices[0].message.content == "w0 w1 "
    assert len(fl.n2.requests) == 4
    assert set(fl.n1.rpcs + fl.n2.rpcs) == {"Complete"}  # the refused call was unary too
    # A stream fails over alike, over Generate.
    s = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s) == "w0 w1 "
    assert fl.n2.rpcs[-1] == "Generate" and len(fl.n2.requests) == 5


@pytest.mark.parametrize("status,code,err,retry", [
    ("RESOURCE_EXHAUSTED", "rate_limit_exceeded", openai.RateLimitError, "3"),
    ("RESOURCE_EXHAUSTED", "overloaded", openai.InternalServerError, "3"),
    ("UNAVAILABLE", "shutting_down", openai.InternalServerError, "3"),
])
def test_refused_everywhere_reaches_the_client_with_retry_after(fl, status, code, err, retry):
    for n in (fl.n1, fl.n2):
        set_b(fl, n, refuse=(status, code, 2500))
    with pytest.raises(err) as e:
        fl.client().chat.completions.create(model="tiny", messages=MSG)
    assert e.value.code == code and e.value.response.headers["retry-after"] == retry
    assert len(fl.n1.requests) + len(fl.n2.requests) == 2  # retried once, not more


def test_context_length_exceeded_is_not_retried(fl):
    # Text the router cannot judge (it might fit, for all the router knows): the neuron refuses.
    with pytest.raises(openai.BadRequestError) as e:
        fl.client().completions.create(model="tiny", prompt="a" * 9000, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "prompt"
    assert len(fl.n1.requests) + len(fl.n2.requests) == 1


@pytest.mark.parametrize("why, says", [
    ("deadline", "the request ran past its deadline (timeouts.request_secs = 30 s) and the "
                 "neuron ended it"),
    ("shutdown", "the neuron stopped the model before the request finished (its drain "
                 "outlasted server.drain_secs, or the model was unloaded); retry it"),
    ("error: step failed", "the neuron failed while generating: error: step failed"),
])
def test_a_request_the_neuron_ends_short_says_why(fl, why, says):
    """docs/errors.md: a deadline, a drain that ran out and an engine failure all end the
    request upstream_error, each saying which (the neuron's stop_reason), stream or not."""
    ask = [{"role": "user", "content": f"[[abort:2:{why}]]"}]
    s = fl.client().chat.completions.create(model="tiny", messages=ask, max_tokens=6,
                                            stream=True)
    got = []
    with pytest.raises(openai.APIError) as streamed:
        for chunk in s:
            got.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in got) == "w0 w1 "
    with pytest.raises(openai.APIStatusError) as whole:
        fl.client().chat.completions.create(model="tiny", messages=ask, max_tokens=6)
    failed = [json.loads(line[6:]) for line in httpx2.post(
        fl.url + "/v1/responses", json={"model": "tiny", "input": ask[0]["content"],
                                        "stream": True}, timeout=15).text.splitlines()
        if line.startswith("data: ")][-1]
    assert streamed.value.body == {"message": says, "type": "server_error",
                                   "code": "upstream_error", "param": None}
    assert whole.value.status_code == 502 and whole.value.code == "upstream_error"
    assert whole.value.body["message"] == says
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["message"] == f"upstream_error: {says}"


def test_neuron_failing_mid_stream_ends_the_stream_with_an_error_event(fl):
    s = fl.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "[[fail:2]]"}], max_tokens=6,
        stream=True)
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in s:
            got.append(chunk)
    assert "mid-stream" in e.value.message
    assert e.value.body["code"] == "upstream_error"
    assert "".join(c.choices[0].delta.content or "" for c in got) == "w0 w1 "
    # Non-streaming: a 502 with the same code (the Complete call fails; it is not retried).
    before = len(fl.n1.requests) + len(fl.n2.requests)
    with pytest.raises(openai.APIStatusError) as e:
        fl.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "[[fail:2]]"}], max_tokens=6)
    assert e.value.status_code == 502 and e.value.code == "upstream_error"
    assert len(fl.n1.requests) + len(fl.n2.requests) == before + 1
    assert (fl.n1.rpcs + fl.n2.rpcs).count("Complete") == 1


def test_client_disconnect_cancels_the_neuron_call_and_frees_kv(fl):
    set_b(fl, fl.n1, token_delay_secs=0.05, default_tokens=500)
    set_b(fl, fl.n2, token_delay_secs=0.05, default_tokens=500)
    before = fl.n1.cancelled + fl.n2.cancelled
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": MSG, "max_tokens": 500, "stream": True}) as r:
        for line in r.iter_lines():
            if "w1 " in line:
                break  # leave mid-stream: the context manager closes the connection
    assert wait_for(lambda: fl.n1.cancelled + fl.n2.cancelled == before + 1)
    models = [fl.n1.models["tiny"], fl.n2.models["tiny"]]
    assert wait_for(lambda: all(m.used_bytes == 0 and m.in_flight == 0 for m in models))
    # The router's mirror shows the blocks back too.
    assert wait_for(lambda: 'helexa_neuron_kv_used_bytes{model="tiny",neuron="n1"} 0.0'
                    in httpx2.get(fl.url + "/metrics").text)


def test_client_disconnect_cancels_a_non_streaming_call_and_frees_kv(fl):
    set_b(fl, fl.n1, token_delay_secs=0.05, default_tokens=500)
    set_b(fl, fl.n2, token_delay_secs=0.05, default_tokens=500)
    before = fl.n1.cancelled + fl.n2.cancelled
    models = [fl.n1.models["tiny"], fl.n2.models["tiny"]]
    with pytest.raises(httpx2.TimeoutException):  # the client gives up and closes
        httpx2.post(fl.url + "/v1/chat/completions", timeout=0.5, json={
            "model": "tiny", "messages": MSG, "max_tokens": 500})
    assert fl.n1.rpcs + fl.n2.rpcs == ["Complete"]
    assert wait_for(lambda: fl.n1.cancelled + fl.n2.cancelled == before + 1)
    assert wait_for(lambda: all(m.used_bytes == 0 and m.in_flight == 0 for m in models))
    assert wait_for(lambda: 'helexa_router_requests_total{code="499",model="tiny"}'
                    in httpx2.get(fl.url + "/metrics").text)


def ttft_count(fl) -> float:
    m = httpx2.get(fl.url + "/metrics").text
    line = 'helexa_router_ttft_seconds_count{model="tiny"} '
    return next((float(x.split()[-1]) for x in m.splitlines() if x.startswith(line)), 0.0)


def test_non_streaming_goes_over_complete_and_streaming_over_generate(fl):
    c = fl.client()
    ttft_before = ttft_count(fl)
    r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, logprobs=True,
                                  top_logprobs=1, extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == "w0 w1 w2 " and r.choices[0].finish_reason == "length"
    assert r.choices[0].token_ids == [100, 101, 102]
    assert [t.token for t in r.choices[0].logprobs.content] == ["w0 ", "w1 ", "w2 "]
    assert r.usage.completion_tokens == 3
    p = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, n=2)
    assert [x.text for x in p.choices] == ["w0 w1 ", "w0 w1 "]
    assert p.usage.completion_tokens == 4
    s = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, stream=True)
    assert "".join(x.choices[0].delta.content or "" for x in s) == "w0 w1 "
    assert sorted(fl.n1.rpcs + fl.n2.rpcs) == ["Complete"] * 3 + ["Generate"]
    # No first token is observed on a unary call: TTFT counts the stream alone.
    assert ttft_count(fl) == ttft_before + 1


def test_a_neuron_without_complete_is_asked_with_generate(fl):
    for n in (fl.n1, fl.n2):
        set_b(fl, n, no_complete=True)
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=3,
                                            extra_body={"return_token_ids": True})
    assert r.choices[0].message.content == "w0 w1 w2 " and r.choices[0].token_ids == [100, 101, 102]
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    assert fl.n1.rpcs + fl.n2.rpcs == ["Generate"]  # the UNIMPLEMENTED call never got as far


def test_a_running_unary_call_counts_once_in_selection(fl):
    """Watch reports it in flight; it must not also count as a send the neuron has not seen
    for as long as it runs (a stream's first message settles that; a unary call has none)."""
    for n in (fl.n1, fl.n2):
        set_b(fl, n, token_delay_secs=0.05, default_tokens=60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(fl.client().chat.completions.create, model="tiny", messages=MSG)

        def load() -> list[int]:
            return sorted(c.load for c in fl.lt.call(fl.state.registry.candidates, "tiny"))
        assert wait_for(lambda: any(m.in_flight for n in (fl.n1, fl.n2)
                                    for m in n.models.values()))
        assert wait_for(lambda: load() == [0, 1], timeout=1.5), load()
        assert not running.done()
        assert running.result().usage.completion_tokens == 60


def test_silent_neuron_leaves_rotation_and_comes_back(fl):
    set_b(fl, fl.n1, silent=True)
    assert wait_for(lambda: not fl.state.registry.links["n1"].healthy(), 5)
    for _ in range(3):
        fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert fl.n1.requests == [] and len(fl.n2.requests) == 3
    set_b(fl, fl.n1, silent=False)
    assert wait_for(lambda: fl.state.registry.links["n1"].healthy(), 3)


def test_no_healthy_neuron_is_503_service_unavailable(fl):
    for n in (fl.n1, fl.n2):
        set_b(fl, n, silent=True)
    assert wait_for(lambda: not fl.state.registry.healthy_links(), 3)
    with pytest.raises(openai.InternalServerError) as e:
        fl.client().chat.completions.create(model="tiny", messages=MSG)
    assert e.value.status_code == 503 and e.value.code == "service_unavailable"
    assert "retry-after" in e.value.response.headers


def test_draining_neuron_is_skipped_and_all_draining_is_shutting_down(fl):
    def router_sees_draining(name: str) -> bool:
        st = fl.state.registry.links[name].status
        return st is not None and st.draining

    fl.lt.call(lambda: (setattr(fl.n1, "draining", True), fl.n1.changed()))
    assert wait_for(lambda: router_sees_draining("n1"))
    fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert fl.n1.requests == []
    fl.lt.call(lambda: (setattr(fl.n2, "draining", True), fl.n2.changed()))
    assert wait_for(lambda: router_sees_draining("n2"))
    with pytest.raises(openai.InternalServerError) as e:
        fl.client().chat.completions.create(model="tiny", messages=MSG)
    assert e.value.code == "shutting_down" and e.value.response.headers["retry-after"]


def test_on_demand_load_then_serve(fl):
    r = fl.client().chat.completions.create(model="lazy", messages=MSG, max_tokens=1)
    assert r.choices[0].message.content == "w0 "
    assert fl.n1.loads == ["lazy"]
    assert fl.n1.models["lazy"].state == pb.MODEL_STATE_READY


def test_slow_load_is_503_model_loading_with_retry_after(fl):
    set_b(fl, fl.n1, load_secs=3.0)
    with pytest.raises(openai.InternalServerError) as e:
        fl.client().chat.completions.create(model="lazy", messages=MSG, max_tokens=1)
    assert e.value.code == "model_loading" and int(e.value.response.headers["retry-after"]) >= 1
    assert fl.n1.loads == ["lazy"]


def test_principal_not_allowed_to_load(fl):
    old = fl.state.dispatcher.settings
    fl.state.dispatcher.settings = DispatchSettings(["bob"], 1.0, 30)  # the client is alice
    try:
        with pytest.raises(openai.InternalServerError) as e:
            fl.client().chat.completions.create(model="lazy", messages=MSG, max_tokens=1)
        assert e.value.code == "service_unavailable" and fl.n1.loads == []
    finally:
        fl.state.dispatcher.settings = old


def test_burst_spreads_over_both_neurons(fl):
    for n in (fl.n1, fl.n2):
        set_b(fl, n, first_delay_secs=0.2)
    client = fl.client()

    def one(i):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "same conversation"}], max_tokens=1)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    assert len(fl.n1.requests) >= 3 and len(fl.n2.requests) >= 3


def test_sighup_reload_changes_aliases_and_neurons(fl, tmp_path):
    cfg = tmp_path / "router.toml"
    a1, a2 = fl.n1.address, fl.n2.address
    cfg.write_text(f'''
[aliases]
"helexa/fast" = "other"
[[neurons.endpoints]]
name = "n2"
address = "{a2}"
[neurons]
token_file = "{fl.state.config_path.parent / 'token'}"
''')
    old_path, old_cfg = fl.state.config_path, fl.state.cfg
    set_b(fl, fl.n1, token_delay_secs=0.1)
    set_b(fl, fl.n2, token_delay_secs=0.1)
    fl.state.config_path = cfg
    try:
        # A stream running on n1 while n1 leaves the config finishes all the same.
        fl.lt.call(lambda: (setattr(fl.n2, "draining", True), fl.n2.changed()))
        time.sleep(0.15)
        s = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                                stream=True)
        chunks = iter(s)
        next(chunks)
        assert len(fl.n1.requests) == 1
        fl.lt.call(lambda: (setattr(fl.n2, "draining", False), fl.n2.changed()))
        fl.lt.run(fl.state.reload())
        assert sorted(fl.state.registry.links) == ["n2"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 w2 w3 w4 "
        r = fl.client().chat.completions.create(model="helexa/fast", messages=MSG, max_tokens=1)
        assert r.model == "other"
    finally:
        fl.state.config_path = old_path
        fl.lt.run(fl.state.reload())
        assert sorted(fl.state.registry.links) == ["n1", "n2"]
        assert fl.state.cfg.aliases == old_cfg.aliases and a1


def test_neuron_restart_is_noticed_at_once_and_reconnected(fl):
    fl.lt.run(fl.n1.stop())
    assert wait_for(lambda: not fl.state.registry.links["n1"].healthy(), 1.0)
    fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)  # n2 serves
    fl.lt.run(fl.n1.start(fl.n1.address))  # same address, as a restarted daemon would be
    assert wait_for(lambda: fl.state.registry.links["n1"].healthy(), 5.0)


def test_streaming_n_choices_interleave_and_each_finishes(fl):
    s = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=3, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, finishes = {0: "", 1: ""}, {}
    usage = None
    for chunk in s:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: "w0 w1 w2 ", 1: "w0 w1 w2 "} and finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 6


def _switching(fl, on: bool) -> None:
    """Both fakes report `tiny` switching profile (or ready again), as Watch would."""
    def go():
        for n in (fl.n1, fl.n2):
            n.models["tiny"].state = pb.MODEL_STATE_SWITCHING if on else pb.MODEL_STATE_READY
            n.changed()
    fl.lt.call(go)
    assert wait_for(lambda: len(fl.state.registry.candidates("tiny")) == (0 if on else 2))


def test_a_request_waiting_for_a_profile_switch_ends_at_its_deadline_as_the_switch(fl):
    """docs/errors.md: a model switching profile is 503 service_unavailable. A request waits
    for the switch at most until its own deadline (here 0.5 s, load_wait_secs 10 s), not
    past it, and then hears that the model is switching, not that it is loading."""
    old = fl.state.dispatcher.settings
    fl.state.dispatcher.settings = DispatchSettings(["*"], 10.0, 0.5)
    fl.state.request_secs = 0.5
    _switching(fl, True)
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as by_deadline:
            fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        waited = time.monotonic() - t0
        fl.state.dispatcher.settings = DispatchSettings(["*"], 0.5, 30)  # load_wait first
        fl.state.request_secs = 30
        with pytest.raises(openai.InternalServerError) as by_load_wait:
            fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    finally:
        fl.state.dispatcher.settings = old
        fl.state.request_secs = fl.state.cfg.timeouts.request_secs
        _switching(fl, False)
    assert 0.4 <= waited < 2.0
    e = by_deadline.value
    assert e.status_code == 503 and e.code == "service_unavailable"
    assert int(e.response.headers["retry-after"]) >= 1
    assert e.body["message"] == ("`tiny` is switching profile (on n1, n2) and was not ready "
                                 "within its deadline (timeouts.request_secs = 0.5 s); "
                                 "retry shortly")
    e = by_load_wait.value
    assert e.code == "service_unavailable" and "switching profile" in e.body["message"]
    assert "within timeouts.load_wait_secs (0.5 s)" in e.body["message"]
    assert not fl.n1.requests and not fl.n2.requests  # never sent past its deadline
