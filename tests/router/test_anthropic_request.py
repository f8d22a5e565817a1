"""Anthropic Messages request bodies: the 400s a client reads (router/anthropic.py)."""

from __future__ import annotations

import json

import pytest
from support.agent_fixtures import fixture

from helexa.router import anthropic
from helexa.router.errors import ApiError
from helexa.router.forward import chat_proto
from helexa.router.tokenize import _count_chat

MSG = [{"role": "user", "content": "hi"}]


def refused(tools: list[dict]) -> ApiError:
    for parse, extra in ((anthropic.parse_request, {"max_tokens": 4}),
                         (anthropic.parse_count_request, {})):
        with pytest.raises(ApiError) as e:
            parse(json.dumps({"model": "m", "messages": MSG, "tools": tools, **extra}).encode())
        assert e.value.status == 400
    return e.value


def test_a_server_tool_is_refused_as_one():
    # server tools carry no input_schema (docs/api.md: they are refused); the 400 must say
    # that, not that the schema is missing
    e = refused([{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}])
    assert e.param == "tools[0].type" and "web_search_20250305" in e.message


def test_a_client_tool_without_its_schema_names_it():
    e = refused([{"name": "w", "input_schema": {"type": "object"}}, {"name": "v"}])
    assert e.param == "tools[1].input_schema" and "required" in e.message



