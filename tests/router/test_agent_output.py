"""Model text back into thought, answer and tool calls, fed whole or in any split."""

from __future__ import annotations

import json

import pytest

from helexa.router.agent_output import OutputParser, Parts


def run(p: OutputParser, text: str, step: int) -> Parts:
    out = Parts()
    pieces = [text[i:i + step] for i in range(0, len(text), step)] if step else [text]
    for piece in pieces:
        got = p.feed(piece)
        out.reasoning += got.reasoning
        out.content += got.content
        out.calls += got.calls
    got = p.finish()
    return Parts(out.reasoning + got.reasoning, out.content + got.content, out.calls + got.calls)


STEPS = [0, 1, 2, 3, 7]


@pytest.mark.parametrize("step", STEPS)
def test_hermes_calls_between_text(step):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    out = run(OutputParser(tool_mode="hermes"), text, step)
    assert out.content == "Let me check.\n"
    assert [c["name"] for c in out.calls] == ["get_weather", "get_time"]
    assert json.loads(out.calls[0]["arguments"]) == {"city": "Paris"}
    assert len({c["id"] for c in out.calls}) == 2


@pytest.mark.parametrize("step", STEPS)
def test_broken_hermes_call_stays_text(step):
    text = "a <tool_call>not json</tool_call> b <tool_ca"
    out = run(OutputParser(tool_mode="hermes"), text, step)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("step", STEPS)
def test_llama3_json_call_and_plain_text(step):
    out = run(OutputParser(tool_mode="llama3_json"),
              '{"name": "f", "parameters": {"x": 1}}', step)
    assert out.calls[0]["name"] == "f" and json.loads(out.calls[0]["arguments"]) == {"x": 1}
    out = run(OutputParser(tool_mode="llama3_json"), "Hello {there}", step)
    assert out.calls == [] and out.content == "Hello {there}"


@pytest.mark.parametrize("step", STEPS)
def test_think_split_with_and_without_an_opened_prompt(step):
    out = run(OutputParser(reasoning_parser="think"), "<think>\nhmm, 2+2</think>\n\n4", step)
    assert (out.reasoning, out.content) == ("\nhmm, 2+2", "4")
    out = run(OutputParser(reasoning_parser="think", starts_in_thought=True),
              "hmm</think>\n\nfour", step)
    assert (out.reasoning, out.content) == ("hmm", "four")
    out = run(OutputParser(reasoning_parser="think"), "no thought <think>", step)
    assert (out.reasoning, out.content) == ("", "no thought <think>")


@pytest.mark.parametrize("step", STEPS)
def test_forced_choices_parse_the_constrained_json(step):
    out = run(OutputParser(tool_mode="json_list"),
              '[{"name":"a","arguments":{"q":1}},{"name":"b","arguments":{}}]', step)
    assert [(c["name"], json.loads(c["arguments"])) for c in out.calls] == [("a", {"q": 1}),
                                                                              ("b", {})]
    out = run(OutputParser(tool_mode="json_args", tool_name="a"), '{"q":2}', step)
    assert out.calls[0]["name"] == "a" and out.calls[0]["arguments"] == '{"q":2}'
    out = run(OutputParser(tool_mode="json_list"), '[{"name":"a","argu', step)  # cut short
    assert out.calls == [] and out.content == '[{"name":"a","argu'


def test_thought_then_hermes_call():
    out = run(OutputParser(reasoning_parser="think", tool_mode="hermes"),
              '<think>need weather</think>\n\n<tool_call>\n{"name": "w", "arguments": {}}\n'
              '</tool_call>', 1)
    assert out.reasoning == "need weather" and out.content == "" and out.calls[0]["name"] == "w"
