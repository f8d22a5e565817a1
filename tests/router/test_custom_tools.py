"""The Responses API's `custom` tools: how they reach the template, how a call comes back, and
the grammar a forced call follows (router/custom_tools.py, helexa/tool_grammar.py)."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helexa import grammar, tool_grammar
from helexa.neuron import agent
from helexa.proto import neuron_pb2 as pb
from helexa.router import custom_tools, responses_api
from helexa.router.agent_output import parser_for
from helexa.router.errors import ApiError
from helexa.router.responses_encode import ResponseEncoder

LARK = 'start: "+" WORD "\\n" "+" WORD\nWORD: /[a-z]{1,5}/\n'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
         "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
CODE = {"type": "custom", "name": "code",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+-[a-z]+"}}
NOTE = {"type": "custom", "name": "note"}


def parse(**body):
    """Parsed, then its grammars compiled (the router runs the two on its two pools)."""
    return responses_api.parse_request(json.dumps({"model": "m", "input": "x",
                                                   **body}).encode()).compile()


def test_a_custom_tool_reaches_the_template_as_a_function_of_one_string():
    req = parse(tools=[{"type": "web_search"}, NOTE, CODE, PATCH])
    fns = {t["function"]["name"]: t["function"] for t in req.tools}
    assert list(fns) == ["note", "code", "apply_patch"]  # hosted tools still are not offered
    for fn in fns.values():
        assert fn["parameters"]["required"] == ["input"]
        assert fn["parameters"]["properties"]["input"]["type"] == "string"
    assert fns["code"]["parameters"]["properties"]["input"]["pattern"] == "^(?:[0-9]+-[a-z]+)$"
    lark = fns["apply_patch"]["parameters"]["properties"]["input"]
    assert LARK in lark["description"] and lark[tool_grammar.LARK_KEY] == LARK
    assert set(req.custom_tools) == {"note", "code", "apply_patch"}
    # the router's key is not the model's to read: the template gets the description only
    shown = tool_grammar.for_template(req.tools)
    assert tool_grammar.LARK_KEY not in json.dumps(shown)
    assert LARK in shown[2]["function"]["parameters"]["properties"]["input"]["description"]
    assert shown[:2] == req.tools[:2] and tool_grammar.LARK_KEY in json.dumps(req.tools)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
                   tools_json=json.dumps(req.tools))
    assert tool_grammar.LARK_KEY not in json.dumps(agent.template_inputs(chat, "")[1]["tools"])


def test_a_named_custom_choice_forces_that_tool():
    req = parse(tools=[NOTE, CODE], tool_choice={"type": "custom", "name": "code"})
    assert (req.tool_choice, req.tool_name) == ("function", "code")
    assert "^(?:[0-9]+-[a-z]+)$" in req.constraint.source
    fn = {"type": "function", "name": "fn", "parameters": {"type": "object"}}
    with pytest.raises(ApiError) as e:  # a function named as a custom tool: not that kind
        parse(tools=[fn, CODE], tool_choice={"type": "custom", "name": "fn"})
    assert e.value.param == "tool_choice" and "listed as a function" in e.value.message


@pytest.mark.parametrize("tool,param", [
    ({"type": "custom"}, "tools[0].name"),
    ({"type": "custom", "name": "t", "format": {"type": "json"}}, "tools[0].format.type"),
    ({"type": "custom", "name": "t", "format": "lark"}, "tools[0].format"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf",
                                                "definition": "x"}}, "tools[0].format.syntax"),
    # not a string: it was a 500 (a list is unhashable)
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": ["lark"],
                                                "definition": "x"}}, "tools[0].format.syntax"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": {"lark": 1},
                                                "definition": "x"}}, "tools[0].format.syntax"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "lark"}},
     "tools[0].format.definition"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "lark",
                                                "definition": "start: nowhere"}},
     "tools[0].format.definition"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "regex",
                                                "definition": "(a"}},
     "tools[0].format.definition"),
])
def test_a_bad_custom_tool_is_a_400_naming_the_field(tool, param):
    with pytest.raises(ApiError) as e:
        parse(tools=[tool])
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(f"`{param}`")


def test_custom_calls_and_outputs_in_input_are_the_calls_and_tool_turns():
    req = parse(tools=[PATCH], input=[
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch",
         "input": "+a\n+b", "id": "ctc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"}])
    user, assistant, out1, out2 = req.messages
    calls = json.loads(assistant.tool_calls_json)
    assert [c["function"]["name"] for c in calls] == ["apply_patch", "f"]  # one turn
    assert json.loads(calls[0]["function"]["arguments"]) == {"input": "+a\n+b"}
    assert (out1.role, out1.tool_call_id, out1.content) == ("tool", "c1", "done")
    assert (out2.role, out2.tool_call_id) == ("tool", "c2")
    with pytest.raises(ApiError) as e:
        parse(input=[{"type": "custom_tool_call", "call_id": "c", "input": "x"}])
    assert e.value.param == "input[0]"


@pytest.mark.parametrize("args,want", [
    ('{"input": "a\\nb"}', "a\nb"), ('{"text": "solo"}', "solo"), ('{"a": 1}', '{"a": 1}'),
    ('{"input": "cut \\u00e9 sh', "cut é sh"), ("nonsense", "nonsense"),
    ('"*** Begin Patch\\n"', "*** Begin Patch\n"), ('"freefo', "freefo"),
    ('{"input":', ""), ('{ "inp', ""),  # cut before the input opened: none of it
    ("[" * 2000 + "]" * 2000, "[" * 2000 + "]" * 2000)])  # past json.loads' recursion: text
def test_a_calls_arguments_as_the_input(args, want):
    assert custom_tools.input_of(args) == want


def test_the_input_decodes_as_it_streams_never_splitting_an_escape():
    text = '{"input": "a\\n\\u00e9\\ud83d\\ude00"}'
    seen = [custom_tools.partial_input(text[:i]) for i in range(len(text) + 1)]
    assert seen[:10] == [None] * 10 and seen[-1] == "a\né😀"
    grown = [s for s in seen if s is not None]
    assert all(b.startswith(a) for a, b in zip(grown, grown[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(1, 12), min_size=1, max_size=40), st.booleans(),
       st.booleans())
def test_streamed_in_any_pieces_the_input_decodes_to_what_was_written(text, cuts, bare, ascii_):
    """Each piece of the arguments adds exactly what it decodes to, whatever the split, with
    escapes (\\uXXXX and surrogate pairs when ascii_) held until they are whole."""
    body = json.dumps(text, ensure_ascii=ascii_)
    args = body if bare else '{ "input" : ' + body + "}"
    decoding, i, out = custom_tools.PartialInput(), 0, []
    while i < len(args):
        step = cuts[len(out) % len(cuts)]
        out.append(decoding.feed(args[i:i + step]))
        assert text.startswith(decoding.decoded())
        i += step
    assert "".join(out) == decoding.decoded() == text
    assert decoding.text == args and custom_tools.input_of(decoding.text) == text


def test_arguments_of_another_shape_decode_to_nothing():
    for args in ('{"inputs": "x"}', '{"a": "input"}', "[1]", '{"input" "x"}', '{"in put": "'):
        decoding = custom_tools.PartialInput()
        assert [decoding.feed(c) for c in args] == [""] * len(args)
        assert custom_tools.partial_input(args) is None


def _run(req, text: str, step: int) -> tuple[dict, list[dict]]:
    enc = ResponseEncoder("resp_1", "m", req, parser_for(req, "hermes", ""))
    raw = enc.start()
    for i in range(0, len(text), step):
        raw += enc.feed(pb.GenerateResponse(text=text[i:i + step]))
    raw += enc.feed(pb.GenerateResponse(finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage()))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ")]
    return events[-1]["response"], events


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("args,want", [
    ('{"input": "12-ab\\"c"}', '12-ab"c'), ('"12-ab\\"c"', '12-ab"c'),  # freeform too
    # a newline written raw inside the string, as models do, which strict JSON refuses: the
    # input was the arguments' JSON (codex would apply a patch wrapped in JSON), or text
    ('{"input": "12-a\nb"}', "12-a\nb")])
def test_a_custom_call_is_a_custom_tool_call_item_whole_and_streamed(step, args, want):
    req = parse(tools=[CODE, PATCH], tool_choice={"type": "custom", "name": "code"})
    text = '<tool_call>\n{"name": "code", "arguments": ' + args + '}\n</tool_call>'
    enc = ResponseEncoder("resp_1", "m", req, parser_for(req, "hermes", ""))
    whole = enc.whole(pb.GenerateResponse(text=text, finish_reason=pb.FINISH_REASON_STOP,
                                          usage=pb.Usage()))
    final, events = _run(req, text, step)
    for r in (whole, final):
        (item,) = r["output"]
        assert {k: item[k] for k in ("type", "name", "input")} == {
            "type": "custom_tool_call", "name": "code", "input": want}
        assert r["tool_choice"] == {"type": "custom", "name": "code"}
        assert r["tools"][1] == {**PATCH, "description": "Edit files"}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.custom_tool_call_input.done") < kinds.index("response.output_item.done")
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == want and all(deltas)


def _accepts(c: grammar.Constraint, text: str) -> bool:
    m = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar.grammar_text(c),
                             log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def test_a_forced_xml_call_holds_the_raw_input_to_the_lark_grammar():
    req = parse(tools=[PATCH, CODE], tool_choice="required")
    c = tool_grammar.forced("qwen3_xml", req.tools, "", False)
    call = "<tool_call>\n<function={}>\n<parameter=input>\n{}\n</parameter>\n</function>\n" \
           "</tool_call>"
    assert _accepts(c, call.format("apply_patch", "+ab\n+c"))
    assert not _accepts(c, call.format("apply_patch", "+ab\n+c\n+d"))
    assert _accepts(c, call.format("code", "7-x"))
    assert not _accepts(c, call.format("code", "7-x7"))
    # JSON formats: a regex holds (pattern); a Lark grammar cannot, the string is free
    h = tool_grammar.forced("hermes", req.tools, "", False)
    head = '<tool_call>\n{"name": "%s", "arguments": {"input": %s}}\n</tool_call>'
    assert _accepts(h, head % ("code", '"7-x"')) and not _accepts(h, head % ("code", '"7"'))
    assert _accepts(h, head % ("apply_patch", '"anything"'))
