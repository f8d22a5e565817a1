"""The agent fields of a chat request: what they become, and the 400 naming the param."""

from __future__ import annotations

import json

import pytest

from helexa.router.errors import ApiError
from helexa.router.openai_api import parse_request

MSG = [{"role": "user", "content": "hi"}]
F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}


def chat(**kw):
    """Parsed, then its grammars compiled (the router runs the two on its two pools)."""
    return parse_request({"model": "m", "messages": MSG, **kw}, "chat").compile()


def refused(**kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat(**kw)
    assert e.value.status == 400
    return e.value


def test_tool_choice_modes_and_the_constraint_they_make():
    assert chat(tools=[F]).tool_choice == "auto" and chat(tools=[F]).constraint is None
    assert chat().tool_choice == "none"
    r = chat(tools=[F, G], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(r.constraint.source)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["f", "g"]
    r = chat(tools=[F, G], tool_choice={"type": "function", "function": {"name": "f"}})
    assert (r.tool_choice, r.tool_name) == ("function", "f")
    # the function's parameters, no key beyond those it lists (helexa.grammar.strict)
    assert json.loads(r.constraint.source) == {**F["function"]["parameters"],
                                               "additionalProperties": False}


@pytest.mark.parametrize("kw,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [F, F]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    # a schema wrong in itself is refused where it must compile: under a forced choice
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strnig"}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
    ({"tools": [F], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_agent_fields_name_the_param(kw, param):
    assert refused(**kw).param == param


def test_messages_with_tool_calls_and_results():
    r = parse_request({"model": "m", "messages": [
        *MSG, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]}, "chat")
    assert json.loads(r.messages[1].tool_calls_json)[0]["function"]["name"] == "f"
    assert (r.messages[2].role, r.messages[2].tool_call_id) == ("tool", "c1")
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": [{"role": "tool", "content": "2"}]}, "chat")
    assert e.value.param == "messages[0].tool_call_id"


def test_reasoning_fields():
    assert chat(reasoning_effort="minimal").reasoning_effort == "low"
    assert chat(reasoning_effort="high").reasoning_effort == "high"
    assert chat(chat_template_kwargs={"enable_thinking": True}).template_kwargs == {
        "enable_thinking": True}


@pytest.mark.parametrize("arguments", ["[1]", "nope", "3"])
def test_earlier_call_arguments_must_be_a_json_object(arguments):
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "f", "arguments": arguments}}]
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": [*MSG, {"role": "assistant",
                                                         "tool_calls": calls}]}, "chat")
    assert e.value.status == 400
    assert e.value.param == "messages[1].tool_calls[1].function.arguments"


def test_a_forced_choice_goes_to_the_neuron_as_a_tool_choice():
    from helexa.router.forward import generate_request

    def sent(**kw):
        return generate_request(chat(**kw), model="m", principal="p", req_id="r",
                                deadline_unix_ms=0)

    g = sent(tools=[F, G], tool_choice="required", parallel_tool_calls=False)
    assert g.constraint.WhichOneof("kind") == "tool_choice"
    assert (g.constraint.tool_choice.function, g.constraint.tool_choice.parallel) == ("", False)
    g = sent(tools=[F], tool_choice={"type": "function", "function": {"name": "f"}})
    assert g.constraint.tool_choice.function == "f"
    assert not sent(tools=[F]).HasField("constraint")


# Keywords real agents' tool schemas carry that the grammar library cannot compile.
AGENT_SCHEMA = {"type": "object", "required": ["tags"], "properties": {
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "blob": {"type": "string", "format": "binary"},
    "n": {"type": "integer", "format": "int64"},
    "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
            "additionalProperties": {"type": "string"}},
    "mode": {"type": "string", "not": {"const": "rm"}},
    "list": {"type": "array", "contains": {"const": "a"}}},
    "if": {"required": ["mode"]}, "then": {"required": ["n"]},
    "dependentRequired": {"blob": ["n"]}, "unevaluatedProperties": False}
AGENT = {"type": "function", "function": {"name": "agent", "parameters": AGENT_SCHEMA}}


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_a_schema_is_prompt_text_under_auto_and_none(choice):
    # even one that is wrong in itself: nothing compiles it, so nothing can refuse it
    bad = {"type": "function", "function": {"name": "b", "parameters": {"type": "strnig"}}}
    r = chat(tools=[AGENT, bad], tool_choice=choice)
    assert r.constraint is None and r.unenforced == []
    assert r.tools[0]["function"]["parameters"] == AGENT_SCHEMA  # the template sees it whole


def test_a_forced_choice_drops_what_the_grammar_cannot_enforce_and_lists_it():
    r = chat(tools=[AGENT], tool_choice="required")
    dropped = " ".join(r.unenforced)
    for kw in ("uniqueItems", "format binary", "propertyNames", "not", "contains", "if", "then",
               "dependentRequired", "unevaluatedProperties"):
        assert kw in dropped, kw
    assert "tools[0].function.parameters.properties.tags: uniqueItems" in r.unenforced
    schema = json.loads(r.constraint.source)
    args = schema["items"]["anyOf"][0]["properties"]["arguments"]
    assert args["required"] == ["tags"] and "uniqueItems" not in args["properties"]["tags"]
    assert args["properties"]["n"]["format"] == "int64"  # what it does enforce stays
    named = chat(tools=[AGENT, F], tool_choice={"type": "function",
                                               "function": {"name": "agent"}})
    assert named.unenforced and "not" not in json.loads(named.constraint.source)["properties"][
        "mode"]


def test_the_reply_is_checked_against_the_whole_schema():
    from helexa.router.agent_request import reply_violations

    r = chat(tools=[AGENT], tool_choice="required")
    ok = json.dumps({"tags": ["a", "b"], "mode": "ls", "n": 1})
    assert reply_violations(r, "", [{"name": "agent", "arguments": ok}]) == []
    bad = json.dumps({"tags": ["a", "a"], "mode": "rm", "env": {"lower": "x"}})
    found = reply_violations(r, "", [{"name": "agent", "arguments": bad}])
    assert any("not unique" in v for v in found) and any("`not`" in v for v in found)
    assert any("(name)" in v for v in found) and any("`n` is required" in v for v in found)
    fmt = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": AGENT_SCHEMA}})
    assert fmt.unenforced and reply_violations(fmt, bad, []) != []
    assert reply_violations(fmt, ok, []) == []


def test_a_forced_choice_of_a_function_whose_arguments_are_no_object_is_a_400():
    s = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    for choice in ("required", {"type": "function", "function": {"name": "s"}}):
        e = refused(tools=[s], tool_choice=choice)
        assert e.param == "tools[0].function.parameters" and "object" in e.message
    assert chat(tools=[s]).tool_choice == "auto"  # under auto the schema is prompt text only
    loose = {"type": "function", "function": {"name": "l", "parameters": {
        "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    assert chat(tools=[loose], tool_choice="required").constraint is not None
