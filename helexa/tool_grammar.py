"""A forced tool choice as a grammar in the model's own call format.

`tool_choice: "required"`, a named function, or Anthropic's `any` / `tool`
constrain the output to calls. The neuron builds the grammar (agent.py) for
the format its chat template teaches (`tool_parser`), so a forced call is
written the way the model learned to write calls, and the router parses it
back with that format's parser (router/agent_output.py):

- `hermes`: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  several calls one per line;
- `llama3_json`: `{"name": "f", "parameters": {...}}`, several joined by `; `;
- `qwen3_xml` (Qwen3.5, Qwen3.6, Qwen3-Coder): `<tool_call>\\n<function=f>\\n`
  then one `<parameter=k>\\nvalue\\n</parameter>\\n` per argument, then
  `</function>\\n</tool_call>`, several calls one per line. A string value is
  its raw text (honouring enum/const, minLength/maxLength and pattern), a
  boolean or null is its word (either JSON's or Python's spelling, as
  templates render them), any other value JSON. Arguments come in the
  schema's property order, the required ones always;
- "" (a template that teaches no format): a JSON list of
  `{"name", "arguments"}` (required) or the arguments object (a named
  function), compact, as helexa.grammar writes JSON.

JSON inside a call uses tojson's separators (`, ` and `: `), as the
templates render earlier calls. Every schema goes through helexa.grammar's
`json_schema` first, so the calls follow the same schema rules as
`response_format`. `value_types` says which JSON types a parameter admits:
the XML parser reads it too, so grammar and parser agree on which values are
raw text.
"""

from __future__ import annotations

import json
from typing import Any

from helexa import grammar

FORMATS = ("hermes", "llama3_json", "qwen3_xml")
_TOJSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SEPARATOR = {"hermes": "\n", "llama3_json": "; ", "qwen3_xml": "\n"}
_PARAM_CLOSE = "\n</parameter>\n"
_HERMES_CLOSE = "}\n</tool_call>"
_XML_CLOSE = "</function>\n</tool_call>"
# Raw text that cannot close the parameter early (the parser ends a value at the first
# </parameter>); lazy, so the value ends at the first close the grammar allows.
_NO_CLOSE = r"~/(?s:.*)<\/parameter>(?s:.*)/"
_WORDS = {"boolean": ("true", "false", "True", "False"), "null": ("null", "None")}
LARK_KEY = "x-helexa-lark"


def for_template(tools: list[Any]) -> list[Any]:
    """The tools as the chat template renders them: without LARK_KEY (the grammar is in the
    parameter's description already)."""
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        if not isinstance(props, dict) or not any(
                isinstance(v, dict) and LARK_KEY in v for v in props.values()):
            out.append(t)
            continue
        clean = {k: {n: x for n, x in v.items() if n != LARK_KEY} if isinstance(v, dict) else v
                 for k, v in props.items()}
        out.append({**t, "function": {**fn, "parameters": {**fn["parameters"],
                                                           "properties": clean}}})
    return out


