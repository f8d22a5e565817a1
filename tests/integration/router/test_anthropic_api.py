"""Anthropic's Messages API end to end with the official `anthropic` SDK on the tiny model."""

from __future__ import annotations

import json

import httpx2
import pytest
from router_procs import key_of
from support.lazy_import import Lazy

anthropic = Lazy("anthropic")

MSGS = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 10}}}}


def client(router, principal: str = "alice") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key=key_of(principal), max_retries=0,
                               timeout=60)


def test_messages_whole_and_streamed_agree(router):
    c = client(router)
    kw = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0}, system="Be brief.", messages=[
        *MSGS, {"role": "assistant", "content": "The sea"}, {"role": "user", "content": "More."}])
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content[0].type == "text"
    assert 0 < m.usage.output_tokens <= 12 and m.usage.input_tokens > 0
    with c.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text  # greedy: same tokens either way
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert final.usage.output_tokens == m.usage.output_tokens


def test_stop_sequences_end_the_turn_with_the_sequence(router):
    c = client(router)
    probe = c.messages.create(model="tiny", max_tokens=20, extra_body={"temperature": 0}, messages=MSGS)
    text = probe.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2].strip() or text[:1]
    m = c.messages.create(model="tiny", max_tokens=20, extra_body={"temperature": 0}, messages=MSGS,
                          stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text if m.content else True


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_and_a_tool_result_turn(router, stream):
    c = client(router)
    kw = dict(model="tiny", max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER], messages=MSGS,
              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with c.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input["city"], str) and len(use.input["city"]) <= 10
    follow = c.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, tools=[WEATHER],
                               messages=[*MSGS, {"role": "assistant", "content": m.content},
                                         {"role": "user", "content": [
                                             {"type": "tool_result", "tool_use_id": use.id,
                                              "content": "sunny"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_budget_gives_thinking_blocks_then_text(router, stream):
    c = client(router)
    kw = dict(model="tiny", max_tokens=40, extra_body={"temperature": 0}, messages=MSGS,
              thinking={"type": "enabled", "budget_tokens": 5})
    if stream:
        with c.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**kw)
    kinds = [b.type for b in m.content]
    assert kinds[0] == "thinking" and m.content[0].thinking
    assert "text" in kinds[1:] or m.stop_reason == "max_tokens"


def test_errors_use_anthropics_envelope(router):
    c = client(router)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=0, messages=MSGS)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=router.url, api_key="sk-wrong", max_retries=0
                            ).messages.create(model="tiny", max_tokens=5, messages=MSGS)
    r = httpx2.post(router.url + "/v1/messages", headers={"x-api-key": key_of("alice")},
                    json={"model": "tiny", "max_tokens": 3, "messages": MSGS})
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_count_tokens_matches_what_a_request_is_admitted_with(router):
    c = client(router)
    kw = dict(model="tiny", system="Be brief.", messages=MSGS, tools=[WEATHER])
    n = c.messages.count_tokens(**kw).input_tokens
    m = c.messages.create(max_tokens=3, **kw)
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert c.messages.count_tokens(model="tiny", messages=MSGS).input_tokens < n


def test_a_system_message_stands_where_it_was_sent_and_the_prefix_cache_holds(router):
    c = client(router)
    # Anthropic's mid-conversation system message (Claude Code sends them): an instruction
    # from that point, the system prompt untouched, so the conversation before it is the
    # previous request's and comes from the prefix cache (joined to the system prompt at the
    # start, it changed the prompt's first tokens: nothing was cached)
    long = [{"role": "user", "content": "Tell me about the sea. " * 40}]
    first = c.messages.create(model="tiny", max_tokens=2, system="Be brief.", messages=long)
    with_mid = c.messages.create(model="tiny", max_tokens=3, system="Be brief.", messages=[
        *long, {"role": "system", "content": "Answer in French."}])
    assert with_mid.content and with_mid.usage.output_tokens > 0
    assert with_mid.usage.cache_read_input_tokens >= first.usage.input_tokens - 32, (
        first.usage, with_mid.usage)
    n_mid = c.messages.count_tokens(model="tiny", system="Be brief.", messages=[
        *long, {"role": "system", "content": "Answer in French."}]).input_tokens
    n_without = c.messages.count_tokens(model="tiny", system="Be brief.",
                                        messages=long).input_tokens
    assert n_mid > n_without  # the instruction is in the prompt


@pytest.mark.parametrize(("messages", "at", "why"), [
    ([{"role": "system", "content": "Be brief."}, *MSGS], 0, "cannot be the first entry"),
    ([*MSGS, {"role": "system", "content": "A."}, {"role": "system", "content": "B."}], 1,
     "next to another"),
    ([*MSGS, {"role": "assistant", "content": "Waves."}, {"role": "system", "content": "A."}],
     2, "must follow a `user` message"),
    ([*MSGS, {"role": "system", "content": "A."}, {"role": "user", "content": "More."}], 1,
     "followed by an `assistant` message")])
def test_a_system_message_placed_where_anthropic_refuses_it_is_a_400(router, messages, at, why):
    # Anthropic's placement rules for mid-conversation system messages: refused as its API
    # refuses them, naming the message's role, before any neuron is asked
    c = client(router)
    for call in (lambda: c.messages.create(model="tiny", max_tokens=3, messages=messages),
                 lambda: c.messages.count_tokens(model="tiny", messages=messages)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        err = e.value.body["error"]
        assert err["type"] == "invalid_request_error"
        assert f"messages[{at}].role" in err["message"] and why in err["message"]


def test_claude_codes_billing_header_does_not_split_the_prefix_cache(router):
    # Claude Code's system[0] (captured from 2.1.197, tests/fixtures/agents/claude_code-1.json)
    # ends in a hash of the request: two sessions, or two turns where it adds `cch=`, differ
    # there, before the whole system prompt and tools. It is billing metadata, not prompt.
    c = client(router)
    rest = [{"type": "text", "text": "You are a Claude agent, built on Anthropic's Claude Agent "
             "SDK.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "\nYou are an interactive agent. " * 30}]
    n = c.messages.count_tokens(model="tiny", system=rest, messages=MSGS).input_tokens
    for tail in ("123", "cc4; cch=0aaa9"):  # a different prompt's header, a later turn's
        head = {"type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.197.{tail}; cc_entrypoint=cli;"}
        assert c.messages.count_tokens(model="tiny", system=[head, *rest],
                                       messages=MSGS).input_tokens == n
        m = c.messages.create(model="tiny", max_tokens=1, system=[head, *rest], messages=MSGS)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n
    assert (m.usage.cache_read_input_tokens or 0) >= n - 16  # all but the last block's tokens
    as_string = "\n".join([head["text"], "".join(b["text"] for b in rest)])
    assert c.messages.count_tokens(model="tiny", system=as_string,
                                   messages=MSGS).input_tokens == n


def test_streams_report_input_tokens_from_the_start(router):
    # message_start's usage is message_delta's: input_tokens uncached, as Anthropic defines it
    c = client(router)
    msgs = [{"role": "user", "content": "Tell me about the sea, " * 40}]
    n = c.messages.count_tokens(model="tiny", messages=msgs).input_tokens
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        with c.messages.stream(model="tiny", max_tokens=2, messages=msgs,
                               extra_body={"temperature": 0}) as s:
            start = next(e for e in s if e.type == "message_start").message.usage
            final = s.get_final_message().usage
        assert start.input_tokens + (start.cache_read_input_tokens or 0) == n
        assert (start.input_tokens, start.cache_read_input_tokens) == (
            final.input_tokens, final.cache_read_input_tokens)
    assert final.cache_read_input_tokens


def test_max_tokens_over_the_context_is_fitted_and_said(router):
    limit = httpx2.get(router.url + "/v1/models/tiny",
                       headers={"Authorization": f"Bearer {key_of('alice')}"}).json()["limit"]
    # Claude Code asks for 32,000 whatever the model: the reply fits what the context leaves
    raw = httpx2.post(router.url + "/v1/messages", timeout=60,
                      headers={"x-api-key": key_of("alice")},
                      json={"model": "tiny", "max_tokens": 32000, "messages": MSGS,
                            "temperature": 0, "stop_sequences": ["e"]})
    assert raw.status_code == 200 and raw.json()["type"] == "message"
    fitted = int(raw.headers["x-helexa-max-tokens"].split()[0])
    assert 0 < fitted < limit["context"] < 32000
    prompt = client(router).messages.count_tokens(model="tiny", messages=MSGS).input_tokens
    assert fitted == min(limit["context"] - prompt, limit["output"])


def test_a_prompt_over_the_context_is_worded_as_anthropic_words_it(router):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(router).messages.create(model="tiny", max_tokens=5, messages=[
            {"role": "user", "content": "sea " * 6000}])
    message = e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert message.startswith("prompt is too long: ") and "tokens >" in message
    r = httpx2.get(router.url + "/v1/messages", headers={"x-api-key": key_of("alice")})
    assert r.status_code == 405 and r.json()["type"] == "error"  # the envelope, even here


def test_models_in_anthropics_shape_for_its_sdk(router):
    page = client(router).models.list()
    ids = [m.id for m in page.data]
    assert "tiny" in ids and all(m.type == "model" for m in page.data)
    assert page.data[0].display_name and not page.has_more


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_every_body_error_is_in_anthropics_envelope(router, path):
    ok = '{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]'
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    bodies = {
        "not JSON": (b"{", 400), "not an object": (b"[1]", 400),
        "nested 1,000 deep": ((ok + ', "metadata": {"user_id": ' + "[" * 1000 + "]" * 1000
                               + "}}").encode(), 400),
        "an unknown field": ((ok + ', "frobnicate": 1}').encode(), 400),
        "a wrong type": (ok.replace('"max_tokens": 3', '"max_tokens": "3"').encode() + b"}",
                         400),
        "over the body limit": (b'{"model": "' + b"x" * 70_000 + b'"}', 413),
        "too many tools": ((ok + ', "tools": [' + ", ".join(
            f'{{"name": "t{i}", "input_schema": {{"type": "object"}}}}' for i in range(129))
            + "]}").encode(), 400),
    }
    if path == "/v1/messages":
        bodies["an endless schema"] = ((ok + ', "output_config": {"format": {"type": '
                                        '"json_schema", "schema": ' + json.dumps(endless)
                                        + "}}}").encode(), 400)
    headers = {"x-api-key": key_of("alice"), "Content-Type": "application/json"}
    for what, (body, status) in bodies.items():
        r = httpx2.post(router.url + path, content=body, headers=headers, timeout=30)
        assert r.status_code == status, (what, r.status_code, r.text[:300])
        got = r.json()
        assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, (what, got)
        assert got["error"]["message"], what
    r = httpx2.post(router.url + path, content=b"{", headers={"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_prefill_is_continued_as_the_open_prompt_would_be(router):
    # A final assistant message is the answer begun: the prompt ends with its text (no end
    # of turn, no new generation prompt) and the reply is only the continuation
    auth = {"Authorization": f"Bearer {key_of('alice')}"}
    prefill = [*MSGS, {"role": "assistant", "content": "The sea is"}]
    ids = httpx2.post(router.url + "/tokenize", headers=auth, json={
        "model": "tiny", "messages": prefill, "continue_final_message": True}).json()["tokens"]
    prompt = httpx2.post(router.url + "/detokenize", headers=auth,
                         json={"model": "tiny", "tokens": ids}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nThe sea is")
    for kwargs in ({"continue_final_message": True}, {"messages": [], "tools": 1}):
        # vLLM's flags may come in chat_template_kwargs; another field is a 400 naming it
        r = httpx2.post(router.url + "/tokenize", headers=auth, json={
            "model": "tiny", "messages": prefill, "chat_template_kwargs": kwargs})
        if "messages" in kwargs:
            assert r.status_code == 400 and r.json()["error"]["param"] == \
                "chat_template_kwargs.messages", r.text
        else:
            assert r.json()["tokens"] == ids
    want = router.client().completions.create(model="tiny", prompt=ids, max_tokens=6,
                                              temperature=0).choices[0].text
    m = client(router).messages.create(model="tiny", max_tokens=6, messages=prefill,
                                       extra_body={"temperature": 0})
    assert m.content[0].text == want and m.usage.input_tokens + (
        m.usage.cache_read_input_tokens or 0) == len(ids)
    chat = router.client().chat.completions.create(
        model="tiny", messages=prefill, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert chat.choices[0].message.content == want
    assert client(router).messages.count_tokens(model="tiny",
                                                messages=prefill).input_tokens == len(ids)


def test_two_different_keys_are_refused_naming_both_headers(router):
    """Anthropic authenticates by x-api-key, OpenAI by Authorization: a call bearing two
    different keys is refused 400 (RFC 6750, a token sent more than one way), in the
    endpoint's envelope, never run as either key. The same key twice is one key."""
    body = {"model": "tiny", "max_tokens": 2, "messages": MSGS}
    two = {"x-api-key": key_of("alice"), "Authorization": f"Bearer {key_of('bob')}"}
    r = httpx2.post(router.url + "/v1/messages", headers=two, json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "x-api-key" in error["message"] and "Authorization" in error["message"]
    r = httpx2.post(router.url + "/v1/chat/completions", headers=two, json=body)
    assert r.status_code == 400 and "x-api-key" in r.json()["error"]["message"], r.text
    twice = [("Authorization", f"Bearer {key_of('alice')}"),
             ("Authorization", f"Bearer {key_of('bob')}")]
    r = httpx2.post(router.url + "/v1/chat/completions", headers=twice, json=body)
    assert r.status_code == 400 and "Authorization" in r.json()["error"]["message"], r.text
    same = {"x-api-key": key_of("alice"), "Authorization": f"Bearer {key_of('alice')}"}
    assert httpx2.post(router.url + "/v1/messages", headers=same, json=body).status_code == 200


def test_a_thinking_budget_of_zero_is_400_naming_it(router):
    """`enabled` with budget 0 would allow the thought no token: a 400 in Anthropic's
    envelope naming the field, as Anthropic refuses a budget under its minimum."""
    with pytest.raises(anthropic.BadRequestError) as e:
        client(router).messages.create(model="tiny", max_tokens=50, messages=MSGS,
                                       thinking={"type": "enabled", "budget_tokens": 0})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in e.value.body["error"]["message"]
