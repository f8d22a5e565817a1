"""OpenAI's Responses API end to end with the official `openai` SDK on the tiny model:
responses.create / responses.stream, tools and their outputs, reasoning, structured output,
the stateless refusals."""

from __future__ import annotations

import json

import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 10}}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}


def test_create_and_stream_agree_on_text_and_usage(router):
    c = router.client()
    kw = dict(model="tiny", instructions="Be brief.", input="Tell me about the sea.",
              max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text
    assert 0 < r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":  # the budget cut the message: it says so too
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == r.status
    with c.responses.stream(**kw) as s:
        events = list(s)
    kinds = [e.type for e in events]
    # the last event carries the response: response.completed (which the SDK's
    # get_final_response wants), or response.incomplete when the budget ran out, as OpenAI
    final = events[-1].response
    assert final.status == r.status and final.output[-1].status == r.status
    assert final.output_text == r.output_text  # greedy: the same tokens either way
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))  # from 0, as OpenAI
    assert r.instructions == final.instructions == "Be brief."  # settings as sent
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert final.usage.output_tokens == r.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_then_its_output(router, stream):
    c = router.client()
    # The call is written in the model's own format, `<tool_call>` to `</tool_call>` with a
    # city of at most 10 characters: fewer than 160 tokens, so the grammar closes it.
    kw = dict(model="tiny", input="Weather in Oslo?", tools=[WEATHER], max_output_tokens=160,
              temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with c.responses.stream(**kw) as s:
            r = s.get_final_response()  # the grammar closes the call: response.completed
    else:
        r = c.responses.create(**kw)
    assert r.tools[0].strict is None  # as sent: not at all
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert isinstance(args["city"], str) and len(args["city"]) <= 10
    follow = c.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=8,
                                temperature=0, input=[
                                    {"role": "user", "content": "Weather in Oslo?"},
                                    {"type": "function_call", "call_id": call.call_id,
                                     "name": call.name, "arguments": call.arguments},
                                    {"type": "function_call_output", "call_id": call.call_id,
                                     "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output


@pytest.mark.parametrize("summary", [None, "auto"])
def test_reasoning_comes_as_a_reasoning_item(router, summary):
    reasoning = {"effort": "medium", **({"summary": summary} if summary else {})}
    with router.client().responses.stream(model="tiny", input="Tell me about the sea.",
                                          max_output_tokens=40, temperature=0,
                                          reasoning=reasoning) as s:
        events = list(s)
    kinds, r = {e.type for e in events}, events[-1].response
    item = r.output[0]
    assert item.type == "reasoning"
    text = (item.summary[0].text if summary else item.content[0].text)
    assert text and "<think>" not in text
    assert ("response.reasoning_summary_text.delta" if summary
            else "response.reasoning_text.delta") in kinds
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 8  # medium: half of 16


def test_structured_output_with_text_format(router):
    r = router.client().responses.create(
        model="tiny", input="A record.", max_output_tokens=80, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "rec", "schema": SCHEMA,
                         "strict": True}})
    assert r.text.format.strict is True and r.text.format.name == "rec"
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "ok"} and isinstance(obj["ok"], bool)


def test_stateless_refusals_say_so(router):
    c = router.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    assert "keeps no state" in e.value.body["message"]
    r = c.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    assert r.status in ("completed", "incomplete")  # accepted; nothing is stored
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input=[{"type": "item_reference", "id": "msg_1"}])
    assert "keeps no state" in e.value.body["message"]


