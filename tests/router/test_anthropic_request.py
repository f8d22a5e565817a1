"""Anthropic Messages request bodies: the 400s a client reads (router/anthropic.py)."""

from __future__ import annotations

import json

import pytest

from helexa.router import anthropic
from helexa.router.errors import ApiError

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
