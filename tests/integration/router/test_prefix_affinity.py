"""A conversation's next turn goes to the neuron that holds its prefix.

`tiny` is hosted by two neurons (na and nb). The router ranks near-ties by
rendezvous hashing of the conversation's opening (helexa/router/selection.py),
so each turn of one conversation lands where the previous turn's KV is cached:
its `cached_tokens` covers the previous prompt. Sent to a neuron at random,
about half the turns would find nothing cached.
"""

from __future__ import annotations

SYSTEM = ("You are a careful assistant for a shipping company. Answer questions about "
          "ports, tides, cargo and schedules. ") * 6


def test_every_turn_of_a_conversation_finds_the_previous_prompt_cached(router):
    c = router.client()
    for conversation in range(6):  # several openings: they hash to both neurons
        messages = [{"role": "system", "content": f"[{conversation}] {SYSTEM}"},
                    {"role": "user", "content": f"Question {conversation}: the tide?"}]
        previous_prompt = 0
        for turn in range(3):
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                          temperature=0)
            usage = r.usage
            cached = usage.prompt_tokens_details.cached_tokens
            if turn:
                # all of the previous prompt's whole 16-token blocks, at least
                assert cached >= previous_prompt // 16 * 16 >= 0.9 * previous_prompt - 16, (
                    conversation, turn, cached, previous_prompt)
            previous_prompt = usage.prompt_tokens
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": f"And turn {turn + 1}?"}]