def test_cache_key_identifier_tier_and_tool_call_cap_are_bounded_and_echoed(router):
    c = router.client()
    kw = dict(model="tiny", input="Hi.", max_output_tokens=3, temperature=0,
              prompt_cache_key="conversation-7", safety_identifier="user-hash-1",
              service_tier="flex", max_tool_calls=3, top_logprobs=2)
    with c.responses.stream(**kw) as s:
        events = list(s)
    for r in (c.responses.create(**kw), events[0].response, events[-1].response):
        assert (r.prompt_cache_key, r.safety_identifier, r.max_tool_calls, r.top_logprobs) == (
            "conversation-7", "user-hash-1", 3, 2)
        assert r.service_tier == "default"  # the tier that served it: the one there is
    plain = c.responses.create(model="tiny", input="Hi.", max_output_tokens=2)
    assert (plain.prompt_cache_key, plain.safety_identifier, plain.max_tool_calls,
            plain.top_logprobs, plain.service_tier) == (None, None, None, 0, "default")
    for field, bad in (("prompt_cache_key", "k" * 65), ("safety_identifier", "s" * 129),
                       ("service_tier", "gold"), ("max_tool_calls", 0), ("top_logprobs", 21)):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="tiny", input="Hi.", max_output_tokens=2, **{field: bad})
        assert e.value.body["param"] == field, e.value.body


def test_requests_sharing_a_prompt_cache_key_find_each_others_prefix(router):
    # na and nb both serve tiny; without a key the router places a conversation by its
    # opening (system prompt and first user turn), so two requests with one long system
    # prompt and different questions may land apart. Naming one prompt_cache_key, each
    # second request lands where the first one left that system prompt cached.
    c = router.client()
    for k in range(8):
        system = f"[key {k}] You answer questions about lighthouses. " * 4
        cached = [c.responses.create(model="tiny", instructions=system, input=question,
                                     max_output_tokens=2, temperature=0,
                                     prompt_cache_key=f"lighthouse-{k}"
                                     ).usage.input_tokens_details.cached_tokens
                  for question in (f"First question {k}?", f"Another one {k}, please?")]
        assert cached[0] == 0 and cached[1] >= 32, (k, cached)


def test_chat_requests_sharing_a_prompt_cache_key_find_each_others_prefix(router):
    """As on Responses: chat completions naming one prompt_cache_key land together; the
    hints are bounded as OpenAI bounds them."""
    c = router.client()
    for k in range(8):
        system = f"[chat key {k}] You answer questions about tides. " * 4
        cached = [c.chat.completions.create(
            model="tiny", max_tokens=2, temperature=0, prompt_cache_key=f"tides-{k}",
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}],
        ).usage.prompt_tokens_details.cached_tokens
            for question in (f"First question {k}?", f"Another one {k}, please?")]
        assert cached[0] == 0 and cached[1] >= 32, (k, cached)
    for field, bad in (("prompt_cache_key", "k" * 65), ("safety_identifier", "s" * 129),
                       ("service_tier", "gold")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", max_tokens=1, extra_body={field: bad},
                                      messages=[{"role": "user", "content": "hi"}])
        assert field in str(e.value), (field, e.value)


@pytest.mark.parametrize("reasoning", [None, {"effort": "medium"}])
def test_answer_logprobs_come_on_output_text_whole_and_streamed(router, reasoning):
    c = router.client()
    kw = dict(model="tiny", input="Tell me about the sea.", max_output_tokens=40,
              temperature=0, include=["message.output_text.logprobs"], top_logprobs=2,
              **({"reasoning": reasoning} if reasoning else {}))
    r = c.responses.create(**kw)
    (text,) = [p for o in r.output if o.type == "message" for p in o.content]
    assert text.text and text.logprobs
    assert all(len(t.top_logprobs) == 2 for t in text.logprobs)
    # the tokens that wrote the answer, none of the thought's or its markers'
    joined = b"".join(bytes(t.bytes) for t in text.logprobs).decode("utf-8", "replace")
    assert joined == text.text
    if reasoning:
        assert r.output[0].type == "reasoning"
    with c.responses.stream(**kw) as s:
        events = list(s)
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    # greedy: the same tokens; their logprobs to float noise (the second run's prompt comes
    # from the prefix cache, its prefill a different shape of matmul: not bit for bit)
    assert [t.token for t in deltas] == [t.token for t in text.logprobs]
    assert [t.logprob for t in deltas] == pytest.approx([t.logprob for t in text.logprobs],
                                                        abs=1e-3)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [t.token for t in done.logprobs] == [t.token for t in text.logprobs]
    without = c.responses.create(**{**kw, "include": []})
    assert without.output_text == r.output_text
    assert not [p.logprobs for o in without.output if o.type == "message" for p in o.content
                if p.logprobs]