def test_an_earlier_tool_use_input_that_is_no_object_names_it():
    # the router translates turns to chat's; the 400 names the field the client sent
    body = {"model": "m", "max_tokens": 4, "messages": MSG + [{"role": "assistant", "content": [
        {"type": "text", "text": "ok"}, {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].input"

    # an object in the body: the body's own depth limit covers it (request_model.py)
    deep = json.loads('{"a":' * 200 + "1" + "}" * 200)
    body["messages"][-1]["content"][1]["input"] = deep
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(body).encode())
    assert e.value.status == 400 and "deeper than 128 levels" in e.value.message


def test_a_tool_schema_error_names_its_input_schema():
    body = {"model": "m", "max_tokens": 4, "messages": MSG, "tool_choice": {"type": "any"},
            "tools": [{"name": "a", "input_schema": {"type": "object"}},
                      {"name": "b", "input_schema": {"type": "object", "properties": {
                          "x": {"$ref": "#/nope"}}}}]}
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(body).encode()).compile()
    assert e.value.param == "tools[1].input_schema"
    assert e.value.message.startswith("`tools[1].input_schema`")


def test_between_tools_in_the_sdks_shape_takes_the_catalogue_budget():
    # the SDK's ThinkingConfigBetweenToolsParam is `type` alone
    body = {"model": "m", "max_tokens": 9, "messages": MSG, "thinking": {"type": "between_tools"}}
    req = anthropic.parse_request(json.dumps(body).encode())
    assert req.template_kwargs["enable_thinking"] is True
    assert not req.thinking_budget_tokens  # the model's own, as under adaptive


@pytest.mark.parametrize("display", ["summarized", "omitted", "updates", "highlights"])
def test_any_thinking_display_is_served_and_the_thought_comes_whole(display):
    # Claude Code 2.1.337 asks `display: "updates"` first (beta thinking-display-updates) and,
    # refused, sends the request twice more: two 400s in the router's log per session
    for parse, extra in ((anthropic.parse_request, {"max_tokens": 9}),
                         (anthropic.parse_count_request, {})):
        req = parse(json.dumps({"model": "m", "messages": MSG, **extra, "thinking": {
            "type": "adaptive", "display": display}}).encode())
        assert req.template_kwargs["enable_thinking"] is True


@pytest.mark.parametrize("field", [{"cache_control": {"type": "ephemeral"}},
                                   {"output_config": {"effort": "low"}},
                                   {"context_management": {"edits": []}}, {"speed": "fast"},
                                   {"metadata": {"user_id": "u"}}, {"temperature": 0.5}])
def test_count_tokens_takes_the_body_messages_takes(field):
    body = {"model": "m", "messages": MSG, **field}
    counted = anthropic.parse_count_request(json.dumps(body).encode())
    sent = anthropic.parse_request(json.dumps({**body, "max_tokens": 9}).encode())
    assert counted.reasoning_effort == sent.reasoning_effort  # the same prompt is counted
    with pytest.raises(ApiError) as e:
        anthropic.parse_count_request(json.dumps({**body, "max_tokens": 9}).encode())
    assert e.value.status == 400 and "max_tokens" in e.value.message


def test_any_without_tools_names_anthropics_choice():
    body = {"model": "m", "max_tokens": 9, "messages": MSG, "tool_choice": {"type": "any"}}
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(body).encode())
    assert e.value.param == "tool_choice" and "`any`" in e.value.message
    assert "required" not in e.value.message  # chat's name for it, which the client never sent


def prefilled(last: dict, **extra) -> dict:
    return {"model": "m", "max_tokens": 9, "messages": [*MSG, last], **extra}


def test_a_final_assistant_message_is_continued():
    # Anthropic's prefill: the reply continues the final assistant message
    req = anthropic.parse_request(json.dumps(prefilled(
        {"role": "assistant", "content": [{"type": "text", "text": "The sea"}]})).encode())
    assert req.messages[-1].role == "assistant" and req.messages[-1].content == "The sea"
    assert chat_proto(req).continue_final_message
    body = prefilled({"role": "assistant", "content": "The sea"})
    del body["max_tokens"]
    count = anthropic.parse_count_request(json.dumps(body).encode())
    assert chat_proto(count).continue_final_message  # counted as it is sent
    # an empty one begins nothing: a fresh answer, as without it
    empty = anthropic.parse_request(json.dumps(prefilled(
        {"role": "assistant", "content": []})).encode())
    assert empty.messages[-1].role == "user" and not chat_proto(empty).continue_final_message


@pytest.mark.parametrize("last, extra, param", [
    ({"role": "assistant", "content": "The sea "}, {}, "messages[1].content"),
    ({"role": "assistant", "content": "The sea"},
     {"thinking": {"type": "enabled", "budget_tokens": 4}}, "thinking"),
    ({"role": "assistant", "content": [{"type": "text", "text": "x"}, {
        "type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {}, "messages[1]"),
    ({"role": "assistant", "content": "{"}, {"output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, "messages[1]"),
])
def test_a_prefill_that_cannot_be_honoured_is_a_400_naming_why(last, extra, param):
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(prefilled(last, **extra)).encode())
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("source,says", [
    ({"type": "base64", "media_type": "image/png"}, "`messages[0].content[0].source.data` is required"),
    ({"type": "base64", "data": 5}, "`messages[0].content[0].source.data` must be a string"),
    ({"type": "url"}, "`messages[0].content[0].source.url` is required")])
def test_an_image_source_without_its_data_says_it_is_missing(source, says):
    # the fuzz's {"type": "base64"} with no data was told its data "must be a string"
    body = {"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps(body).encode())
    assert e.value.status == 400 and e.value.message == says


SEARCH = [{"role": "user", "content": "find it"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "select:A,B"}}]}]
DEFERRED = [{"name": "ToolSearch", "input_schema": {"type": "object"}},
            {"name": "A", "description": "does a", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
            {"name": "B", "defer_loading": True, "input_schema": {"type": "object"}}]


def searched(content: list[dict], tools: list[dict] = DEFERRED):
    """The tool turn a tool search's result becomes (Claude Code's ToolSearch, 2.1.337)."""
    body = {"model": "m", "max_tokens": 9, "tools": tools, "messages": SEARCH + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": content}]}]}
    return anthropic.parse_request(json.dumps(body).encode()).messages[-1]


def test_a_tool_reference_is_the_referenced_tools_definition_in_the_tool_turn():
    # as the ToolSearch tool's description promises the model: one <function> line a
    # tool, inside a <functions> block, the same encoding as the prompt's tool list
    turn = searched([{"type": "text", "text": "Found:"},
                     {"type": "tool_reference", "tool_name": "A"},
                     {"type": "tool_reference", "tool_name": "B"},
                     {"type": "text", "text": "Done."}])
    assert (turn.role, turn.tool_call_id, turn.parts) == ("tool", "t1", None)
    a = {"description": "does a", "name": "A",
         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
    b = {"description": "", "name": "B", "parameters": {"type": "object"}}
    assert turn.content == (f"Found:<functions>\n<function>{json.dumps(a)}</function>\n"
                            f"<function>{json.dumps(b)}</function>\n</functions>Done.")


@pytest.mark.parametrize("ref", [{"tool_name": "C"}, {}])
def test_a_reference_to_a_tool_not_listed_names_it(ref):
    with pytest.raises(ApiError) as e:
        searched([{"type": "tool_reference", "tool_name": "A"}, {"type": "tool_reference", **ref}])
    assert e.value.status == 400
    assert e.value.param == "messages[2].content[0].content[1].tool_name"


def test_deferred_tools_stay_out_of_the_prompts_tool_list():
    # Claude Code lists a tool its ToolSearch found with `defer_loading` from the next turn
    # on: kept out of the tool list (it stands in the tool turn), the prompt before that
    # turn is the previous turn's, token for token, and the prefix cache holds it
    body = fixture("claude_code-4")["body"]
    before = {**body, "messages": body["messages"][:2],
              "tools": [t for t in body["tools"] if t["name"] != "WebFetch"]}
    for parse, drop in ((anthropic.parse_request, ()),
                        (anthropic.parse_count_request, ("max_tokens", "stream"))):
        after, first = (parse(json.dumps({k: v for k, v in b.items() if k not in drop}).encode())
                        for b in (body, before))
        for chat in (chat_proto, _count_chat):  # a reply's prompt, and count_tokens'
            names = [t["function"]["name"] for t in json.loads(chat(after).tools_json)]
            assert "ToolSearch" in names and "WebFetch" not in names
            assert "DeferredToolPlaceholder" not in names
            assert chat(after).tools_json == chat(first).tools_json
        assert [t["function"]["name"] for t in after.tools].count("WebFetch") == 1
    everything = {"model": "m", "max_tokens": 9, "messages": MSG, "tools": [
        {"name": "A", "defer_loading": True, "input_schema": {"type": "object"}}]}
    only = anthropic.parse_request(json.dumps(everything).encode())
    assert json.loads(chat_proto(only).tools_json)[0]["function"]["name"] == "A"