def calls_schema(tools: list[dict[str, Any]], function: str, parallel: bool) -> dict[str, Any]:
    """The JSON schema of a forced choice for a model with no call format of its own."""
    fns = [t["function"] for t in tools]
    if function:
        return _parameters(_named(fns, function))
    call = {"anyOf": [{"type": "object", "additionalProperties": False,
                       "required": ["name", "arguments"],
                       "properties": {"name": {"const": f["name"]},
                                      "arguments": _parameters(f)}} for f in fns]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def llama3_head(name: str) -> str:
    """What a llama3_json call writes before its arguments."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '


def forced(fmt: str, tools: list[dict[str, Any]], function: str,
           parallel: bool) -> grammar.Constraint:
    """The constraint of a forced choice in format fmt (one of FORMATS, or "" for none):
    calls of `function` only when it is set (then exactly one), else of any tool."""
    fns = [t["function"] for t in tools]
    if not fns:
        raise grammar.GrammarError("a forced tool choice needs at least one tool")
    if not fmt:
        return grammar.json_schema(calls_schema(tools, function, parallel))
    if fmt not in FORMATS:
        raise grammar.GrammarError(f"unknown tool-call format `{fmt}`")
    if function:
        fns, parallel = [_named(fns, function)], False
    return grammar.Constraint(kind="lark", source="\n".join(
        _calls_rules(fmt, fns, parallel, "start")) + "\n")


def calls_or_answer(fmt: str, tools: list[dict[str, Any]], parallel: bool,
                    answer: grammar.Constraint) -> grammar.Constraint:
    """Tools offered under tool_choice auto with a structured answer (Responses'
    `text.format`, chat's `response_format`): the output is calls in format fmt ("" reads
    as hermes, as the router parses calls under auto), or the answer, one JSON value of
    `answer` (a json_schema or json_object constraint). A call's arguments are any object:
    under auto a tool's schema is prompt text only, never compiled."""
    fns = [{"name": t["function"]["name"], "parameters": {"type": "object"}} for t in tools]
    if not fns:
        raise grammar.GrammarError("calls or an answer needs at least one tool")
    fmt = fmt or "hermes"
    if fmt not in FORMATS:
        raise grammar.GrammarError(f"unknown tool-call format `{fmt}`")
    schema: Any = json.loads(answer.source) if answer.kind == "json_schema" \
        else {"type": "object"}
    schema = {} if schema is True else schema
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": grammar.JSON_OPTIONS}
    rules = ["start: calls | answer", "answer: %json " + json.dumps(schema, ensure_ascii=False)]
    return grammar.Constraint(kind="lark", source="\n".join(
        rules + _calls_rules(fmt, fns, parallel, "calls")) + "\n")


def _calls_rules(fmt: str, fns: list[dict[str, Any]], parallel: bool, top: str) -> list[str]:
    """Rule `top`: one call of fns in format fmt, or several (parallel) one after another."""
    rules = [f"{top}: call ({json.dumps(_SEPARATOR[fmt])} call)*" if parallel
             else f"{top}: call", "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    for i, fn in enumerate(fns):
        rules += _call_rules(fmt, i, fn)
    return rules


def value_types(schema: Any, root: dict[str, Any]) -> frozenset[str] | None:
    """The JSON types a value of this schema may have (None: any); local $refs are
    followed into root's $defs / definitions."""
    if not isinstance(schema, dict):
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return value_types(target, root)
    if "const" in schema:
        return frozenset({type_of(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(type_of(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list):
        return frozenset(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found: set[str] = set()
            for sub in schema[key]:
                types = value_types(sub, root)
                if types is None:
                    return None
                found |= types
            return frozenset(found)
    return None


def type_of(value: Any) -> str:
    """The JSON type name of a Python value decoded from JSON."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null")


def _named(fns: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for f in fns:
        if f["name"] == name:
            return f
    raise grammar.GrammarError(f"no tool is named `{name}`")


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """The function's parameters as the grammar can enforce them (grammar.enforceable: the
    router reduced them the same way and lists what was dropped)."""
    reduced: dict[str, Any] = grammar.enforceable(object_parameters(fn)).schema
    return reduced


def object_parameters(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as a forced call writes them: an object's schema (a call's
    arguments are an object; the next turn sends them back as one). A schema without a
    `type` (`properties` and `required` only, as many clients write it) is an object's;
    one whose type admits no object is a GrammarError."""
    params: dict[str, Any] = fn.get("parameters") or {"type": "object", "properties": {}}
    kind = params.get("type")
    if kind is None or (isinstance(kind, list) and "object" in kind):
        return {**params, "type": "object"}
    if kind != "object":
        raise grammar.GrammarError(f"a function's arguments are an object; the parameters "
                                   f"of `{fn.get('name')}` are of type {json.dumps(kind)}")
    return params


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Any) -> str:
    """%json of a schema after helexa.grammar's rules, written as tojson writes it."""
    if schema is True or schema == {}:
        schema = {}
    checked = json.loads(grammar.json_schema(schema).source)
    if isinstance(checked, dict):
        checked["x-guidance"] = _TOJSON_STYLE
    return "%json " + json.dumps(checked, ensure_ascii=False)


def _call_rules(fmt: str, i: int, fn: dict[str, Any]) -> list[str]:
    name, params = fn["name"], _parameters(fn)
    if fmt == "hermes":
        head = '<tool_call>\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return [f"call_{i}: {_lit(head)} args_{i} {_lit(_HERMES_CLOSE)}",
                f"args_{i}: {_json_rule(params)}"]
    if fmt == "llama3_json":
        # the opening brace its own literal: one lexeme `{"name": ...` beside an answer's
        # %json (calls_or_answer) fails that JSON's first key in llguidance's lexer
        return [f"call_{i}: \"{{\" {_lit(llama3_head(name)[1:])} args_{i} \"}}\"",
                f"args_{i}: {_json_rule(params)}"]
    return _xml_rules(i, name, json.loads(grammar.json_schema(params).source))


def _xml_rules(i: int, name: str, params: Any) -> list[str]:
    root = params if isinstance(params, dict) else {}
    props = root.get("properties") if isinstance(root.get("properties"), dict) else {}
    required = set(root.get("required") or ())
    parts, rules = [], []
    for k, (key, sub) in enumerate(props.items()):
        rules += _param_rules(f"p_{i}_{k}", key, sub, root)
        parts.append(f"p_{i}_{k}" if key in required else f"p_{i}_{k}?")
    if root.get("additionalProperties", True) is not False:  # keys the schema leaves open
        rules += [f"extra_{i}: \"<parameter=\" PARAM_NAME_{i} \">\\n\" text_{i}",
                  f"PARAM_NAME_{i}: /[^<>\\n]+/",
                  f"text_{i}[lazy]: (/(?s:.*)/ & {_NO_CLOSE}) {_lit(_PARAM_CLOSE)}"]
        parts.append(f"extra_{i}*")
    head = f"<tool_call>\n<function={name}>\n"
    rules.insert(0, f"call_{i}: {_lit(head)} {' '.join(parts)} {_lit(_XML_CLOSE)}")
    return rules


def _param_rules(rule: str, key: str, schema: Any, root: dict[str, Any]) -> list[str]:
    head = _lit(f"<parameter={key}>\n")
    types = value_types(schema, root)
    sub = schema if isinstance(schema, dict) else {}
    choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
    if isinstance(sub.get(LARK_KEY), str) and types == frozenset({"string"}):
        return [f"{rule}: {head} {rule}_text {_lit(_PARAM_CLOSE)}",
                f"{rule}_text: %lark {{\n{sub[LARK_KEY]}\n}}"]
    if types is not None and "string" in types:
        if isinstance(choices, list) and all(isinstance(c, str) for c in choices):
            words = " | ".join(_lit(c) for c in choices)
            return [f"{rule}: {head} ({words}) {_lit(_PARAM_CLOSE)}"]
        return [f"{rule}: {head} {rule}_text", f"{rule}_text[lazy]: "
                f"({_text_regex(sub)} & {_NO_CLOSE}) {_lit(_PARAM_CLOSE)}"]
    if types is not None and len(types) == 1 and next(iter(types)) in _WORDS:
        words = " | ".join(_lit(w) for w in _WORDS[next(iter(types))])
        return [f"{rule}: {head} ({words}) {_lit(_PARAM_CLOSE)}"]
    value = dict(sub)
    for defs in ("$defs", "definitions"):  # the value's own schema keeps the root's $refs
        if defs in root and value:
            value.setdefault(defs, root[defs])
    return [f"{rule}: {head} {rule}_value {_lit(_PARAM_CLOSE)}",
            f"{rule}_value: {_json_rule(value)}"]


def _text_regex(schema: dict[str, Any]) -> str:
    """The raw text of a string parameter as a Lark regex: its pattern and its length
    bounds together (the intersection of the two regexes), as helexa.grammar's JSON
    enforces them on a quoted string."""
    pattern, low, high = schema.get("pattern"), schema.get("minLength"), schema.get("maxLength")
    parts = [_pattern_regex(pattern)] if isinstance(pattern, str) else []
    if isinstance(low, int) or isinstance(high, int):
        parts.append(f"/(?s:.){{{low if isinstance(low, int) else 0},"
                     f"{high if isinstance(high, int) else ''}}}/")
    return " & ".join(parts) or "/(?s:.*)/"


def _pattern_regex(pattern: str) -> str:
    """A JSON schema pattern as a Lark regex of the whole value. A pattern matches anywhere
    in the value unless anchored (`^` first, an unescaped `$` last), each alternative of
    its top level by itself, as llguidance reads a pattern in JSON; `\\d` and `\\w` are
    ASCII (ECMAScript's), as there."""
    import llguidance

    branches = []
    for branch in _alternatives(llguidance.regex_to_lark(pattern, "dw")):
        head = "" if branch.startswith("^") else "(?s:.*)"
        branch = branch.removeprefix("^")
        tail = "(?s:.*)"
        if branch.endswith("$") and _escapes_before(branch, len(branch) - 1) % 2 == 0:
            branch, tail = branch[:-1], ""
        branches.append(f"{head}(?:{branch}){tail}")
    return "/" + "|".join(branches) + "/"


def _escapes_before(text: str, at: int) -> int:
    """How many backslashes come right before text[at]."""
    n = 0
    while at - n > 0 and text[at - n - 1] == "\\":
        n += 1
    return n


def _alternatives(regex: str) -> list[str]:
    """The regex's top-level alternatives: split at each `|` outside a group, a class and
    an escape."""
    out, depth, in_class, start, i = [], 0, False, 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex[i + 1:i + 3].startswith("^]") or regex[i + 1:i + 2] == "]":
                i += 2 if regex[i + 1] == "]" else 3  # a leading `]` is a member
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            out.append(regex[start:i])
            start = i + 1
        i += 1
    return out + [regex[start:]]
