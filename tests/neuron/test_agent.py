"""What the neuron reads from a template for agents, and the engine inputs it builds."""

from __future__ import annotations

import json

import pytest

from helexa.config.schema import ModelEntry
from helexa.fixtures.tiny import CHAT_TEMPLATE, init_tiny
from helexa.neuron import agent
from helexa.neuron.tokenizer import Tokenizer
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

ENTRY = ModelEntry(id="m", path="x", thinking_budget_tokens=800)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(init_tiny(tmp_path_factory.mktemp("t") / "m"))


def test_formats_from_the_template_or_the_entry():
    assert agent.tool_parser(ENTRY, CHAT_TEMPLATE) == "hermes"
    assert agent.reasoning_parser(ENTRY, CHAT_TEMPLATE) == "think"
    llama = "{{ '<|python_tag|>' }}{% if message.role == 'ipython' %}{% endif %}"
    assert agent.tool_parser(ENTRY, llama) == "llama3_json"
    assert agent.reasoning_parser(ENTRY, llama) == "" and agent.tool_parser(ENTRY, "x") == ""
    fixed = ModelEntry(id="m", path="x", tool_parser="llama3_json", reasoning_parser="none")
    assert agent.tool_parser(fixed, CHAT_TEMPLATE) == "llama3_json"
    assert agent.reasoning_parser(fixed, CHAT_TEMPLATE) == ""


def test_template_inputs_give_arguments_as_objects_and_pass_variables():
    chat = pb.Chat(messages=[
        pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([{
            "id": "c", "type": "function",
            "function": {"name": "f", "arguments": '{"x": 1}'}}])),
        pb.ChatMessage(role="tool", content="2", tool_call_id="c")],
        tools_json='[{"type": "function", "function": {"name": "f"}}]',
        template_kwargs_json='{"enable_thinking": true}')
    msgs, kw = agent.template_inputs(chat, "")
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[1] == {"role": "tool", "content": "2", "tool_call_id": "c"}
    assert kw["tools"][0]["function"]["name"] == "f" and kw["enable_thinking"] is True
    # constrained output thinks only when asked to (then after the thought, the grammar)
    assert agent.template_inputs(chat, "", constrained=True)[1]["enable_thinking"] is True
    assert agent.template_inputs(pb.Chat(), "", constrained=True)[1] == {
        "enable_thinking": False}
    assert agent.template_inputs(pb.Chat(), "none")[1] == {"enable_thinking": False}
    with pytest.raises(Refusal, match="chat_template_kwargs"):
        agent.template_inputs(pb.Chat(template_kwargs_json="[1]"), "")


@pytest.mark.parametrize("effort,budget", [("", 800), ("high", 800), ("medium", 400),
                                           ("low", 100), ("none", 0)])
def test_effort_maps_to_the_catalogue_budget(tok, effort, budget):
    req = pb.GenerateRequest(reasoning_effort=effort, chat=pb.Chat())
    prompt = tok.encode_chat([{"role": "user", "content": "hi"}], enable_thinking=True)
    t = agent.thinking(tok, ENTRY, req, prompt, None)
    assert t is not None and t.budget_tokens == budget and t.starts_open
    assert tok.decode(t.close_ids) == "\n</think>\n\n"
    req.thinking_budget_tokens = 7  # explicit (Anthropic's budget_tokens) wins
    assert agent.thinking(tok, ENTRY, req, prompt, None).budget_tokens == 7


def test_no_thinking_for_text_prompts_or_models_that_do_not_think(tok):
    plain = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert agent.thinking(tok, ENTRY, pb.GenerateRequest(text="hi"), plain, None) is None
    t = agent.thinking(tok, ENTRY, pb.GenerateRequest(chat=pb.Chat()), plain, None)
    assert t is not None and not t.starts_open
    assert agent.thinking(tok, ENTRY, pb.GenerateRequest(chat=pb.Chat()), plain, False
                          ).budget_tokens == 0


def test_a_bad_constraint_is_refused_naming_it():
    req = pb.GenerateRequest(constraint=pb.Constraint(json_schema='{"type": "strnig"}'))
    with pytest.raises(Refusal, match="strnig"):
        agent.constraint_grammar(req)
    assert agent.constraint_grammar(pb.GenerateRequest()) is None
    assert agent.constraint_grammar(pb.GenerateRequest(
        constraint=pb.Constraint(json_object=True)))


