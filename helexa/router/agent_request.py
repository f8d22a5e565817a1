"""The agent fields of a chat request: tools, tool_choice, response_format, reasoning.

Maps what `request_model.ChatBody` decoded onto the internal request
(`openai_api.ParsedRequest`), with the rules between fields, and decides the
constraint the engine enforces:

- `response_format` json_object / json_schema: the output is that JSON
  (helexa.grammar checks the schema here, so a schema that is wrong in
  itself is a 400 naming the problem);
- `tool_choice: "required"`: the output is calls of the tools (one call
  when `parallel_tool_calls` is false); a named function: one call of it.
  The neuron writes that grammar in the model's own call format
  (helexa/tool_grammar.py: what its template taught, or a JSON list for a
  template that teaches none), so even a weak model returns calls whose
  arguments validate, and the router parses them with that format's parser
  (agent_output.py). The router checks that the tools' schemas compile;
- `auto` leaves the model free and its own format is parsed back; `none`
  hides nothing from the template but parses no calls. Either way a tool's
  schema is prompt text only: it is never compiled, so no schema an agent
  sends can fail the request. With a `response_format` beside tools under
  `auto` the output is calls (in the model's format, any arguments) or that
  JSON answer (`calls_or_answer`), as OpenAI applies a format to the final
  message only: `codex exec --output-schema` calls tools before it answers.

Keywords the grammar cannot enforce (helexa.grammar.enforceable) are dropped
from a constraint and listed in `req.unenforced` (the router says them in
the `x-helexa-unenforced-schema` header and checks the reply against the
whole schema after generation: `reply_violations`).

Compiling is the slow part (a 512 KiB schema of 13,000 required properties:
3.6 CPU s), so parsing only checks the caps (request_caps.py) and leaves the
compiling to `req.compiles`, which the router runs on a pool of its own
(`ParsedRequest.compile`; docs/http.md, "Generation requests"): a body whose
schema takes seconds never holds a thread that parses other bodies. Until
then `req.constraint` is `PENDING`, a json_schema constraint without its
source, so the rules between fields that ask whether there is one still hold.

Reasoning: `reasoning_effort` (`minimal` counts as `low`) and
`chat_template_kwargs.enable_thinking` travel to the neuron, which maps them
to a thinking budget from the model's catalogue entry.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any

from helexa import grammar, tool_grammar
from helexa.router import cut_calls, schema_check
from helexa.router.errors import ApiError, bad_request
from helexa.router.json_depth import MAX_JSON_DEPTH, json_depth_error
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps, SchemaBudget, check_tool_count
from helexa.router.request_model import ChatBody, NamedToolChoice


def apply(b: ChatBody, req: Any,
          caps: RequestCaps = DEFAULT_CAPS) -> tuple[bool | None, bool | None]:
    """Fill req's agent fields from the body; raises ApiError(400) naming the param (a cap of
    request_caps.py among them, checked before any schema is compiled). Returns the
    (add_generation_prompt, continue_final_message) in force (`template_kwargs`)."""
    _tools(b, req, caps)
    _response_format(b, req, caps)
    effort = b.reasoning_effort
    req.reasoning_effort = "low" if effort == "minimal" else (effort or "")
    req.template_kwargs, add_prompt, continue_final = template_kwargs(
        b.chat_template_kwargs, b.add_generation_prompt, b.continue_final_message)
    thinking = req.template_kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("`chat_template_kwargs.enable_thinking` must be a boolean",
                          "chat_template_kwargs.enable_thinking")
    return add_prompt, continue_final


# Template variables that request fields set, refused in chat_template_kwargs (vLLM refuses
# chat_template and tokenize there; messages would collide with the messages rendered).
_RESERVED_KWARGS = {"messages": "send the conversation as `messages`",
                    "tools": "send the tools as the request's `tools`",
                    "chat_template": "the checkpoint's own chat template is used",
                    "tokenize": "the prompt is always tokenized"}
# These two vLLM takes from chat_template_kwargs too, over the request's own fields.
_FLAG_KWARGS = ("add_generation_prompt", "continue_final_message")


def template_kwargs(given: dict[str, Any] | None, add_generation_prompt: bool | None,
                    continue_final_message: bool | None
                    ) -> tuple[dict[str, Any], bool | None, bool | None]:
    """(the template variables, add_generation_prompt, continue_final_message) from a body's
    chat_template_kwargs and its own fields: as in vLLM, a boolean add_generation_prompt or
    continue_final_message in chat_template_kwargs wins over the field; a key naming another
    request field (`_RESERVED_KWARGS`) is a 400 naming it."""
    kwargs = dict(given or {})
    flags = {"add_generation_prompt": add_generation_prompt,
             "continue_final_message": continue_final_message}
    for key, why in _RESERVED_KWARGS.items():
        if key in kwargs:
            raise bad_request(f"`chat_template_kwargs.{key}` is not a template variable a "
                              f"request sets: {why}", f"chat_template_kwargs.{key}")
    for key in _FLAG_KWARGS:
        if key in kwargs:
            value = kwargs.pop(key)
            if not isinstance(value, bool):
                raise bad_request(f"`chat_template_kwargs.{key}` must be a boolean",
                                  f"chat_template_kwargs.{key}")
            flags[key] = value
    return kwargs, flags["add_generation_prompt"], flags["continue_final_message"]


def _tools(b: ChatBody, req: Any, caps: RequestCaps) -> None:
    tools = b.tools or []
    check_tool_count(len(tools), caps)
    budget = SchemaBudget(caps)
    for i, t in enumerate(tools):
        budget.take(t.function.parameters, f"tools[{i}].function.parameters")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("`tools`: function names must be unique", "tools")
    req.tools = tool_dicts(tools)
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
    if req.tool_choice in ("required", "function"):
        if b.response_format is not None and b.response_format.type != "text":
            raise bad_request("`response_format` cannot be combined with a forced `tool_choice`",
                              "response_format")
        force_tools(req)


def apply_as(body: ChatBody, req: Any, caps: RequestCaps, where: list[str],
             schema_key: str) -> None:
    """apply() for a body translated from another API (Anthropic's, Responses'): a 400 or
    an unenforced keyword about chat's `tools[i].function...` names the tool as the client
    listed it, where[i], and its schema as schema_key (`input_schema`, `parameters`), now or
    when the compiling it left is done."""
    def rename(text: str) -> str:
        return _CHAT_TOOL.sub(lambda m: where[int(m[1])] + (
            "." + (schema_key if m[2] == "parameters" else m[2]) if m[2] else ""), text)
    left = len(req.compiles)
    _renamed(lambda: apply(body, req, caps), req, rename)()
    req.compiles[left:] = [_renamed(fn, req, rename) for fn in req.compiles[left:]]


def _renamed(fn: Callable[[], object], req: Any,
             rename: Callable[[str], str]) -> Callable[[], None]:
    """fn, its 400 and the unenforced keywords it adds named by rename."""
    def run() -> None:
        before = len(req.unenforced)
        try:
            fn()
        except ApiError as e:
            if e.param is None or not _CHAT_TOOL.match(e.param):
                raise
            e.message, e.param = rename(e.message), rename(e.param)
            raise
        req.unenforced[before:] = [rename(u) for u in req.unenforced[before:]]
    return run


_CHAT_TOOL = re.compile(r"tools\[(\d+)\]\.function(?:\.(parameters|name|description))?")


# What req.constraint is while its grammar waits for req.compiles: some JSON, to be written.
PENDING = grammar.Constraint(kind="json_schema")


def force_tools(req: Any) -> None:
    """The constraint of a forced tool choice over req.tools, compiled by req.compiles."""
    req.constraint = PENDING
    req.compiles.append(lambda: _force_tools(req))


def _force_tools(req: Any) -> None:
    """Each tool's parameters as the grammar can enforce them (what it cannot is listed in
    req.unenforced), compiled."""
    enforced = []
    for i, t in enumerate(req.tools):
        fn = t["function"]
        if req.tool_choice == "function" and fn["name"] != req.tool_name:
            enforced.append(t)
            continue
        param = f"tools[{i}].function.parameters"
        r = reduced(_parameters(fn, param), param)
        req.unenforced += _located(param, r)
        enforced.append({"type": "function", "function": {**fn, "parameters": r.schema}})
    # The JSON form, checked here; the neuron writes it in the model's format (forward.py),
    # from the same reduced schemas (tool_grammar reduces them as enforceable() does).
    function = req.tool_name if req.tool_choice == "function" else ""
    req.constraint = grammar.json_schema(tool_grammar.calls_schema(
        enforced, function or "", req.parallel_tool_calls))
    _check(req.constraint, "tools")
    try:  # the XML format's grammar asks most of the schemas (raw-text values)
        _check(tool_grammar.forced("qwen3_xml", enforced, function or "",
                                   req.parallel_tool_calls), "tools")
    except grammar.GrammarError as e:
        raise bad_request(f"`tools`: {e}", "tools") from None


def _parameters(fn: dict[str, Any], param: str) -> dict[str, Any]:
    """The function's whole parameters schema as a forced call writes it (an object's:
    tool_grammar.object_parameters), what the reply is checked against."""
    try:
        return tool_grammar.object_parameters(fn)
    except grammar.GrammarError as e:
        raise bad_request(f"`{param}`: {e}", param) from None


def _located(param: str, r: grammar.Reduced) -> list[str]:
    """r.dropped with the request's param in front (`tools[2].function.parameters.x: not`)."""
    return [param + d.removeprefix("(root)") if d.startswith("(root)") else f"{param}.{d}"
            for d in r.dropped]


