"""The HTTP contract against fake neurons: bodies, streams, models, errors (official openai client)."""

from __future__ import annotations

import json
import time

import httpx2
import openai
import pytest
from router_fleet import ALICE_KEY

from helexa.router.auth import Authenticator, hash_key

MSG = [{"role": "user", "content": "hello there"}]


def test_chat_non_streaming(fl):
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "w0 w1 w2 w3 "
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens >= 1
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens // 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_chat_streaming_with_usage_ends_with_done(fl):
    with httpx2.stream("POST", fl.url + "/v1/chat/completions", json={
            "model": "helexa/balanced", "messages": MSG, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w0 w1 w2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[0]["model"] == "tiny"  # the alias resolved


def test_completions_token_ids_with_return_token_ids(fl):
    r = fl.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2,
                                       extra_body={"return_token_ids": True})
    body = r.model_dump()
    assert body["choices"][0]["text"] == "w0 w1 "
    assert body["prompt_token_ids"] == [5, 6, 7]
    assert body["choices"][0]["token_ids"] == [100, 101]
    assert fl.n1.requests[-1:] or fl.n2.requests[-1:]
    sent = (fl.n1.requests + fl.n2.requests)[-1]
    assert list(sent.token_ids.ids) == [5, 6, 7] and sent.return_prompt_token_ids


def test_completions_streaming_text(fl):
    s = fl.client().completions.create(model="tiny", prompt="once upon", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in s) == "w0 w1 "


def test_logprobs_chat_and_completion_forms(fl):
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                            logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert [t.token for t in lp] == ["w0 ", "w1 "] and lp[0].logprob == -0.5
    assert len(lp[0].top_logprobs) == 2 and lp[0].bytes == list(b"w0 ")
    r = fl.client().completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=1)
    assert r.choices[0].logprobs.tokens == ["w0 ", "w1 "]
    assert r.choices[0].logprobs.text_offset == [0, 3]
    assert r.choices[0].logprobs.top_logprobs[0] == {"w0 ": -0.5}


def test_n_fans_out_into_choices(fl):
    r = fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=2, n=3, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 6
    seeds = sorted(q.sampling.seed for q in fl.n1.requests + fl.n2.requests)
    assert seeds == [1, 2, 3]


def test_principal_comes_from_the_key_only(fl):
    fl.client(ALICE_KEY, default_headers={"X-Helexa-Principal": "mallory"}).chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1)
    with pytest.raises(openai.AuthenticationError):  # a key of no one: 401, not anonymous
        fl.client("sk-unknown").chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert httpx2.post(fl.url + "/v1/chat/completions", timeout=15, json={  # no key: anonymous
        "model": "tiny", "messages": MSG, "max_tokens": 1}).status_code == 200
    principals = [q.principal for q in fl.n1.requests + fl.n2.requests]
    assert sorted(principals) == ["", "alice"]


def test_models_lists_models_and_aliases_with_smallest_limits(fl):
    fl.lt.call(lambda: (setattr(fl.n2.models["tiny"], "context", 1000), fl.n2.changed()))
    fl.lt.call(lambda: (setattr(fl.n1.models["tiny"], "drafter", "ngram"), fl.n1.changed()))
    fl.lt.call(lambda: (setattr(fl.n2.models["tiny"], "drafter", "ngram"), fl.n2.changed()))
    from helexa.router import fleet_view

    reg = fl.state.registry
    limits, drafters = (lambda: fleet_view.ready_limits(reg)), (lambda: fleet_view.drafters(reg))
    end = time.monotonic() + 5.0  # until the router has the reports, not a fixed nap
    while (fl.lt.call(limits).get("tiny", (0,))[0] != 1000
           or fl.lt.call(drafters).get("tiny") != "ngram"):
        assert time.monotonic() < end, "the router never saw the new context and drafter"
        time.sleep(0.02)
    data = {m.id: m.model_dump() for m in fl.client().models.list()}
    assert data["tiny"]["speculation"] == "ngram" and data["other"]["speculation"] == "off"
    assert data["tiny"]["limit"] == {"context": 1000, "input": 999, "output": 1024}
    assert data["other"]["limit"] == {"context": 512, "input": 511, "output": 256}
    assert data["helexa/balanced"]["limit"] == data["tiny"]["limit"]
    assert data["helexa/balanced"]["alias_of"] == "tiny"
    assert fl.client().models.retrieve("other").id == "other"


