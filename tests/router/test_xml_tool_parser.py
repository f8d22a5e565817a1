"""Qwen3.5-style XML tool calls back out of model text: a reference set of outputs, fed
whole (a reply that does not stream) and in every split down to one character a time."""

from __future__ import annotations

import json
import time

import pytest

from helexa.router.agent_output import OutputParser, Parts
from helexa.router.tool_parsers import whole_calls
from helexa.router.xml_tool_parser import convert

TOOLS = [
    {"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "count": {"type": "integer"},
                       "ratio": {"type": "number"}, "ok": {"type": "boolean"},
                       "data": {"type": "object"}, "items": {"type": "array"},
                       "nothing": {"type": "null"}, "note": {"type": ["string", "null"]},
                       "mode": {"$ref": "#/$defs/mode"}},
        "$defs": {"mode": {"enum": ["a", "w"]}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "free"}},
]


def call(name: str, *params: tuple[str, str]) -> str:
    """A call as Qwen3.5's template renders one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# (model text, content, [(name, arguments)])
REFERENCE = [
    ("Plain answer, no call.", "Plain answer, no call.", []),
    ("Let me look.\n\n" + call("write", ("path", "/tmp/a b.txt"), ("count", "3")),
     "Let me look.\n\n", [("write", {"path": "/tmp/a b.txt", "count": 3})]),
    # several calls, every type, a multi-line string with quotes and markup-like text
    (call("write", ("path", 'line 1\n  "line 2" <b>&</b>\n'), ("ratio", "2.5"), ("ok", "True"),
          ("data", '{"a": [1, {"b": null}], "c": "x</y"}'), ("items", "[1, \"two\", [3]]"),
          ("nothing", "None"), ("note", "null"), ("mode", "w"))
     + "\n" + call("ping") + "\n" + call("free", ("q", "42"), ("r", "hi")),
     "", [("write", {"path": 'line 1\n  "line 2" <b>&</b>\n', "ratio": 2.5, "ok": True,
                     "data": {"a": [1, {"b": None}], "c": "x</y"}, "items": [1, "two", [3]],
                     "nothing": None, "note": None, "mode": "w"}),
          ("ping", {}), ("free", {"q": 42, "r": "hi"})]),
    # JSON spellings, a value the type does not fit (kept as text), a key the schema lacks
    (call("write", ("path", "7"), ("ok", "false"), ("count", "many"), ("extra", "1")),
     "", [("write", {"path": "7", "ok": False, "count": "many", "extra": "1"})]),
    # Qwen3-Coder's compact spelling, and text after the call
    ("<tool_call><function=write><parameter=path>x</parameter></function></tool_call> done",
     " done", [("write", {"path": "x"})]),
    # not calls: a <tool_call> without <function=, and markup in plain text
    ("a <tool_call> not a call </tool_call> b, <function=x> c", "a <tool_call> not a call "
     "</tool_call> b, <function=x> c", []),
]


def run(text: str, step: int) -> Parts:
    """Feed step characters at a time (0: the whole reply at once, as one that did not
    stream), then finish; the parts collected."""
    p = OutputParser(tool_mode="qwen3_xml", tools=TOOLS)
    if not step:
        return p.finish(text)
    out = Parts()
    for got in [p.feed(text[i:i + step]) for i in range(0, len(text), step)] + [p.finish()]:
        out.content += got.content
        out.calls += got.calls
    return out


@pytest.mark.parametrize("step", [0, 1, 2, 3, 7, 1000])
@pytest.mark.parametrize("case", range(len(REFERENCE)))
def test_reference_outputs(case, step):
    text, content, calls = REFERENCE[case]
    out = run(text, step)
    assert out.content == content
    got = whole_calls(out.calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") for c in got) and len({c["id"] for c in got}) == \
        len(got)


TRUNCATED = "Checking.\n" + call("ping") + "\n<tool_call>\n<function=write>\n<parameter=path>\n/tm"


def test_a_call_cut_short_is_text_in_a_reply_that_did_not_stream():
    out = run(TRUNCATED, 0)
    assert out.content == "Checking.\n" + TRUNCATED[TRUNCATED.index("<tool_call>\n<function=w"):]
    assert [c["name"] for c in whole_calls(out.calls)] == ["ping"]
    # cut inside the first call, before its function was named: text, not lost
    assert run("Hm <tool_call>\n<funct", 1).content == "Hm <tool_call>\n<funct"


@pytest.mark.parametrize("step", [1, 3])
def test_a_streamed_call_cut_short_keeps_the_arguments_written_so_far(step):
    out = run(TRUNCATED, step)
    assert out.content == "Checking.\n"
    calls = whole_calls(out.calls)
    assert [c["name"] for c in calls] == ["ping", "write"]
    assert calls[1]["arguments"] == '{"path": "/tm'  # not JSON: the client sees length


def test_string_arguments_stream_as_written_and_others_when_they_close():
    p = OutputParser(tool_mode="qwen3_xml", tools=TOOLS)
    deltas = []
    for ch in call("write", ("path", "abcdef"), ("count", "12")):
        deltas += [q.arguments for q in p.feed(ch).calls if q.arguments]
    deltas += [q.arguments for q in p.finish().calls if q.arguments]
    assert deltas[0] == '{"path": "' and "".join(deltas[1:7]) == "abcdef" and len(deltas) >= 8
    assert ', "count": 12' in deltas and deltas[-1] == "}"
    assert json.loads("".join(deltas)) == {"path": "abcdef", "count": 12}


def test_a_thought_then_calls():
    p = OutputParser(reasoning_parser="think", tool_mode="qwen3_xml", tools=TOOLS)
    out = p.finish("<think>\nwhich file?\n</think>\n\n" + call("write", ("path", "f")))
    assert out.reasoning == "\nwhich file?\n" and out.content == ""
    assert json.loads(whole_calls(out.calls)[0]["arguments"]) == {"path": "f"}


@pytest.mark.parametrize("text,types,value", [
    ("3", {"integer"}, 3), ("3", {"number"}, 3), ("-2.5e3", {"number"}, -2500.0),
    ("True", {"boolean"}, True), ("FALSE", {"boolean"}, False), ("None", {"null"}, None),
    ("3", {"string"}, "3"), ("null", {"string", "null"}, None), ("x", {"string", "null"}, "x"),
    ('{"a": 1}', None, {"a": 1}), ("NaN", {"number"}, "NaN"), ("[1", {"array"}, "[1"),
])
def test_values_take_the_schema_types(text, types, value):
    assert convert(text, frozenset(types) if types is not None else None) == value


def test_stray_text_in_a_function_costs_in_proportion_to_its_length():
    """200,000 stray `<` inside a function were 1.6 s of CPU (each a step that copied the rest
    of the buffer), now 3 ms: the bound leaves a hundredfold room and is far under 1.6 s."""
    p = OutputParser(tool_mode="qwen3_xml", tools=TOOLS)
    t0 = time.thread_time()  # this thread's own CPU: other processes do not count
    out = p.finish("<tool_call>\n<function=ping>\n" + "<" * 200_000 + "\n</function>")
    secs = time.thread_time() - t0
    assert [(c["name"], c["arguments"]) for c in whole_calls(out.calls)] == [("ping", "{}")]
    assert secs < 0.3, f"took {secs:.2f} s of CPU"
