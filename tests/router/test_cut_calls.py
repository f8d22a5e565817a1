"""An earlier tool call cut short by max_tokens, sent back as received (router/cut_calls.py):
read as the object it began, never a crash; what is no start of a JSON object is a 400."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helexa.router import responses_api
from helexa.router.cut_calls import repair
from helexa.router.errors import ApiError
from helexa.router.json_depth import MAX_JSON_DEPTH
from helexa.router.openai_api import parse_request

PROPERTY = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# Short strings (every prefix of the text is read: the cost is its length squared), with
# escapes, surrogate pairs and control characters among their characters.
TEXT = st.text(max_size=6)
SCALARS = st.none() | st.booleans() | st.integers() | \
    st.floats(allow_nan=False, allow_infinity=False) | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
OBJECTS = st.dictionaries(TEXT, VALUES, max_size=4)
# Ways clients write JSON: Python's default, compact, indented, raw non-ASCII.
DUMPS = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1},
                         {"ensure_ascii": False}])


def cut_of(got: Any, whole: Any) -> bool:
    """got is what a prefix of whole's text began: its complete parts equal whole's, the last
    one (where the text ended) a cut of whole's."""
    if isinstance(whole, dict):
        keys = list(whole)[:len(got)] if isinstance(got, dict) else None
        return keys == list(got) and all(got[k] == whole[k] for k in keys[:-1]) and \
            (not keys or cut_of(got[keys[-1]], whole[keys[-1]]))
    if isinstance(whole, list):
        return isinstance(got, list) and len(got) <= len(whole) and (not got or (
            got[:-1] == whole[:len(got) - 1] and cut_of(got[-1], whole[len(got) - 1])))
    if isinstance(whole, str):
        return isinstance(got, str) and whole.startswith(got)
    if isinstance(whole, int | float) and not isinstance(whole, bool):
        return isinstance(got, int | float) and not isinstance(got, bool)  # `12` of `123`
    return got == whole


@PROPERTY
@given(OBJECTS, DUMPS)
def test_every_prefix_of_an_object_reads_as_a_cut_of_it(obj, how):
    text = json.dumps(obj, **how)
    for n in range(len(text)):
        got = repair(text[:n])
        if not text[:n].strip():
            assert got is None  # blank: the caller reads it as no arguments
            continue
        assert got is not None, text[:n]
        assert cut_of(got, obj), (text[:n], got)
        assert json.loads(json.dumps(got)) == got  # what the neuron gets back, the same
    assert repair(text) is None  # whole: json.loads reads it, nothing to repair


@PROPERTY
@given(st.text(alphabet='{}[]":, \n-+.0123456789eEtrufalsn\\xq\u00b2\u0661', max_size=40))
def test_any_text_reads_as_an_object_or_nothing_and_never_raises(text):
    got = repair(text)
    assert got is None or (isinstance(got, dict) and json.loads(json.dumps(got)) == got)
    if got is not None:
        with pytest.raises(ValueError):
            json.loads(text)  # only text json.loads refuses is ever repaired


@PROPERTY
@given(OBJECTS, st.text(min_size=1).filter(lambda t: t.strip() != ""))
def test_a_whole_object_with_more_after_it_is_refused(obj, more):
    assert repair(json.dumps(obj) + more) is None


@pytest.mark.parametrize("text,want", [
    ('{"path": "src/ma', {"path": "src/ma"}),  # a cut string: the part received
    ('{"a": 1, "b', {"a": 1}),  # a cut key: dropped
    ('{"a": 1, "b": ', {"a": 1}),  # a key without its value: dropped
    ('{"a": 12', {"a": 12}),  # digits that are a number: kept
    ('{"a": 1, "b": -', {"a": 1}), ('{"a": 1.', {}), ('{"a": 2e+', {}),  # not yet a number
    ('{"a": tru', {}), ('{"a": [true, nul', {"a": [True]}),
    ('{"a": "x\\', {"a": "x"}), ('{"a": "x\\u00', {"a": "x"}),  # a cut escape
    ('{"a": "x\\ud83d', {"a": "x"}), ('{"a": "x\\ud83d\\ude0', {"a": "x"}),  # half a pair
    ('{"a": "x\\\\', {"a": "x\\"}),  # an escaped backslash is whole
    ('{"a": [1, {"b": "c', {"a": [1, {"b": "c"}]}), ('{"a": {}, "b": [', {"a": {}, "b": []}),
    ('{', {}), (' { "a" : [ 1 , ', {"a": [1]}),
])
def test_cut_text_reads_as_the_object_it_began(text, want):
    assert repair(text) == want


