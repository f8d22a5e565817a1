"""A reply whose client named no max_tokens is not cut at kv.default_output_tokens: the
neuron grows its reservation while the pool has room (helexa/neuron/engine/growth.py)."""

from __future__ import annotations

from router_procs import ledger_whole, wait_for

MSG = [{"role": "user", "content": "Tell me about the sea."}]


def test_a_reply_without_max_tokens_goes_past_the_default_output_budget(router):
    c = router.client()
    # tiny-grow: context 64, kv.default_output_tokens 8 (its profile); no eos, no ceiling
    r = c.chat.completions.create(model="tiny-grow", messages=MSG, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens > 8
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 64  # to the context
    named = c.chat.completions.create(model="tiny-grow", messages=MSG, temperature=0,
                                      max_tokens=8, extra_body={"ignore_eos": True})
    assert named.usage.completion_tokens == 8 and named.choices[0].finish_reason == "length"
    wait_for(lambda: ledger_whole(router, "nt", "tiny-grow"), timeout=10)
