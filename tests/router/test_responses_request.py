"""Responses API request bodies: the 400s a client reads (router/responses_api.py)."""

from __future__ import annotations

import json

import pytest
from support.agent_fixtures import fixture

from helexa.router import responses_api
from helexa.router.errors import ApiError


@pytest.mark.parametrize("arguments", ['{"a" 1', '{"a": 1} x', "[1]", "nope"])
def test_an_earlier_calls_arguments_that_are_no_object_name_the_item(arguments):
    # the router translates items to chat turns; the 400 must name the field the client
    # sent (input[i].arguments), not the translation's messages[j].tool_calls[k]...
    body = {"model": "m", "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}]}
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == "input[1].arguments"
    assert "`input[1].arguments`" in e.value.message


def test_a_tool_schema_error_names_the_tool_as_listed():
    # hosted tools are not offered and a namespace's functions are flattened: the 400
    # still names the tool where the client listed it
    bad = {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}
    body = {"model": "m", "input": "x", "tool_choice": "required", "tools": [
        {"type": "web_search"}, {"type": "function", "name": "a", "parameters": {}},
        {"type": "namespace", "name": "ns", "tools": [
            {"type": "function", "name": "b", "parameters": bad}]}]}
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(json.dumps(body).encode()).compile()
    assert e.value.param == "tools[2].tools[0].parameters"
    assert e.value.message.startswith("`tools[2].tools[0].parameters`")


PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
       "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@pytest.mark.parametrize("kind", ["function_call", "custom_tool_call"])
def test_a_tool_output_may_hold_an_image(kind):
    # codex's view_image (and an MCP tool returning a screenshot) answers with input_image
    # parts in the call's output; the tool turn takes them as a user turn does
    call = {"type": kind, "call_id": "c1", "name": "look",
            **({"arguments": "{}"} if kind == "function_call" else {"input": "a.png"})}
    body = {"model": "m", "input": [
        {"role": "user", "content": "look"}, call,
        {"type": f"{kind}_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "a.png:"},
            {"type": "input_image", "image_url": PNG, "detail": "high"}]}]}
    tool = responses_api.parse_request(json.dumps(body).encode()).messages[-1]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "c1", "a.png:")
    assert tool.parts is not None and tool.parts[0] == "a.png:" and len(tool.parts) == 2
    body["input"][2]["output"][1] = {"type": "input_file", "file_id": "f"}
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(json.dumps(body).encode())
    assert e.value.param == "input[2].output[1].type"


def _refusal(**fields) -> ApiError:
    raw = json.dumps({"model": "m", "input": "hi", **fields}).encode()
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(raw)
    return e.value


@pytest.mark.parametrize("fields,param,says", [
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "length <= 16"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "a key of `metadata`"),
    ({"metadata": {"k": "v" * 513}}, "metadata[...]", "length <= 512"),
    ({"metadata": {"k": 1}}, "metadata[...]", "expected str"),
    ({"user": "u" * (responses_api.MAX_USER_CHARS + 1)}, "user", "length <= 256")])
def test_what_every_response_object_echoes_is_bounded_as_openai_bounds_it(fields, param, says):
    """`metadata` and `user` come back in each streamed response object: a megabyte of each
    made a 30-token stream 6 MB. Past OpenAI's bounds they are a 400 naming the field."""
    e = _refusal(**fields)
    assert (e.status, e.param) == (400, param) and says in e.message, e.message


@pytest.mark.parametrize("fields,param,says", [
    ({"store": "yes"}, "store", "expected bool"),
    ({"truncation": "sometimes"}, "truncation", "invalid value 'sometimes'"),
    ({"prompt_cache_retention": 3}, "prompt_cache_retention", "expected str")])
def test_fields_that_change_nothing_are_still_typed_as_openai_types_them(fields, param, says):
    """`store: "yes"` was a 200 (the field was Any); OpenAI answers it with a 400."""
    e = _refusal(**fields)
    assert (e.status, e.param) == (400, param) and says in e.message, e.message
    for ok in ({"store": True}, {"truncation": "auto"}, {"prompt_cache_retention": "24h"}):
        responses_api.parse_request(json.dumps({"model": "m", "input": "hi", **ok}).encode())


def test_metadata_and_user_within_the_bounds_are_echoed_as_sent():
    meta = {f"k{i}": "v" * 512 for i in range(16)}
    req = responses_api.parse_request(json.dumps(
        {"model": "m", "input": "hi", "metadata": meta, "user": "u" * 256}).encode())
    assert req.echoed["metadata"] == meta and req.echoed["user"] == "u" * 256
    bare = responses_api.parse_request(b'{"model": "m", "input": "hi", "metadata": null}')
    assert bare.echoed["metadata"] == {} and bare.echoed["user"] is None


def _prompt(raw: dict) -> list[tuple[str, str]]:
    return [(t.role, t.content) for t in responses_api.parse_request(json.dumps(raw).encode())
            .messages or []]


def test_a_later_developer_message_stands_where_it_was_sent_and_keeps_the_prompt_before():
    """codex's opening developer messages make the system turn; one it sends mid-session (new
    permissions, a changed mode) stands where it was sent, so the prompt before it is the
    previous request's and the prefix cache holds it. Joined to the system prompt at the
    start, it changed the first tokens and the whole session was prefilled again."""
    first = fixture("codex-2")["body"]
    later = {**first, "input": [
        *first["input"], {"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": "Listed."}]},
        {"type": "message", "role": "developer", "content": "Approvals are now on-request."},
        {"type": "message", "role": "user", "content": "now read it"}]}
    a, b = _prompt(first), _prompt(later)
    assert b[:len(a)] == a
    assert b[len(a):] == [("assistant", "Listed."),
                          ("system", "Approvals are now on-request."), ("user", "now read it")]


def test_a_system_message_between_calls_and_their_outputs_waits_for_the_outputs():
    body = {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"role": "developer", "content": "be brief"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
    assert [r for r, _ in _prompt(body)] == ["user", "assistant", "tool", "system"]
    assert _prompt(body)[-1] == ("system", "be brief")
    # with the reply's text between the call and the message (as codex echoes a reply)
    body["input"].insert(2, {"role": "assistant",
                             "content": [{"type": "output_text", "text": "Reading."}]})
    assert [r for r, _ in _prompt(body)] == ["user", "assistant", "assistant", "tool", "system"]


def test_a_developer_message_after_an_output_stays_put_as_the_tool_loop_goes_on():
    """Request k ends with a call's output and a developer message; request k+1 goes on
    with another call: the message stands where it was in both (it moved past the next call
    and its output, so each step of the loop was prefilled again from there)."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    k = [{"role": "user", "content": "go"},
         {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "a", "output": "1"},
         {"role": "developer", "content": "be brief"}]
    k1 = [*k, {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
          {"type": "function_call_output", "call_id": "b", "output": "2"}]
    first, then = (_prompt({"model": "m", "input": x, "tools": tools}) for x in (k, k1))
    assert then[:len(first)] == first
    assert [r for r, _ in then] == ["user", "assistant", "tool", "system", "assistant", "tool"]