def test_a_models_created_is_when_it_became_ready_and_stays(fl):
    # R2: `created` was 0 and Anthropic's created_at 1970; vLLM and OpenAI give real times
    import anthropic
    from router_fake_neuron import FakeModel

    def listed() -> dict:
        return {m.id: m.created for m in fl.client().models.list()}

    added = {fl.n1: {"fresh": 1_700_000_900_000, "old": 0}, fl.n2: {"fresh": 1_700_000_000_999}}
    before = int(time.time())
    fl.lt.call(lambda: [(n.models.update({m: FakeModel(m, ready_unix_ms=ms)
                                          for m, ms in models.items()}), n.changed())
                        for n, models in added.items()])
    try:
        end = time.monotonic() + 5.0  # until the router has the reports, not a fixed nap
        while not {"fresh", "old"} <= set(listed()):
            assert time.monotonic() < end, "the router never saw the new models"
            time.sleep(0.02)
        first = listed()
        assert first["fresh"] == 1_700_000_000  # the earlier neuron's ready time, in seconds
        assert before <= first["old"] <= time.time()  # no ready time: the router's first sight
        fl.lt.call(lambda: (fl.n2.models.pop("fresh"), fl.n2.changed()))  # n2 leaves
        time.sleep(0.2)
        assert listed() == first  # as neurons come and go, `created` does not move
        a = anthropic.Anthropic(base_url=fl.url, api_key=ALICE_KEY, max_retries=0, timeout=15)
        assert a.models.retrieve("fresh").created_at.isoformat() == "2023-11-14T22:13:20+00:00"
    finally:
        fl.lt.call(lambda: [(n.models.pop(m, None), n.changed())
                            for n in (fl.n1, fl.n2) for m in ("fresh", "old")])


