"""vLLM's request extras that benchmark and eval tools send (guidellm, lm-eval), and the
completions forms they use: served or ignored as docs/api.md says, never refused."""

from __future__ import annotations

import json

import httpx2
import pytest
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


def _reference_logprobs(model_dir, prompts: list[list[int]]) -> list[list[float]]:
    """transformers' log-softmax at each position before a prompt token, at that token."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        out.append(lps[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist())
    return out


def test_lm_eval_loglikelihood_gets_the_prompts_logprobs(router, tiny_model_dir):
    """lm-eval's local-completions loglikelihood: echo, logprobs 1, max_tokens 0 (a batch of
    token-id prompts) returns each prompt's tokens, their logprobs (the first null) and their
    best alternative, as transformers computes them, and generates nothing."""
    c = router.client()
    ids = [[5, 77, 301, 42, 9, 250, 18], [300, 7, 7, 64]]
    r = c.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=0,
                             temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 0
    for ch, prompt, ref in zip(r.choices, ids, _reference_logprobs(tiny_model_dir, ids),
                               strict=True):
        lp = ch.logprobs
        assert ch.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
            len(lp.text_offset) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref, strict=True)) < 1e-4
        # the best and the token itself (k + 1 at most, as OpenAI's legacy API)
        assert all(1 <= len(top) <= 2 and max(top.values()) >= got - 1e-6 and top[tok] == got
                   for top, got, tok in zip(lp.top_logprobs[1:], lp.token_logprobs[1:],
                                            lp.tokens[1:], strict=True))
        # the echo is the prompt decoded, and each token's offset indexes it
        assert ch.text == "".join(lp.tokens)
        assert [ch.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens,
                                                       strict=True)] == lp.tokens
    # streamed: one chunk, the prompt and its logprobs, and the finish
    chunks = [c["choices"][0] for c in _events(router, "/v1/completions", {
        "model": "tiny", "prompt": ids[0], "echo": True, "logprobs": 1, "max_tokens": 0,
        "stream": True}) if c["choices"]]
    assert len(chunks) == 1 and chunks[0]["finish_reason"] == "length"
    assert chunks[0]["text"] == r.choices[0].text
    assert chunks[0]["logprobs"]["token_logprobs"] == r.choices[0].logprobs.token_logprobs


def test_echo_with_logprobs_is_the_prompt_then_the_generated(router):
    """echo + logprobs with max_tokens > 0: the prompt's tokens, then the generated ones, whose
    logprobs are a plain request's; text_offset indexes the text whole (a character split
    over tokens included); the stream says the same, the prompt in its first chunk."""
    c = router.client()
    prompt = "the sea is café ☕ deep"
    kw = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    plain = c.completions.create(**kw).choices[0]
    r = c.completions.create(**kw, echo=True)
    ch = r.choices[0]
    n = r.usage.prompt_tokens
    assert ch.text == prompt + plain.text
    lp = ch.logprobs
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None
    assert lp.tokens[n:] == plain.logprobs.tokens
    # (the LM head over every prompt row, not the last alone: a rounding step apart)
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    # two alternatives each (a dict by text: byte pieces that both read U+FFFD are one key)
    assert all(x <= 0 and (2 <= len(top) <= 3 or "\ufffd" in top) and t in top
               for x, top, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], lp.tokens[1:],
                                    strict=True))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n] == len(prompt)
    for o, t in zip(lp.text_offset, lp.tokens, strict=True):
        assert ch.text.startswith(t, o) or "\ufffd" in t  # a piece of a split character
    assert lp.text_offset[n + 1:] == [len(prompt) + o for o in plain.logprobs.text_offset[1:]]
    chunks = _events(router, "/v1/completions", {**kw, "echo": True, "stream": True})
    texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
    assert "".join(texts) == ch.text and texts[0].startswith(prompt)
    streamed = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == lp.token_logprobs
    assert sum((s["text_offset"] for s in streamed), []) == lp.text_offset
