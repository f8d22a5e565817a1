"""A forced tool choice's grammar writes what the template taught: each format's grammar
accepts the very calls its template renders for earlier turns, and refuses calls whose
arguments do not validate."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer as HFTokenizer

from helexa import grammar, tool_grammar
from helexa.neuron.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"},
                   "unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"},
                   "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                             "required": ["lat"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, PING]
ARGS = {"city": "Oslo", "days": 3, "ok": True, "where": {"lat": 59.9}}


class Matcher:
    """Whether a grammar accepts a text, token by token, on a checkpoint's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        text = (model_dir / "tokenizer.json").read_text()
        self.hf = HFTokenizer.from_str(text)
        eos = self.hf.token_to_id("<|im_end|>")
        self.lt = llguidance.LLTokenizer(text, n_vocab=self.hf.get_vocab_size(), eos_token=[eos])
        self.eos = eos

    def accepts(self, c: grammar.Constraint | str, text: str) -> bool:
        """c: a constraint, or a grammar's text as llguidance takes it."""
        m = llguidance.LLMatcher(self.lt, c if isinstance(c, str) else grammar.grammar_text(c),
                                 log_level=0)
        ok = all(m.consume_token(t) for t in self.hf.encode(text).ids)
        return ok and m.consume_token(self.eos)  # and nothing more is required


@pytest.fixture(scope="module")
def models(tiny_checkpoint) -> dict[str, Path]:
    return {"hermes": tiny_checkpoint("qwen3"),
            "qwen3_xml": tiny_checkpoint("qwen3", chat_template="qwen3_5")}


def rendered_calls(model_dir: Path, calls: list[tuple[str, dict]]) -> str:
    """What the checkpoint's template writes for an assistant turn that made these calls."""
    tok = Tokenizer.from_dir(model_dir)
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, turn], False,
                                   tools=TOOLS)
    body = text[text.rindex("<|im_start|>assistant\n") + 22:text.rindex("<|im_end|>")]
    return body.split("</think>\n\n")[-1]


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_xml"])
def test_the_grammar_accepts_what_the_template_renders(models, fmt):
    m = Matcher(models[fmt])
    one = rendered_calls(models[fmt], [("get_weather", ARGS)])
    assert one.startswith("<tool_call>\n") and one.endswith("</tool_call>")
    assert m.accepts(tool_grammar.forced(fmt, TOOLS, "get_weather", False), one)
    assert m.accepts(tool_grammar.forced(fmt, TOOLS, "", False), one)
    two = rendered_calls(models[fmt], [("get_weather", ARGS), ("ping", {})])
    assert m.accepts(tool_grammar.forced(fmt, TOOLS, "", True), two)
    assert not m.accepts(tool_grammar.forced(fmt, TOOLS, "", False), two)  # one call only
    assert not m.accepts(tool_grammar.forced(fmt, TOOLS, "ping", False), one)


@pytest.mark.parametrize("args", [
    {"city": "Oslo"},  # a required parameter missing
    {"city": "a" * 11, "days": 1},  # over maxLength
    {"city": "Oslo", "days": 1.5},  # not an integer
    {"city": "Oslo", "days": 1, "unit": "k"},  # not in the enum
    {"city": "Oslo", "days": 1, "where": {"lon": 1}},  # a nested object that does not validate
])
@pytest.mark.parametrize("fmt", ["hermes", "qwen3_xml"])
def test_arguments_that_do_not_validate_are_refused(models, fmt, args):
    m = Matcher(models[fmt])
    text = rendered_calls(models[fmt], [("get_weather", args)])
    assert not m.accepts(tool_grammar.forced(fmt, TOOLS, "get_weather", False), text)


def test_xml_values_raw_strings_and_python_words(models):
    m, c = Matcher(models["qwen3_xml"]), tool_grammar.forced("qwen3_xml", TOOLS, "", False)
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    tail = "\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    assert m.accepts(c, head + "New\nYork" + tail)  # raw, several lines
    assert not m.accepts(c, head + "a</parameter>" + tail)  # a value cannot close early
    assert m.accepts(c, head + "Oslo" + tail.replace("</function>", "<parameter=ok>\n"
                                                     "False\n</parameter>\n</function>"))
    free = tool_grammar.forced("qwen3_xml", [{"type": "function", "function": {
        "name": "run", "parameters": {"type": "object"}}}], "", False)
    assert m.accepts(free, "<tool_call>\n<function=run>\n<parameter=any key>\nx\n</parameter>"
                           "\n</function>\n</tool_call>")


def test_llama3_and_formatless_models(models):
    m = Matcher(models["hermes"])
    call = '{"name": "get_weather", "parameters": ' + json.dumps(ARGS) + "}"
    assert m.accepts(tool_grammar.forced("llama3_json", TOOLS, "get_weather", False), call)
    assert m.accepts(tool_grammar.forced("llama3_json", TOOLS, "", True),
                     call + '; {"name": "ping", "parameters": {}}')
    assert call.startswith(tool_grammar.llama3_head("get_weather"))
    bare = tool_grammar.forced("", TOOLS, "", True)  # no format: the JSON list, compact
    assert bare.kind == "json_schema"
    assert m.accepts(bare, '[{"name":"ping","arguments":{}}]')


