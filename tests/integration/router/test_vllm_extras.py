"""vLLM's request extras that benchmark and eval tools send (guidellm, lm-eval), and the
completions forms they use: served or ignored as docs/api.md says, never refused."""

from __future__ import annotations

import json

import httpx2
from router_procs import key_of

AUTH = {"Authorization": f"Bearer {key_of('alice')}"}
MSG = [{"role": "user", "content": "Tell me about the sea."}]


def _events(router, path: str, body: dict) -> list[dict]:
    with httpx2.stream("POST", router.url + path, headers=AUTH, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_guidellms_streaming_body_gets_usage_on_every_chunk(router):
    # guidellm's default request: continuous_usage_stats, ignore_eos and a fixed max_tokens
    chunks = _events(router, "/v1/completions", {
        "model": "tiny", "prompt": "the sea", "max_tokens": 6, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_extras_that_change_nothing_are_accepted(router):
    c = router.client()
    kw = dict(model="tiny", messages=MSG, max_tokens=5, temperature=0)
    plain = c.chat.completions.create(**kw).choices[0].message.content
    extras = c.chat.completions.create(**kw, extra_body={
        "min_tokens": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "prompt_logprobs": None, "truncate_prompt_tokens": 4096}).choices[0].message.content
    assert extras == plain


def test_include_stop_str_in_output_ends_the_text_with_it(router):
    c = router.client()
    probe = c.completions.create(model="tiny", prompt="the sea", max_tokens=20, temperature=0)
    text = probe.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    kw = dict(model="tiny", prompt="the sea", max_tokens=20, temperature=0, stop=[stop])
    cut = c.completions.create(**kw).choices[0]
    kept = c.completions.create(**kw, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop


def test_completions_echo_and_a_batch_of_prompts(router):
    c = router.client()
    r = c.completions.create(model="tiny", prompt="the sea", max_tokens=3, temperature=0,
                             echo=True)
    assert r.choices[0].text.startswith("the sea")
    streamed = "".join(ch["choices"][0]["text"] for ch in _events(router, "/v1/completions", {
        "model": "tiny", "prompt": "the sea", "max_tokens": 3, "temperature": 0, "echo": True,
        "stream": True}) if ch["choices"])
    assert streamed == r.choices[0].text
    one = [c.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0)
           for p in ("the sea", "a ship")]
    batch = c.completions.create(model="tiny", prompt=["the sea", "a ship"], max_tokens=3,
                                 temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert [ch.text for ch in batch.choices] == [o.choices[0].text for o in one]
    assert batch.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)


def test_vllm_metric_names_beside_helexas_own(router):
    before_p = router.metric("vllm:prompt_tokens_total", model_name="tiny")
    before_g = router.metric("helexa_router_generation_tokens_total", model="tiny")
    chunks = _events(router, "/v1/chat/completions", {
        "model": "tiny", "messages": MSG, "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    m = router.metrics()
    assert m[("vllm:prompt_tokens_total", (("model_name", "tiny"),))] - before_p == \
        usage["prompt_tokens"]
    assert m[("helexa_router_generation_tokens_total", (("model", "tiny"),))] - before_g == 4
    assert m[("vllm:time_to_first_token_seconds_count", (("model_name", "tiny"),))] >= 1
    assert m[("vllm:inter_token_latency_seconds_count", (("model_name", "tiny"),))] >= 1
    assert 0 <= m[("vllm:kv_cache_usage_perc", (("model_name", "tiny"),))] <= 1
    assert ("vllm:num_requests_running", (("model_name", "tiny"),)) in m
    assert ("vllm:num_requests_waiting", (("model_name", "tiny"),)) in m
