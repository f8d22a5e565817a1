"""Model text back into thought, answer and tool calls, fed whole or in any split."""

from __future__ import annotations

import json

import pytest

from helexa.router.agent_output import OutputParser, Parts
from helexa.router.tool_parsers import whole_calls


class Out(Parts):
    @property
    def whole(self) -> list[dict]:
        return whole_calls(self.calls)


def run(p: OutputParser, text: str, step: int) -> Out:
    out = Out()
    pieces = [text[i:i + step] for i in range(0, len(text), step)] if step else [text]
    for piece in pieces:
        got = p.feed(piece)
        out.reasoning += got.reasoning
        out.content += got.content
        out.calls += got.calls
    got = p.finish()
    return Out(out.reasoning + got.reasoning, out.content + got.content, out.calls + got.calls)


STEPS = [0, 1, 2, 3, 7]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_calls_between_text(step):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    out = run(OutputParser(tool_mode="hermes"), text, step)
    assert out.content == "Let me check.\n"
    assert [c["name"] for c in out.whole] == ["get_weather", "get_time"]
    assert json.loads(out.whole[0]["arguments"]) == {"city": "Paris"}
    assert len({c["id"] for c in out.whole}) == 2


@pytest.mark.parametrize("step", STEPS)
def test_broken_hermes_call_stays_text(step):
    text = "a <tool_call>not json</tool_call> b <tool_ca"
    out = run(OutputParser(tool_mode="hermes"), text, step)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_call_and_plain_text(step):
    out = run(OutputParser(tool_mode="llama3_json"),
              '{"name": "f", "parameters": {"x": 1}}', step)
    assert out.whole[0]["name"] == "f" and json.loads(out.whole[0]["arguments"]) == {"x": 1}
    out = run(OutputParser(tool_mode="llama3_json"), "Hello {there}", step)
    assert out.calls == [] and out.content == "Hello {there}"


@pytest.mark.parametrize("step", STEPS)
def test_think_split_with_and_without_an_opened_prompt(step):
    out = run(OutputParser(reasoning_parser="think"), "<think>\nhmm, 2+2</think>\n\n4", step)
    assert (out.reasoning, out.content) == ("\nhmm, 2+2", "4")
    opened = OutputParser(reasoning_parser="think")
    opened.thought_opened()  # the neuron said the prompt opened the thought
    out = run(opened, "hmm</think>\n\nfour", step)
    assert (out.reasoning, out.content) == ("hmm", "four")
    out = run(OutputParser(reasoning_parser="think"), "no thought <think>", step)
    assert (out.reasoning, out.content) == ("", "no thought <think>")


@pytest.mark.parametrize("step", STEPS)
def test_forced_choices_parse_the_constrained_json(step):
    out = run(OutputParser(tool_mode="json_list"),
              '[{"name":"a","arguments":{"q":1}},{"name":"b","arguments":{}}]', step)
    assert [(c["name"], json.loads(c["arguments"])) for c in out.whole] == [("a", {"q": 1}),
                                                                              ("b", {})]
    out = run(OutputParser(tool_mode="json_args", tool_name="a"), '{"q":2}', step)
    assert out.whole[0]["name"] == "a" and out.whole[0]["arguments"] == '{"q":2}'
    assert len(out.whole) == 1
    # cut short by max_tokens: never the JSON as text (an agent takes text for its answer)
    out = run(OutputParser(tool_mode="json_list"), '[{"name":"a","argu', step)
    assert out.calls == [] and out.content == ""
    out = run(OutputParser(tool_mode="json_list"),
              '[{"name":"a","arguments":{"q":1}},{"name":"b","arguments":{"r":"x', step)
    assert out.content == "" and [(c["name"], c["arguments"]) for c in out.whole] == [
        ("a", '{"q": 1}'), ("b", '{"r":"x')]


def test_thought_then_hermes_call():
    out = run(OutputParser(reasoning_parser="think", tool_mode="hermes"),
              '<think>need weather</think>\n\n<tool_call>\n{"name": "w", "arguments": {}}\n'
              '</tool_call>', 1)
    assert out.reasoning == "need weather" and out.content == "" and out.whole[0]["name"] == "w"