def test_unknown_names_and_formats_are_refused():
    with pytest.raises(grammar.GrammarError, match="nope"):
        tool_grammar.forced("hermes", TOOLS, "nope", False)
    with pytest.raises(grammar.GrammarError, match="format"):
        tool_grammar.forced("xml9", TOOLS, "", False)
    with pytest.raises(grammar.GrammarError, match="at least one tool"):
        tool_grammar.forced("qwen3_xml", [], "", False)


@pytest.mark.parametrize("fmt", ["hermes", ""])
def test_parameters_without_a_type_are_an_object(models, fmt):
    # a schema of `properties` and `required` only (no `type`, as many clients write one)
    # allows any JSON value; a forced call's arguments are an object still: the model once
    # answered `"arguments": true`, which the next turn cannot send back
    loose = [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}]
    m, c = Matcher(models["hermes"]), tool_grammar.forced(fmt, loose, "", False)
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>' if fmt else \
        '[{"name":"f","arguments":%s}]'
    assert m.accepts(c, call % ('{"a": 1}' if fmt else '{"a":1}'))
    assert not m.accepts(c, call % "true")
    with pytest.raises(grammar.GrammarError, match="object"):
        tool_grammar.forced(fmt, [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}], "", False)


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CODEX_CALLS = {  # what the model writes for codex's shell({"command": ["ls"]}), per format
    "hermes": '<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>',
    "qwen3_xml": '<tool_call>\n<function=shell>\n<parameter=command>\n["ls"]\n</parameter>\n'
                 '</function>\n</tool_call>',
    "llama3_json": '{"name": "shell", "parameters": {"command": ["ls"]}}'}


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_xml", "llama3_json"])
def test_an_answer_format_beside_tools_under_auto_still_lets_the_model_call(models, fmt):
    # codex exec --output-schema: tools under tool_choice auto and text.format json_schema.
    # OpenAI holds the final message to the schema, not the calls before it; a grammar of
    # the schema alone made every call impossible. The request as the router sends it, the
    # grammar as the neuron builds it in the model's call format:
    from helexa.neuron import agent
    from helexa.router import forward, responses_api

    req = responses_api.parse_request(json.dumps({
        "model": "m", "input": "run the tests, then report", "tool_choice": "auto",
        "parallel_tool_calls": False, "tools": [
            {"type": "function", "name": "shell", "parameters": {
                "type": "object", "properties": {"command": {"type": "array"}}}},
            {"type": "web_search"}],
        "text": {"format": {"type": "json_schema", "name": "out", "strict": True,
                            "schema": ANSWER}}}).encode()).compile()
    g = forward.generate_request(req, model="m", principal="p", req_id="r",
                                 deadline_unix_ms=0)
    text = agent.constraint_grammar(g, fmt)
    assert text is not None
    m = Matcher(models["hermes" if fmt == "llama3_json" else fmt])
    assert m.accepts(text, CODEX_CALLS[fmt])  # a call, its arguments free (auto: never compiled)
    assert m.accepts(text, '{"ok":true}')  # or the answer, held to the schema
    assert not m.accepts(text, '{"ok":1}') and not m.accepts(text, "Done.")
    two = CODEX_CALLS[fmt] + ("; " if fmt == "llama3_json" else "\n") + CODEX_CALLS[fmt]
    assert not m.accepts(text, two)  # parallel_tool_calls false: one call



PATH = {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-c ]+$"}
PRICE = {"type": "string", "pattern": "^[0-9]+\\$"}  # an escaped `$`: a dollar, then anything
CODE = {"type": "string", "pattern": "^x|y$"}  # starts with x, or ends with y


@pytest.mark.parametrize(("schema", "good", "bad"), [
    (PATH, ["ab c", "ab"], "abcabc"),  # the pattern's characters, over maxLength
    (PATH, ["ab c"], "a"),  # under minLength
    (PATH, ["ab c"], "abd"),  # outside the pattern
    (PRICE, ["12$", "5$ each"], "12"),
    (CODE, ["x1", "1y"], "1x"),
])
@pytest.mark.parametrize("fmt", ["hermes", "qwen3_xml"])
def test_a_pattern_and_length_bounds_hold_together_in_every_format(models, fmt, schema, good,
                                                                   bad):
    # qwen3_xml writes a string raw, from a regex helexa builds; hermes writes JSON, whose
    # string rules are llguidance's own: the same schema gets the same verdicts in both
    put = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "required": ["v"], "properties": {"v": schema}}}}
    m, c = Matcher(models[fmt]), tool_grammar.forced(fmt, [put], "put", False)
    for v in good:
        assert m.accepts(c, rendered_calls(models[fmt], [("put", {"v": v})]))
    assert not m.accepts(c, rendered_calls(models[fmt], [("put", {"v": bad})]))


def test_tools_the_template_gets_pass_as_sent_whatever_their_parameters():
    """The neuron renders what a caller sent (the router checks tools first, but gRPC callers
    are not only the router): parameters that are not an object were an AttributeError, which
    failed /tokenize with a 502 and nothing in the neuron's log."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": [1]}},
             {"type": "function", "function": {"name": "g", "parameters": "x"}}, "h"]
    assert tool_grammar.for_template(tools) == tools
