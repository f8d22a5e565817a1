"""The agent fields of a chat request: tools, tool_choice, response_format, reasoning.

Maps what `request_model.ChatBody` decoded onto the internal request
(`openai_api.ParsedRequest`), with the rules between fields, and decides the
constraint the engine enforces:

- `response_format` json_object / json_schema: the output is that JSON
  (helexa.grammar checks the schema here, so a schema the grammar library
  cannot serve is a 400 naming the problem);
- `tool_choice: "required"`: the output is calls of the tools (one call
  when `parallel_tool_calls` is false); a named function: one call of it.
  The neuron writes that grammar in the model's own call format
  (helexa/tool_grammar.py: what its template taught, or a JSON list for a
  template that teaches none), so even a weak model returns calls whose
  arguments validate, and the router parses them with that format's parser
  (agent_output.py). The router checks here that the tools' schemas compile;
- `auto` leaves the model free and its own format is parsed back; `none`
  hides nothing from the template but parses no calls.

Reasoning: `reasoning_effort` (`minimal` counts as `low`) and
`chat_template_kwargs.enable_thinking` travel to the neuron, which maps them
to a thinking budget from the model's catalogue entry.
"""

from __future__ import annotations

import json
from typing import Any

from helexa import grammar, tool_grammar
from helexa.router.errors import bad_request
from helexa.router.request_model import ChatBody, NamedToolChoice


def apply(b: ChatBody, req: Any) -> None:
    """Fill req's agent fields from the body; raises ApiError(400) naming the param."""
    _tools(b, req)
    _response_format(b, req)
    effort = b.reasoning_effort
    req.reasoning_effort = "low" if effort == "minimal" else (effort or "")
    req.template_kwargs = dict(b.chat_template_kwargs or {})
    thinking = req.template_kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("`chat_template_kwargs.enable_thinking` must be a boolean",
                          "chat_template_kwargs.enable_thinking")


def _tools(b: ChatBody, req: Any) -> None:
    tools = b.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("`tools`: function names must be unique", "tools")
    req.tools = [{"type": "function", "function": _function_dict(t.function)} for t in tools]
    req.parallel_tool_calls = b.parallel_tool_calls is not False
    choice = b.tool_choice
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"`tool_choice`: no tool is named `{choice.function.name}`",
                              "tool_choice")
        req.tool_choice, req.tool_name = "function", choice.function.name
    else:
        req.tool_choice = choice or ("auto" if tools else "none")
        if req.tool_choice == "required" and not tools:
            raise bad_request("`tool_choice` is `required` but no `tools` were given",
                              "tool_choice")
    for t in tools:
        if t.function.parameters is not None:
            _check(grammar.json_schema(t.function.parameters),
                   f"tools[{names.index(t.function.name)}].function.parameters")
    if req.tool_choice in ("required", "function"):
        if b.response_format is not None and b.response_format.type != "text":
            raise bad_request("`response_format` cannot be combined with a forced `tool_choice`",
                              "response_format")
        # The JSON form, checked here; the neuron writes it in the model's format (forward.py).
        req.constraint = grammar.json_schema(tool_grammar.calls_schema(
            req.tools, req.tool_name if req.tool_choice == "function" else "",
            req.parallel_tool_calls))
        _check(req.constraint, "tools")
        try:  # the XML format's grammar asks most of the schemas (raw-text values)
            _check(tool_grammar.forced("qwen3_xml", req.tools, req.tool_name or "",
                                       req.parallel_tool_calls), "tools")
        except grammar.GrammarError as e:
            raise bad_request(f"`tools`: {e}", "tools") from None


def _function_dict(f: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        d["description"] = f.description
    d["parameters"] = f.parameters if f.parameters is not None else \
        {"type": "object", "properties": {}}
    return d


def _response_format(b: ChatBody, req: Any) -> None:
    fmt = b.response_format
    if fmt is None or fmt.type == "text":
        return
    if fmt.type == "json_object":
        req.constraint = grammar.Constraint(kind="json_object")
    else:
        if fmt.json_schema is None:
            raise bad_request("`response_format.json_schema` is required for type json_schema",
                              "response_format.json_schema")
        schema = fmt.json_schema.schema
        req.constraint = grammar.json_schema(schema if schema is not None else {"type": "object"})
        req.response_schema_name = fmt.json_schema.name
    _check(req.constraint, "response_format.json_schema.schema"
           if fmt.type == "json_schema" else "response_format")


def _check(c: grammar.Constraint, param: str) -> None:
    try:
        grammar.check(c)
    except grammar.GrammarError as e:
        raise bad_request(f"`{param}`: the schema cannot be used for constrained decoding: {e}",
                          param) from None


def tool_calls_json(calls: list[Any], param: str) -> str:
    """An assistant message's tool calls as the JSON the neuron's template input takes;
    arguments must be a JSON object's text (templates iterate them: `arguments|items`),
    blank meaning none. param names the message (`messages[i]`)."""
    for j, c in enumerate(calls):
        text = c.function.arguments
        try:
            args = json.loads(text) if text.strip() else {}
        except ValueError:
            args = None
        if not isinstance(args, dict):
            where = f"{param}.tool_calls[{j}].function.arguments"
            raise bad_request(f"`{where}` must be a JSON object, as text", where)
    return json.dumps([{"id": c.id, "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments}}
                       for c in calls])