def test_hermes_arguments_stream_as_they_are_written():
    p = OutputParser(tool_mode="hermes")
    text = '<tool_call>\n{"name": "w", "arguments": {"city": "Paris", "n": {"a": 1}}}\n</tool_call>'
    pieces = []
    for ch in text:
        pieces += p.feed(ch).calls
    pieces += p.finish().calls
    assert pieces[0].id and pieces[0].name == "w" and pieces[0].arguments == ""
    assert len(pieces) > 5 and all(q.id is None and q.index == 0 for q in pieces[1:])
    assert json.loads("".join(q.arguments for q in pieces)) == {"city": "Paris", "n": {"a": 1}}


def test_named_choice_streams_its_arguments():
    p = OutputParser(tool_mode="json_args", tool_name="f")
    first = p.feed('{"x":').calls
    assert (first[0].name, first[0].arguments, first[1].arguments) == ("f", "", '{"x":')
    assert p.feed("1}").calls[0].arguments == "1}" and not p.finish().calls


def test_hermes_arguments_are_the_same_text_whole_or_streamed():
    text = '<tool_call>\n{"name": "w", "arguments":   {"city": "K\u00f8ge \u32fa"}}\n</tool_call>'
    whole = OutputParser(tool_mode="hermes").finish(text)
    assert whole_calls(whole.calls)[0]["arguments"] == '{"city": "K\u00f8ge \u32fa"}'
    for step in (1, 2, 5):
        assert run(OutputParser(tool_mode="hermes"), text, step).whole[0]["arguments"] == \
            '{"city": "K\u00f8ge \u32fa"}'


def test_a_cut_short_hermes_call_is_text_in_a_reply_that_did_not_stream():
    text = 'Sure.\n<tool_call>\n{"name": "w", "arguments": {"city": "Pa'
    out = OutputParser(tool_mode="hermes").finish(text)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("step", STEPS)
def test_a_hermes_call_whose_closing_tag_was_cut_is_a_call(step):
    text = '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_c'
    for out in (run(OutputParser(tool_mode="hermes"), text, step),
                Out(**vars(OutputParser(tool_mode="hermes").finish(text)))):
        assert out.content == ""
        assert [(c["name"], c["arguments"]) for c in out.whole] == [("w", '{"city": "Oslo"}')]


@pytest.mark.parametrize("step", STEPS)
def test_a_forced_hermes_call_cut_in_its_arguments_stays_a_call(step):
    text = '<tool_call>\n{"name": "w", "arguments": {"city": "Pa'
    outs = [run(OutputParser(tool_mode="hermes", forced=True), text, step),
            Out(**vars(OutputParser(tool_mode="hermes", forced=True).finish(text)))]
    for out in outs:
        assert out.content == ""
        assert [(c["name"], c["arguments"]) for c in out.whole] == [("w", '{"city": "Pa')]
    # cut before its name was whole: nothing to call, and still never the markup as text
    cut = OutputParser(tool_mode="hermes", forced=True).finish('<tool_call>\n{"na')
    assert cut.content == "" and cut.calls == []