def test_qwen3_5_template_is_the_xml_format():
    from helexa.fixtures.qwen35_template import QWEN3_5_CHAT_TEMPLATE

    assert agent.tool_parser(ENTRY, QWEN3_5_CHAT_TEMPLATE) == "qwen3_xml"
    assert agent.reasoning_parser(ENTRY, QWEN3_5_CHAT_TEMPLATE) == "think"
    fixed = ModelEntry(id="m", path="x", tool_parser="qwen3_xml")
    assert agent.tool_parser(fixed, CHAT_TEMPLATE) == "qwen3_xml"


def test_string_arguments_become_mappings_or_a_refusal_naming_the_message():
    def chat(arguments: str) -> pb.Chat:
        return pb.Chat(messages=[
            pb.ChatMessage(role="user", content="hi"),
            pb.ChatMessage(role="assistant", tool_calls_json=json.dumps([
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "f",
                                                             "arguments": arguments}}]))])

    msgs = agent.template_inputs(chat('{"x": [1]}'), "")[0]
    assert [c["function"]["arguments"] for c in msgs[1]["tool_calls"]] == [{}, {"x": [1]}]
    assert agent.template_inputs(chat("  "), "")[0][1]["tool_calls"][1]["function"][
        "arguments"] == {}
    for bad in ("[1, 2]", "not json", '"x"'):
        with pytest.raises(Refusal, match=r"messages\[1\]\.tool_calls\[1\]\.function\.arguments"):
            agent.template_inputs(chat(bad), "")


def test_a_forced_choice_is_written_in_the_model_format():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    req = pb.GenerateRequest(chat=pb.Chat(tools_json=json.dumps(tools)), constraint=pb.Constraint(
        tool_choice=pb.ToolChoice(function="f")))
    xml = agent.constraint_grammar(req, "qwen3_xml")
    assert xml and "<function=f>" in xml and "<parameter=x>" in xml
    assert "<tool_call>" in agent.constraint_grammar(req, "hermes")
    assert "<function=" not in agent.constraint_grammar(req, "")  # no format: JSON arguments
    req.constraint.tool_choice.function = "g"
    with pytest.raises(Refusal, match="tools: no tool is named `g`"):
        agent.constraint_grammar(req, "qwen3_xml")


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "continue_final_message"])
def test_a_template_variable_the_request_sets_is_refused_not_a_type_error(tok, key):
    # The router refuses these first (router/agent_request.py); the neuron never lets them
    # collide with encode_chat's own arguments (a TypeError quoting Python internals)
    from helexa.neuron.prepare import tokenise

    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                   template_kwargs_json=json.dumps({key: False}))
    with pytest.raises(Refusal) as e:
        tokenise(tok, pb.GenerateRequest(chat=chat))
    assert e.value.message.startswith(f"chat_template_kwargs.{key}:")
    assert "keyword argument" not in e.value.message


@pytest.mark.parametrize("key", ["self", "text", "kwargs"])
def test_a_template_variable_named_as_a_python_argument_is_only_a_template_variable(tok, key):
    # `self` once collided with encode_chat's own (a TypeError quoting Python, answered as
    # "the model's chat template failed"): any other name is the template's to read. Jinja
    # keeps `self` for the template's own reference, so a template never sees that one.
    from helexa.neuron.prepare import tokenise

    shows = Tokenizer(tok._tok, eos_token_ids=tok.eos_token_ids,
                      special_tokens=tok.special_tokens,
                      chat_template="{{ messages[0]['content'] }}:{{ text | default('-') }}:"
                                    "{{ kwargs | default('-') }}:{{ self is string }}")

    def ids(kwargs: dict) -> list[int]:
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                       template_kwargs_json=json.dumps(kwargs))
        return tokenise(shows, pb.GenerateRequest(chat=chat))

    want = {"self": "hi:-:-:False", "text": "hi:x:-:False", "kwargs": "hi:-:x:False"}[key]
    assert ids({key: "x"}) == shows.encode(want, add_special_tokens=False)
    assert ids({}) == shows.encode("hi:-:-:False", add_special_tokens=False)