def reduced(schema: Any, param: str) -> grammar.Reduced:
    """grammar.enforceable(schema), or the 400 naming param for a schema wrong in itself."""
    try:
        return grammar.enforceable(schema)
    except grammar.GrammarError as e:
        raise bad_request(f"`{param}`: the schema cannot be used for constrained decoding: {e}",
                          param) from None


def tool_dicts(tools: list[Any]) -> list[dict[str, Any]]:
    """Chat's `tools` (request_model.Tool) as the template renders them."""
    return [{"type": "function", "function": _function_dict(t.function)} for t in tools]


def _function_dict(f: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        d["description"] = f.description
    d["parameters"] = f.parameters if f.parameters is not None else \
        {"type": "object", "properties": {}}
    return d


def _response_format(b: ChatBody, req: Any, caps: RequestCaps) -> None:
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
        constrain_to_schema(req, schema if schema is not None else {"type": "object"},
                            "response_format.json_schema.schema", caps)
        req.response_schema_name = fmt.json_schema.name
        return
    _check(req.constraint, "response_format")


def constrain_to_schema(req: Any, schema: Any, param: str,
                        caps: RequestCaps = DEFAULT_CAPS) -> None:
    """The output is JSON valid against `schema` (as far as the grammar enforces it; the
    rest is listed in req.unenforced and checked after generation). Checks the caps; the
    compiling is left to req.compiles."""
    SchemaBudget(caps).take(schema, param)
    req.response_schema = schema
    req.constraint = PENDING
    req.compiles.append(lambda: _constrain(req, schema, param))


def _constrain(req: Any, schema: Any, param: str) -> None:
    r = reduced(schema, param)
    req.unenforced += _located(param, r)
    req.constraint = grammar.json_schema(r.schema)
    _check(req.constraint, param)


def calls_or_answer(req: Any) -> bool:
    """Tools are offered under auto beside a structured answer: the output is calls of the
    tools or that answer (helexa/tool_grammar.py calls_or_answer, built by the neuron in
    the model's call format)."""
    return req.tool_choice == "auto" and bool(req.tools) and req.constraint is not None \
        and req.constraint.kind in ("json_schema", "json_object")


def reply_violations(req: Any, content: str, calls: list[dict[str, str]]) -> list[str]:
    """Where a finished reply breaks the schemas whose keywords the grammar did not enforce
    (empty when it enforced them all, or the reply keeps to them)."""
    if not req.unenforced:
        return []
    if req.tool_choice in ("required", "function"):
        params = {}
        for t in req.tools:  # the forced ones passed object_parameters at the request
            with contextlib.suppress(grammar.GrammarError):
                params[t["function"]["name"]] = tool_grammar.object_parameters(t["function"])
        return [f"{c['name']}: {v}" for c in calls if c["name"] in params
                for v in schema_check.json_violations(c["arguments"], params[c["name"]])]
    if req.response_schema is not None and not calls:  # calls instead of the answer
        return schema_check.json_violations(content, req.response_schema)
    return []


def _check(c: grammar.Constraint, param: str) -> None:
    try:
        grammar.check(c)
    except grammar.GrammarError as e:
        raise bad_request(f"`{param}`: the schema cannot be used for constrained decoding: {e}",
                          param) from None


def call_arguments(text: str, param: str, repaired: list[str]) -> str:
    """An earlier call's arguments as the JSON object text the neuron takes: the client's
    text where it is one (blank: none); where a call cut short by max_tokens left a prefix
    of one, the object it began (cut_calls.py), with param added to repaired; else a 400
    naming param, the field as the client sent it; so is text nested deeper than a body may
    be (json_depth.py: it would overflow the recursion of json.loads or the template)."""
    if json_depth_error(text.encode()) is not None:
        raise bad_request(f"`{param}` nests JSON deeper than {MAX_JSON_DEPTH} levels, the "
                          "limit (arrays and objects inside one another)", param)
    try:
        args = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        args = cut_calls.repair(text)
        if args is not None:
            repaired.append(param)
            return json.dumps(args)
    if not isinstance(args, dict):
        raise bad_request(f"`{param}` must be a JSON object, as text (or a call cut short: "
                          f"the start of one)", param)
    return text


def tool_calls_json(calls: list[Any], param: str, repaired: list[str]) -> str:
    """An assistant message's tool calls as the JSON the neuron's template input takes;
    arguments must be a JSON object's text (templates iterate them: `arguments|items`),
    blank meaning none, or the start of one (`call_arguments`). param names the message
    (`messages[i]`)."""
    return json.dumps([{"id": c.id, "type": "function", "function": {
        "name": c.function.name, "arguments": call_arguments(
            c.function.arguments, f"{param}.tool_calls[{j}].function.arguments", repaired)}}
        for j, c in enumerate(calls)])