def test_a_forced_xml_call_cut_before_it_streamed_stays_a_call():
    text = "<tool_call>\n<function=w>\n<parameter=city>\nPa"
    tools = [{"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    unforced = OutputParser(tool_mode="qwen3_xml", tools=tools).finish(text)
    assert unforced.calls == [] and unforced.content == text
    forced = Out(**vars(OutputParser(tool_mode="qwen3_xml", tools=tools, forced=True)
                        .finish(text)))
    assert forced.content == ""
    assert [(c["name"], c["arguments"]) for c in forced.whole] == [("w", '{"city": "Pa')]


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("step", STEPS)
def test_a_hermes_call_cut_after_its_arguments_keeps_their_closing_brace(step, forced):
    # max_tokens ran out between the arguments' `}` and the call's own: the arguments are
    # whole, and a stream (or a Responses / Anthropic reply) must not drop their last `}`
    text = '<tool_call>\n{"name": "w", "arguments": {"city": {"name": "Oslo"}}'
    out = run(OutputParser(tool_mode="hermes", forced=forced), text, step)
    assert [(c["name"], c["arguments"]) for c in out.whole] == [
        ("w", '{"city": {"name": "Oslo"}}')]
    out = run(OutputParser(tool_mode="hermes", forced=forced), text + "}", step)
    assert [c["arguments"] for c in out.whole] == ['{"city": {"name": "Oslo"}}']


@pytest.mark.parametrize("step", STEPS)
def test_a_forced_reply_cut_in_its_next_calls_tag_is_calls_only(step):
    # tool_choice required: max_tokens ended the output inside the next call's opening tag;
    # the reply is the whole call, never `<tool_c` as content (an agent would show it)
    call = '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    for cut in ("\n<", "\n<tool_c", "\n<tool_call>"):
        out = run(OutputParser(tool_mode="hermes", forced=True), call + cut, step)
        assert out.content == "", cut
        assert [(c["name"], c["arguments"]) for c in out.whole] == [("w", '{"city": "Oslo"}')]
    xml = "<tool_call>\n<function=w>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for cut in ("\n<", "\n<tool_c"):
        out = run(OutputParser(tool_mode="qwen3_xml", tools=tools, forced=True), xml + cut, step)
        assert out.content == "", cut
        assert [(c["name"], c["arguments"]) for c in out.whole] == [("w", '{"city": "Oslo"}')]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_arguments_with_raw_control_characters_go_out_as_strict_json(step):
    # models write raw newlines and tabs inside strings (Write / Edit / Bash contents); JSON
    # forbids them there, and the SDKs, codex and Claude Code parse arguments strictly
    content = 'func f() {\n\treturn "\\\\"\r\x01\n}'
    args = json.dumps({"file_path": "a.go", "content": content}, ensure_ascii=False)
    raw = args.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r").replace(
        "\\u0001", "\x01")
    text = f'<tool_call>\n{{"name": "Write", "arguments": {raw}}}\n</tool_call>'
    for out in (run(OutputParser(tool_mode="hermes"), text, step),
                Out(**vars(OutputParser(tool_mode="hermes").finish(text)))):
        assert json.loads(out.whole[0]["arguments"]) == {"file_path": "a.go", "content": content}
    cut = run(OutputParser(tool_mode="hermes", forced=True), text[:-30], step)
    assert "\n" not in cut.whole[0]["arguments"] and "\\n" in cut.whole[0]["arguments"]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_arguments_written_as_a_json_string_are_the_object_it_holds(step):
    # some models double-encode: `"arguments": "{\"path\": ...}"`; a client needs the object
    # (Anthropic refuses a tool_use input that is no object when it is sent back)
    text = ('<tool_call>\n{"name": "Read", "arguments": "{\\"file_path\\": \\"a\u00e9.py\\", '
            '\\"n\\": 2}"}\n</tool_call>')
    for out in (run(OutputParser(tool_mode="hermes"), text, step),
                Out(**vars(OutputParser(tool_mode="hermes").finish(text)))):
        assert out.content == ""
        assert json.loads(out.whole[0]["arguments"]) == {"file_path": "a\u00e9.py", "n": 2}
    plain = '<tool_call>\n{"name": "Say", "arguments": "hello"}\n</tool_call>'
    assert run(OutputParser(tool_mode="hermes"), plain, step).whole[0]["arguments"] == '"hello"'


DEEP = 2000  # past Python's recursion limit for json.loads (1000): a reply can nest that deep
DEEP_OBJECT = '{"a":' * DEEP + "1" + "}" * DEEP


@pytest.mark.parametrize("step", [0, 7])
@pytest.mark.parametrize("arguments", [json.dumps("[" * DEEP), json.dumps(DEEP_OBJECT)])
def test_hermes_string_arguments_nested_past_the_recursion_limit_are_read_as_written(
        step, arguments):
    # a double-encoded string that holds no object it can read: the call keeps the string
    # as written, as for `"not json"` (it raised RecursionError: a 500, or an error event)
    text = '<tool_call>\n{"name": "f", "arguments": ' + arguments + '}\n</tool_call>'
    out = run(OutputParser(tool_mode="hermes"), text, step)
    assert out.content == "" and [(c["name"], c["arguments"]) for c in out.whole] == [
        ("f", arguments)]


@pytest.mark.parametrize("mode,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP
     + '}}\n</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": ' + DEEP_OBJECT + "}"),
    ("json_list", '[{"name":"f","arguments":' + DEEP_OBJECT + "}]"),  # as its grammar writes
    ("json_list", '[{"name":"f","arguments":{}},{"name":"g","arguments":' + DEEP_OBJECT),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=x>\n" + "[" * DEEP + "]" * DEEP
     + "\n</parameter>\n</function>\n</tool_call>")])
def test_calls_nested_past_the_recursion_limit_never_raise(mode, text):
    # whole (text where it cannot be read, as other broken JSON) or streamed (as written)
    for step in (0, 7):
        out = run(OutputParser(tool_mode=mode), text, step)
        assert out.content or out.calls, (mode, step)
