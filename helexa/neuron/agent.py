"""What a model's chat template knows about agents, and a request's agent inputs for the engine.

The neuron owns the checkpoint's template, so it decides here (one place):
- which tool-call format the model writes (`tool_parser`: "qwen3_xml" for
  `<tool_call><function=NAME><parameter=KEY>` as Qwen3.5 / Qwen3.6 /
  Qwen3-Coder templates teach, "hermes" for `<tool_call>{json}</tool_call>` as
  Qwen2.5 / Qwen3 teach, "llama3_json" for Llama 3's bare JSON calls) and
  whether it thinks (`reasoning_parser` "think": `<think>...</think>`), from
  the catalogue entry or, on "auto", from the template text. Watch reports
  both; the router parses replies with them;
- the template's inputs for a Chat: messages with their tool calls (arguments
  as mappings, as Hugging Face templates expect: `arguments|items` needs one)
  and tool results, `tools`, and extra variables (`enable_thinking`, ...);
- the engine's inputs: the grammar of a constrained request (a forced tool
  choice in the model's own format, or under auto calls in it or a structured
  answer: helexa/tool_grammar.py) and the thinking
  budget (`reasoning_effort` → tokens: high = the entry's
  thinking_budget_tokens, medium half, low an eighth, none 0).
"""

from __future__ import annotations

import json
from typing import Any

from helexa import grammar, tool_grammar
from helexa.config.schema import ModelEntry
from helexa.neuron.engine import messages
from helexa.neuron.vision.prompt import message_content
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_EFFORT_SHARE = {"high": 1.0, "medium": 0.5, "low": 0.125, "none": 0.0}


def tool_parser(entry: ModelEntry, template: str | None) -> str:
    if entry.tool_parser != "auto":
        return "" if entry.tool_parser == "none" else entry.tool_parser
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_xml"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return ""


# The open and close tags of a call in the formats that wrap calls in the answer's text.
CALL_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3_xml": ("<tool_call>", "</tool_call>")}