def test_unsupported_and_unknown_fields_are_400_naming_the_param(fl):
    c = fl.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSG, logit_bias={"1": 5})
    assert e.value.body["param"] == "logit_bias" and e.value.code == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MSG, extra_body={"wat": 1})
    assert e.value.body["param"] == "wat"
    r = httpx2.post(fl.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_error"


def test_an_unknown_key_with_a_line_break_is_named_where_it_is(fl):
    # msgspec's message ends "- at `$.stream_options`"; a key holding a newline once hid
    # that ending, and the 400 named "stream_options"'s key with "` - at `$..." as a field.
    for path, body, where in [
        ("/v1/chat/completions", {"model": "tiny", "messages": MSG,
                                  "stream_options": {"a\nb": True}}, "stream_options.a\nb"),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": MSG,
                          "thinking": {"x<|im_end|>\n<|im_start|>system": 1}},
         "thinking.x<|im_end|>\n<|im_start|>system")]:
        r = httpx2.post(fl.url + path, json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == f"Unrecognized request argument supplied: {where}"
        assert err.get("param", where) == where


def test_unknown_model_is_404(fl):
    with pytest.raises(openai.NotFoundError) as e:
        fl.client().chat.completions.create(model="nope", messages=MSG)
    assert e.value.code == "model_not_found"
    m = httpx2.get(fl.url + "/metrics").text
    assert 'model="nope"' not in m and 'helexa_router_requests_total{code="404",model="unknown"}' in m


def test_an_alias_to_a_missing_model_is_a_404_naming_the_alias_and_its_target(fl):
    from helexa.router.aliases import Aliases

    kept = fl.state.aliases
    fl.state.aliases = Aliases({"helexa/balanced": "tiny", "ghost": "nope"})
    try:
        with pytest.raises(openai.NotFoundError) as e:
            fl.client().chat.completions.create(model="ghost", messages=MSG)
        tok = httpx2.post(fl.url + "/tokenize", json={"model": "ghost", "prompt": "hi"},
                          headers={"Authorization": f"Bearer {ALICE_KEY}"})
        ok = fl.client().chat.completions.create(model="helexa/balanced", messages=MSG,
                                                 max_tokens=2)
    finally:
        fl.state.aliases = kept
    want = "The model `ghost` is an alias of `nope`, which does not exist"
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert e.value.body["message"] == want
    assert tok.status_code == 404 and tok.json()["error"]["message"] == want
    assert ok.usage.completion_tokens == 2  # an alias to a served model is untouched


def test_anthropics_sdk_reads_a_models_404_in_its_own_envelope(fl):
    # /v1/models answers Anthropic's SDK (anthropic-version) in Anthropic's shape, its
    # errors included (docs/api.md)
    import anthropic

    a = anthropic.Anthropic(base_url=fl.url, api_key=ALICE_KEY, max_retries=0, timeout=15)
    assert a.models.retrieve("tiny").type == "model"
    with pytest.raises(anthropic.NotFoundError) as e:
        a.models.retrieve("nope")
    assert e.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model `nope` does not exist"}}
    with pytest.raises(openai.NotFoundError) as o:  # OpenAI's SDK still gets its own
        fl.client().models.retrieve("nope")
    assert o.value.code == "model_not_found"


def test_anthropics_sdk_pages_the_models_and_reads_their_limits(fl):
    import anthropic

    a = anthropic.Anthropic(base_url=fl.url, api_key=ALICE_KEY, max_retries=0, timeout=15)
    openai_ids = [m.id for m in fl.client().models.list()]
    assert len(openai_ids) >= 2
    first = a.models.list(limit=1)
    assert [m.id for m in first.data] == openai_ids[:1] and first.has_more
    assert [m.id for m in a.models.list(limit=1)] == openai_ids  # the SDK pages on after_id
    last = a.models.list(before_id=openai_ids[-1], limit=1)
    assert [m.id for m in last.data] == openai_ids[-2:-1]
    limits = {m.id: m.limit for m in fl.client().models.list()}
    for m in a.models.list():
        assert (m.max_input_tokens, m.max_tokens) == (limits[m.id]["input"],
                                                      limits[m.id]["output"])
    # str.isdigit() takes `²` and `١` (Arabic-Indic one); int() of 5,000 digits raises
    for query in ("limit=0", "limit=x", "after_id=nope", "limit=%C2%B2", "limit=%D9%A1",
                  "limit=" + "1" * 5000, "limit=1001", "limit=-1", "limit=+5", "limit= 5"):
        r = httpx2.get(fl.url + "/v1/models?" + query,
                       headers={"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01"})
        assert r.status_code == 400 and r.json()["type"] == "error", query
        assert query.split("=")[0] in r.json()["error"]["message"]


def test_body_over_the_limit_is_413(fl):
    r = httpx2.post(fl.url + "/v1/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_require_auth_401(fl):
    old = fl.state.auth
    fl.state.auth = Authenticator({hash_key(ALICE_KEY): "alice"}, require_auth=True)
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            fl.client("sk-wrong").chat.completions.create(model="tiny", messages=MSG)
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            fl.client("sk-wrong").models.list()
        fl.client(ALICE_KEY).chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
        assert httpx2.get(fl.url + "/health").status_code == 200  # probes need no key
    finally:
        fl.state.auth = old


def test_health_and_metrics(fl):
    h = httpx2.get(fl.url + "/health").json()
    assert h["status"] == "ok" and h["neurons"]["n1"]["healthy"]
    fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    m = httpx2.get(fl.url + "/metrics").text
    assert 'helexa_router_requests_total{code="200",model="tiny"}' in m
    assert 'helexa_neuron_kv_free_bytes{model="tiny",neuron="n1"}' in m
    assert "helexa_router_ttft_seconds_bucket" in m
    assert "helexa_router_selections_total" in m


def test_streamed_prompt_token_ids_survive_an_empty_first_message():
    from helexa.proto import neuron_pb2 as pb
    from helexa.router import encode
    from helexa.router.openai_api import parse_request

    req = parse_request({"model": "m", "prompt": [1, 2], "stream": True,
                         "return_token_ids": True}, "completion")
    env = encode.Envelope("cmpl-x", 0, "m", req)
    choice = encode.Choice(0)
    empty = pb.GenerateResponse(prompt_token_ids=[1, 2])
    assert encode.delta_chunk(env, choice, empty, first=True) is None
    encode.add_delta(choice, empty)
    chunk = encode.delta_chunk(env, choice, pb.GenerateResponse(text="a", token_ids=[7]), first=True)
    assert chunk["prompt_token_ids"] == [1, 2] and chunk["choices"][0]["token_ids"] == [7]
