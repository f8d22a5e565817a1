"""The per-request caps (limits.max_tools, max_schema_bytes, max_pattern_chars), checked before
any schema is compiled on every front end, and schemas no finite output satisfies: each a 400
naming what is wrong."""

from __future__ import annotations

import json

import pytest

from helexa.router import anthropic, responses_api
from helexa.router.errors import ApiError
from helexa.router.openai_api import parse_request
from helexa.router.request_caps import RequestCaps, longest_pattern

MSG = [{"role": "user", "content": "hi"}]
CAPS = RequestCaps(max_tools=4, max_schema_bytes=2048, max_pattern_chars=32)
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def tool(i: int, params: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": f"t{i}", "parameters": params or {
        "type": "object", "properties": {"x": {"type": "string"}}}}}


def refused(body: dict, caps: RequestCaps = CAPS) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(json.dumps({"model": "m", "messages": MSG, **body}).encode(), "chat",
                      caps).compile()
    assert e.value.status == 400
    return e.value


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}


def test_each_cap_is_a_400_naming_it_and_at_the_cap_passes():
    parse_request({"model": "m", "messages": MSG, "tools": [tool(i) for i in range(4)]},
                  "chat", CAPS)
    e = refused({"tools": [tool(i) for i in range(5)]})
    assert "5 tools is more than 4" in e.message and "limits.max_tools" in e.message
    big = {"type": "object", "description": "d" * 3000}
    e = refused({"tools": [tool(0, big)]})
    assert "limits.max_schema_bytes" in e.message and e.param == "tools[0].function.parameters"
    # the tools' schemas count together: two of 1.2 KB are over 2 KB
    half = {"type": "object", "description": "d" * 1200}
    assert "limits.max_schema_bytes" in refused({"tools": [tool(0, half), tool(1, half)]}).message
    e = refused(schema_format({"type": "object", "properties": {"s": {
        "type": "string", "pattern": "a" * 33}}}))
    assert "33 characters is longer than 32" in e.message and "limits.max_pattern_chars" in \
        e.message and e.param == "response_format.json_schema.schema.properties.s.pattern"
    e = refused(schema_format({"type": "object", "patternProperties": {"b" * 40: {}}}))
    assert "limits.max_pattern_chars" in e.message


def test_the_caps_hold_on_messages_and_responses_too():
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(5)]
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps({"model": "m", "max_tokens": 4, "messages": MSG,
                                            "tools": tools}).encode(), CAPS)
    assert "limits.max_tools" in e.value.message
    with pytest.raises(ApiError) as e:
        anthropic.parse_count_request(json.dumps({"model": "m", "messages": MSG,
                                                  "tools": tools}).encode(), CAPS)
    assert "limits.max_tools" in e.value.message
    fns = [{"type": "function", "name": f"t{i}", "parameters": {"type": "object"}}
           for i in range(5)]
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(json.dumps({"model": "m", "input": "hi",
                                                "tools": fns}).encode(), CAPS)
    assert "limits.max_tools" in e.value.message


def test_longest_pattern_finds_it_at_any_depth_without_recursion():
    deep: dict = {"type": "string", "pattern": "x" * 7}
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = {"items": deep}
    assert longest_pattern(deep)[1] == 7
    assert longest_pattern({"anyOf": [{"pattern": "ab"}, {"pattern": "abc"}]}) == (
        ".anyOf[1].pattern", 3)


def test_a_schema_no_finite_value_satisfies_is_a_400_not_a_failed_generation():
    e = refused(schema_format(ENDLESS))
    assert "no finite value satisfies it" in e.message
    e = refused({"tools": [tool(0, ENDLESS)], "tool_choice": "required"})
    assert "no finite value satisfies it" in e.message
    assert e.param == "tools[0].function.parameters"
    e = refused(schema_format({"not": {}}))
    assert "allows no value at all" in e.message
    # the same recursion, optional: finite values exist, so it is served
    parse_request({"model": "m", "messages": MSG, **schema_format(
        {"type": "object", "properties": {"a": {"$ref": "#"}}})}, "chat")
    # `not {}` below the root forbids an optional key: served
    parse_request({"model": "m", "messages": MSG, **schema_format(
        {"type": "object", "properties": {"a": {"not": {}}}})}, "chat")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"anyOf": [{"$ref": "#"}]}])
def test_a_schema_whose_references_lead_only_to_each_other_is_a_400(schema):
    """It compiles, but nothing it allows can be written: served, it was a 200 with empty
    content and finish_reason stop, not JSON at all."""
    e = refused(schema_format(schema))
    assert e.status == 400 and "no value satisfies it" in e.message, e.message
    assert e.param == "response_format.json_schema.schema"