@pytest.mark.parametrize("text", [
    "[1,2]", "[1, 2", '"hello"', '"hel', "3", "nope", "",  # no object
    '{"a" 1}', '{"a": 1 2', '{"a": "b"c', '{"a": 1.5.', '{"a": 01', '{"a": trux',
    '{"a": 1,}', '{"a": [1, ]', '{,', '{"a": "x\\q', '{"a": "x\ny',  # garbage within
    '{"a": 1} x', '{"a": 1}}', '{}{', '{"a": NaN',  # more after a whole object
    '{"a": ' * (MAX_JSON_DEPTH + 1),  # past the depth limit
    '{"a": \u00b2', '{"a": \u0661}', '{"a": [1, \u0663',  # digits str.isdigit() takes
])
def test_text_that_is_no_start_of_an_object_is_refused(text):
    assert repair(text) is None


def chat_history(*arguments: str) -> list[dict]:
    return [{"role": "user", "content": "read it"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "read", "arguments": a}} for i, a in enumerate(arguments)]},
            *({"role": "tool", "tool_call_id": f"c{i}", "content": "error: bad JSON arguments"}
              for i in range(len(arguments)))]


def test_a_chat_history_with_a_cut_call_is_served_and_says_which_call():
    r = parse_request({"model": "m", "messages": chat_history('{"n": 1}', '{"path": "src/ma')},
                      "chat")
    calls = json.loads(r.messages[1].tool_calls_json)
    assert [c["function"]["arguments"] for c in calls] == ['{"n": 1}', '{"path": "src/ma"}']
    assert r.repaired_calls == ["messages[1].tool_calls[1].function.arguments"]
    assert parse_request({"model": "m", "messages": chat_history('{"n": 1}')},
                         "chat").repaired_calls == []


@pytest.mark.parametrize("arguments", ['{"a" 1}', '{"a": 1} x', "[1, 2"])
def test_a_chat_history_call_that_is_no_start_of_an_object_is_a_400(arguments):
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": chat_history("{}", arguments)}, "chat")
    assert e.value.status == 400
    assert e.value.param == "messages[1].tool_calls[1].function.arguments"
    assert "JSON object" in e.value.message


def nested(depth: int, cut: bool = False) -> str:
    return '{"a":' * depth + "1" + ("" if cut else "}" * depth)


@pytest.mark.parametrize("arguments", [nested(MAX_JSON_DEPTH + 1), nested(300), nested(2000),
                                       nested(MAX_JSON_DEPTH + 1, cut=True), "{" * 5000])
def test_call_arguments_nested_past_the_depth_limit_are_a_400_naming_it(arguments):
    # whole or cut: not "must be a JSON object" (a RecursionError taken for a cut) nor the
    # template's recursion failing at the neuron
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": chat_history("{}", arguments)}, "chat")
    assert e.value.status == 400
    assert e.value.param == "messages[1].tool_calls[1].function.arguments"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in e.value.message
    body = {"model": "m", "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c", "output": "error"}]}
    with pytest.raises(ApiError) as e:
        responses_api.parse_request(json.dumps(body).encode())
    assert e.value.param == "input[1].arguments" and "deeper than" in e.value.message


def test_call_arguments_at_the_depth_limit_are_served():
    r = parse_request({"model": "m", "messages": chat_history(nested(MAX_JSON_DEPTH))}, "chat")
    [call] = json.loads(r.messages[1].tool_calls_json)
    assert call["function"]["arguments"] == nested(MAX_JSON_DEPTH)


def test_a_responses_function_call_cut_short_is_served_and_says_which_item():
    body = {"model": "m", "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": [1, "b'},
        {"type": "function_call_output", "call_id": "c", "output": "error"}]}
    r = responses_api.parse_request(json.dumps(body).encode())
    [call] = json.loads(r.messages[1].tool_calls_json)
    assert json.loads(call["function"]["arguments"]) == {"a": [1, "b"]}
    assert r.repaired_calls == ["input[1].arguments"]