def call_tags(entry: ModelEntry, template: str | None,
              request: pb.GenerateRequest) -> tuple[str, str] | None:
    """A chat request's call tags where it offers tools in a format that has them (a stop
    string does not end the text inside a call: detokenizer.StopChecker)."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.tools_json:
        return None
    return CALL_TAGS.get(tool_parser(entry, template))


def reasoning_parser(entry: ModelEntry, template: str | None) -> str:
    if entry.reasoning_parser != "auto":
        return "" if entry.reasoning_parser == "none" else entry.reasoning_parser
    return "think" if THINK_OPEN in (template or "") else ""


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise Refusal("invalid_request_error", f"{what}: not valid JSON: {e}") from None


# What the chat is rendered with besides the template variables (Tokenizer.encode_chat's own
# arguments): from chat_template_kwargs they would collide with them (a TypeError).
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message")


def template_inputs(chat: pb.Chat, effort: str,
                    constrained: bool = False) -> tuple[list[dict], dict[str, Any]]:
    """(messages, extra template variables) for the checkpoint's template. A constrained
    output thinks only when the client asked for it (see `thinking`)."""
    msgs: list[dict] = []
    for i, m in enumerate(chat.messages):
        d: dict[str, Any] = {"role": m.role, "content": message_content(m)}
        if m.tool_calls_json:
            calls = _json(m.tool_calls_json, f"messages[{i}].tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = call_arguments(
                        fn["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
            d["tool_calls"] = calls
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        msgs.append(d)
    kwargs: dict[str, Any] = {}
    if chat.template_kwargs_json:
        extra = _json(chat.template_kwargs_json, "chat_template_kwargs")
        if not isinstance(extra, dict):
            raise Refusal("invalid_request_error", "chat_template_kwargs: expected an object")
        clash = next((k for k in RESERVED_TEMPLATE_KWARGS if k in extra), None)
        if clash is not None:  # the router refuses these first (router/agent_request.py)
            raise Refusal("invalid_request_error", f"chat_template_kwargs.{clash}: the "
                          "request's own field sets it, not a template variable")
        kwargs.update(extra)
    if chat.tools_json:
        tools = _json(chat.tools_json, "tools")
        kwargs["tools"] = tool_grammar.for_template(tools) if isinstance(tools, list) else tools
    asked = effort not in ("", "none") or kwargs.get("enable_thinking") is True
    if constrained and not asked:
        kwargs["enable_thinking"] = False  # a thought the grammar would not let through
    elif effort == "none":
        kwargs.setdefault("enable_thinking", False)
    elif effort:
        kwargs.setdefault("enable_thinking", True)
    return msgs, kwargs


def call_arguments(text: str, where: str) -> dict[str, Any]:
    """An earlier call's arguments as the mapping templates iterate (`arguments|items`),
    from the JSON text OpenAI clients send; blank means no arguments."""
    if not text.strip():
        return {}
    try:
        args = json.loads(text)
    except ValueError as e:
        raise Refusal("invalid_request_error", f"{where}: not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise Refusal("invalid_request_error", f"{where}: expected a JSON object")
    return args


def constraint_grammar(request: pb.GenerateRequest, tool_format: str = "") -> str | None:
    """The llguidance grammar of a constrained request, or None; a Refusal if it is bad.
    A forced tool choice, and the calls beside a structured answer under auto, are written
    in tool_format, the model's own (`tool_parser`)."""
    if not request.HasField("constraint"):
        return None
    kind = request.constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "tool_choice":
        choice = request.constraint.tool_choice
        tools = _json(request.chat.tools_json, "tools") if request.chat.tools_json else []
        try:
            return grammar.grammar_text(tool_grammar.forced(tool_format, tools, choice.function,
                                                            choice.parallel))
        except grammar.GrammarError as e:
            raise Refusal("invalid_request_error", f"tools: {e}") from None
    if kind == "calls_or_answer":
        either = request.constraint.calls_or_answer
        tools = _json(request.chat.tools_json, "tools") if request.chat.tools_json else []
        answer = grammar.Constraint(kind="json_schema", source=either.answer_schema) \
            if either.answer_schema else grammar.Constraint(kind="json_object")
        try:
            return grammar.grammar_text(tool_grammar.calls_or_answer(
                tool_format, tools, either.parallel, answer))
        except grammar.GrammarError as e:
            raise Refusal("invalid_request_error", f"response_format: {e}") from None
    source = "" if kind == "json_object" else getattr(request.constraint, kind)
    try:
        return grammar.grammar_text(grammar.Constraint(kind=kind, source=source))
    except grammar.GrammarError as e:
        raise Refusal("invalid_request_error", f"response_format: {e}") from None


def thinking_budget(entry: ModelEntry, request: pb.GenerateRequest,
                    enable_thinking: Any) -> int:
    if request.HasField("thinking_budget_tokens"):
        return max(0, request.thinking_budget_tokens)
    effort = request.reasoning_effort or ("none" if enable_thinking is False else "high")
    return int(entry.thinking_budget_tokens * _EFFORT_SHARE.get(effort, 1.0))


def thinking(tokenizer: Any, entry: ModelEntry, request: pb.GenerateRequest,
             prompt_ids: list[int], enable_thinking: Any) -> messages.Thinking | None:
    """The engine's thinking bounds for a model that thinks, else None. A constrained
    request thinks only when its prompt opened the thought: the grammar then applies to
    the answer after it (the engine cannot let a model open a thought the grammar
    forbids)."""
    if request.WhichOneof("prompt") != "chat" or \
            reasoning_parser(entry, tokenizer.chat_template) != "think":
        return None
    tail = tokenizer.decode(prompt_ids[-8:]).rstrip()
    if request.HasField("constraint") and not tail.endswith(THINK_OPEN):
        return None
    return messages.Thinking(
        budget_tokens=thinking_budget(entry, request, enable_thinking),
        open_ids=list(tokenizer.encode(THINK_OPEN, add_special_tokens=False)),
        close_ids=list(tokenizer.encode("\n" + THINK_CLOSE + "\n\n", add_special_tokens=False)),
        starts_open=tail.endswith(THINK_OPEN))
