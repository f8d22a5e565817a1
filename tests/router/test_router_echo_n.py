"""An `n > 1` completion echoing its prompt with logprobs: the prompt's logprobs are the
same for every choice, so the router asks the neuron for them on each prompt's first choice
alone (forward.generate_requests) and gives every choice the same entries, streamed or
whole, in the shape a single choice has them."""

from __future__ import annotations

import json

import httpx2
import pytest

PROMPT = [5, 6, 7]
ECHO = "p5 p6 p7 "
BODY = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}


def _forget(fl) -> None:
    fl.lt.call(lambda: (fl.n1.requests.clear(), fl.n2.requests.clear()))


def _sent(fl) -> list:
    return sorted(fl.n1.requests + fl.n2.requests, key=lambda q: q.req_id)


def _events(fl, body: dict) -> list[dict]:
    with httpx2.stream("POST", fl.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("max_tokens", [2, 0])
def test_every_choice_echoes_the_prompt_logprobs_one_call_scored(fl, max_tokens):
    one = fl.client().completions.create(**BODY, max_tokens=max_tokens).choices[0]
    assert one.text.startswith(ECHO) and one.logprobs.tokens[:3] == ["p5 ", "p6 ", "p7 "]
    _forget(fl)
    r = fl.client().completions.create(**BODY, max_tokens=max_tokens, n=3)
    sent = _sent(fl)
    assert [q.sampling.HasField("prompt_logprobs") for q in sent] == [True, False, False]
    assert all(q.return_prompt_text for q in sent)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:  # each as the one choice of n = 1 has it
        assert c.text == one.text and c.logprobs.model_dump() == one.logprobs.model_dump()
    _forget(fl)
    chunks = [ch["choices"][0] for ch in _events(fl, {**BODY, "max_tokens": max_tokens,
                                                      "n": 3, "stream": True})]
    assert [q.sampling.HasField("prompt_logprobs") for q in _sent(fl)] == [True, False, False]
    for i in range(3):
        mine = [ch for ch in chunks if ch["index"] == i]
        assert mine[0]["text"].startswith(ECHO)  # the echo first, with its logprobs
        assert mine[0]["logprobs"]["tokens"][:3] == ["p5 ", "p6 ", "p7 "]
        assert "".join(ch["text"] for ch in mine) == one.text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            got = sum((ch["logprobs"][key] for ch in mine), [])
            assert got == getattr(one.logprobs, key), key
        assert mine[-1]["finish_reason"] == "length"
