"""The OpenAI surface end to end: real router and neuron processes, the official client."""

from __future__ import annotations

import asyncio

import httpx2
from router_procs import TOKEN, wait_for
from support.neuron import NeuronClient, model_of

MSG = [{"role": "user", "content": "Tell me about the sea."}]


def test_chat_non_streaming_and_streaming_agree(router):
    c = router.client()
    full = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert 0 < full.usage.completion_tokens <= 12
    stream = c.chat.completions.create(model="helexa/balanced", messages=MSG, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content  # greedy: same tokens either way
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[0].model == "tiny"


def test_completions_with_token_ids_and_return_token_ids(router):
    c = router.client()
    r = c.completions.create(model="tiny", prompt=[10, 20, 30, 40], max_tokens=5, temperature=0,
                             extra_body={"return_token_ids": True, "ignore_eos": True})
    body = r.model_dump()
    assert body["prompt_token_ids"] == [10, 20, 30, 40]
    assert len(body["choices"][0]["token_ids"]) == 5 == r.usage.completion_tokens
    assert r.usage.prompt_tokens == 4
    s = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in s)


def test_models_lists_aliases_and_the_smallest_limits(router):
    data = {m.id: m.model_dump() for m in router.client().models.list()}
    # na's pool (1 MiB) holds 2048 tiny tokens, nb's (2 MiB) 4096: the smaller wins.
    assert data["tiny"]["limit"] == {"context": 2048, "input": 2047, "output": 2047}
    assert data["helexa/balanced"]["limit"] == data["tiny"]["limit"]
    assert data["tight"]["limit"]["context"] == 1024
    assert "lazy" not in data  # not loaded


def test_logprobs_and_n(router):
    r = router.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=3,
                                                logprobs=True, top_logprobs=2, n=2, seed=5)
    assert len(r.choices) == 2
    for ch in r.choices:
        assert 1 <= len(ch.logprobs.content) <= 3
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in ch.logprobs.content)
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)


def test_health_and_metrics_mirror(router):
    h = httpx2.get(router.url + "/health").json()
    assert {n for n, v in h["neurons"].items() if v["healthy"]} == {"na", "nb", "nt"}
    assert router.metric("helexa_neuron_kv_total_bytes", neuron="na", model="tiny") == 1 << 20
    assert router.metric("helexa_neuron_kv_total_bytes", neuron="nb", model="tiny") == 2 << 20


def test_usage_reports_accepted_and_rejected_drafts(router, neurons):
    """n-gram speculation on a prompt that repeats: the drafts the model kept, and those it
    threw away, reach the client as usage.completion_tokens_details, streamed
    (include_usage) or not; together they are what the neuron drafted for the request."""
    def drafts() -> tuple[int, int]:  # nb's tiny-ngram: (drafted, accepted) since it started
        async def go() -> tuple[int, int]:
            async with NeuronClient(neurons["nb"].address, TOKEN) as c:
                m = model_of(await c.status(), "tiny-ngram")
                return m.spec_drafted_tokens, m.spec_accepted_tokens
        return asyncio.run(go())

    text = "Repeat after me: one two three one two three one two three"
    kw = dict(model="tiny-ngram", messages=[{"role": "user", "content": text}],
              max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    before = drafts()
    full = router.client().chat.completions.create(**kw)
    d = full.usage.completion_tokens_details
    assert d.accepted_prediction_tokens > 0
    wait_for(lambda: drafts()[1] == before[1] + d.accepted_prediction_tokens, timeout=10)
    drafted = drafts()[0] - before[0]
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens == drafted, drafted
    assert d.accepted_prediction_tokens < full.usage.completion_tokens == 40
    chunks = list(router.client().chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    plain = router.client().chat.completions.create(**{**kw, "model": "tiny"})
    assert plain.choices[0].message.content == full.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
