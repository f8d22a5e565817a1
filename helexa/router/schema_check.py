"""A reply checked against the whole JSON schema, after generation.

Constrained decoding enforces what helexa.grammar can enforce; the keywords
it dropped (`uniqueItems`, `not`, `if`/`then`, `propertyNames`, ...) are
checked here once the reply is whole, so a violation is logged and said in
the reply's headers instead of passing unseen. This is a small validator of
the JSON Schema keywords agents' tool lists use (draft 2020-12 and
draft-07 spellings), not a complete one: a keyword it does not know passes,
and `format` is not checked (the grammar enforced the formats it knows).

Python's `re` backtracks, and holds the interpreter while it does: `(a+)+$`
against forty `a`s and a `b` runs for minutes. A pattern whose repeated group
itself repeats or branches (`(a+)+`, `(a|aa)*`: `backtracks()`) is therefore
not run here; the grammar enforced it if it could compile it, and the
violation list says it went unchecked otherwise.

The walk (and json.loads) recurses once per level of the reply, and again per `$ref`
and combinator followed, so a reply nested deeper than a request body may be
(json_depth.py, 128 levels) is not read, and a walk that still runs out of Python's
recursion (a schema that refers to itself without the reply going deeper) stops there:
the violation list says so either way, where a RecursionError would have ended the
check unseen.
"""

from __future__ import annotations

import json
import re
from typing import Any

from helexa.principal_cache import per_principal
from helexa.router.json_depth import MAX_JSON_DEPTH, json_depth_error

_TYPES: dict[str, Any] = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


TOO_DEEP = f"$: not checked (the JSON nests deeper than {MAX_JSON_DEPTH} levels)"
TOO_DEEP_TO_WALK = "$: not checked to its end (the reply and its schema nest too deeply to walk)"


def violations(instance: Any, schema: Any) -> list[str]:
    """What in `instance` breaks `schema`, as `path: reason` lines (empty: it is valid); a
    walk too deep for Python's recursion ends with a line saying it stopped."""
    out: list[str] = []
    try:
        _check(instance, schema, schema, "$", out)
    except RecursionError:
        out.append(TOO_DEEP_TO_WALK)
    return out


def json_violations(text: str, schema: Any) -> list[str]:
    """violations() of a JSON text; text that is not JSON is one violation, and so is text
    nested too deep to read (json.loads recurses per level too)."""
    if json_depth_error(text.encode()) is not None:
        return [TOO_DEEP]
    try:
        instance = json.loads(text)
    except ValueError as e:
        return [f"$: not JSON ({e})"]
    return violations(instance, schema)



def _is_type(v: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or \
            isinstance(v, float) and v.is_integer()
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    py = _TYPES.get(t)
    return py is not None and isinstance(v, py) and not (py is not bool and isinstance(v, bool))


def _resolve(ref: str, root: Any) -> Any:
    node = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _check(v: Any, s: Any, root: Any, path: str, out: list[str]) -> None:
    if s is False:
        out.append(f"{path}: no value is allowed here")
    if not isinstance(s, dict):
        return
    if isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
        _check(v, _resolve(s["$ref"], root), root, path, out)
    t = s.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not any(_is_type(v, x) for x in types):
            out.append(f"{path}: expected {' or '.join(map(str, types))}")
            return
    if "enum" in s and v not in s["enum"]:
        out.append(f"{path}: not one of the enum values")
    if "const" in s and v != s["const"]:
        out.append(f"{path}: not the const value")
    _combinators(v, s, root, path, out)
    if isinstance(v, dict):
        _object(v, s, root, path, out)
    elif isinstance(v, list):
        _array(v, s, root, path, out)
    elif isinstance(v, str):
        _string(v, s, path, out)
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        _number(v, s, path, out)


def _valid(v: Any, s: Any, root: Any, path: str) -> bool:
    sub: list[str] = []
    _check(v, s, root, path, sub)
    return not sub


def _combinators(v: Any, s: dict[str, Any], root: Any, path: str, out: list[str]) -> None:
    for sub in s.get("allOf", []):
        _check(v, sub, root, path, out)
    if "anyOf" in s and not any(_valid(v, sub, root, path) for sub in s["anyOf"]):
        out.append(f"{path}: matches none of anyOf")
    if "oneOf" in s and sum(_valid(v, sub, root, path) for sub in s["oneOf"]) != 1:
        out.append(f"{path}: matches not exactly one of oneOf")
    if "not" in s and _valid(v, s["not"], root, path):
        out.append(f"{path}: matches the schema under `not`")
    if "if" in s:
        branch = "then" if _valid(v, s["if"], root, path) else "else"
        if branch in s:
            _check(v, s[branch], root, path, out)


def _object(v: dict[str, Any], s: dict[str, Any], root: Any, path: str, out: list[str]) -> None:
    props = s.get("properties", {})
    for k in s.get("required", []):
        if k not in v:
            out.append(f"{path}: `{k}` is required")
    patterns = s.get("patternProperties", {})
    extra = s.get("additionalProperties", s.get("unevaluatedProperties", True))
    for k, val in v.items():
        if k in props:
            _check(val, props[k], root, f"{path}.{k}", out)
        matched = [p for p in patterns if _search(p, k) is True]
        for p in matched:
            _check(val, patterns[p], root, f"{path}.{k}", out)
        if k not in props and not matched:
            if extra is False:
                out.append(f"{path}: `{k}` is not allowed")
            elif isinstance(extra, dict):
                _check(val, extra, root, f"{path}.{k}", out)
        if "propertyNames" in s:
            _check(k, s["propertyNames"], root, f"{path}.{k} (name)", out)
    for k, needs in s.get("dependentRequired", {}).items():
        if k in v:
            out += [f"{path}: `{n}` is required with `{k}`" for n in needs if n not in v]
    for k, sub in s.get("dependentSchemas", {}).items():
        if k in v:
            _check(v, sub, root, path, out)
    if "minProperties" in s and len(v) < s["minProperties"]:
        out.append(f"{path}: fewer than {s['minProperties']} properties")
    if "maxProperties" in s and len(v) > s["maxProperties"]:
        out.append(f"{path}: more than {s['maxProperties']} properties")


def _array(v: list[Any], s: dict[str, Any], root: Any, path: str, out: list[str]) -> None:
    prefix = s.get("prefixItems", [])
    for i, (item, sub) in enumerate(zip(v, prefix, strict=False)):
        _check(item, sub, root, f"{path}[{i}]", out)
    items = s.get("items")
    if isinstance(items, (dict, bool)):
        for i in range(len(prefix), len(v)):
            _check(v[i], items, root, f"{path}[{i}]", out)
    if "minItems" in s and len(v) < s["minItems"]:
        out.append(f"{path}: fewer than {s['minItems']} items")
    if "maxItems" in s and len(v) > s["maxItems"]:
        out.append(f"{path}: more than {s['maxItems']} items")
    if s.get("uniqueItems") and len({json.dumps(x, sort_keys=True) for x in v}) != len(v):
        out.append(f"{path}: items are not unique")
    if "contains" in s:
        hits = sum(_valid(x, s["contains"], root, path) for x in v)
        if hits < s.get("minContains", 1):
            out.append(f"{path}: too few items match `contains`")
        if "maxContains" in s and hits > s["maxContains"]:
            out.append(f"{path}: too many items match `contains`")


def _string(v: str, s: dict[str, Any], path: str, out: list[str]) -> None:
    if "minLength" in s and len(v) < s["minLength"]:
        out.append(f"{path}: shorter than {s['minLength']}")
    if "maxLength" in s and len(v) > s["maxLength"]:
        out.append(f"{path}: longer than {s['maxLength']}")
    if isinstance(s.get("pattern"), str):
        found = _search(s["pattern"], v)
        if found is False:
            out.append(f"{path}: does not match the pattern")
        elif found is None and backtracks(s["pattern"]):
            out.append(f"{path}: the pattern was not checked (it can backtrack without end)")


def _search(pattern: str, text: str) -> bool | None:
    """Whether `pattern` is found in `text`; None when it is not run (it can backtrack
    without end) or cannot be read (a pattern Python cannot read is not the reply's fault)."""
    compiled = _compiled(pattern)
    return None if compiled is None else compiled.search(text) is not None


@per_principal(256)
def _compiled(pattern: str) -> re.Pattern[str] | None:
    if backtracks(pattern):
        return None
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return None


@per_principal(256)
def backtracks(pattern: str) -> bool:
    """Whether a group that repeats (`*`, `+`, `{n,}`) holds a repetition or a branch of
    its own (`(a+)+`, `(\\w+\\s?)*`, `(a|aa)+`): the shapes that make a backtracking matcher
    take exponential time. One pass over the text."""
    inner: list[bool] = []  # per open group: does it hold a quantifier or a `|`?
    closed = False  # the last thing read was a group holding one
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            closed = False
            continue
        if c == "[":  # a class: its brackets and quantifier-looking characters are literal
            j = pattern.find("]", i + 2)
            i = len(pattern) if j < 0 else j + 1
            closed = False
            continue
        if closed and (c in "*+" or (c == "{" and re.match(r"\{\d*,\d*\}", pattern[i:]))):
            return True
        closed = False
        if c == "(":
            inner.append(False)
            if pattern.startswith("?", i + 1):
                i += 1  # `(?:`, `(?P<n>`: the `?` is syntax, not a quantifier
        elif c == ")" and inner:
            closed = inner.pop()
            if inner:
                inner[-1] = inner[-1] or closed
        elif c in "*+?{|" and inner:
            inner[-1] = True
        i += 1
    return False


def _number(v: float, s: dict[str, Any], path: str, out: list[str]) -> None:
    for key, bad in (("minimum", v < s.get("minimum", v)), ("maximum", v > s.get("maximum", v)),
                     ("exclusiveMinimum", isinstance(s.get("exclusiveMinimum"), (int, float))
                      and v <= s["exclusiveMinimum"]),
                     ("exclusiveMaximum", isinstance(s.get("exclusiveMaximum"), (int, float))
                      and v >= s["exclusiveMaximum"])):
        if bad:
            out.append(f"{path}: breaks {key} {s[key]}")
    m = s.get("multipleOf")
    if isinstance(m, (int, float)) and m > 0 and abs(v / m - round(v / m)) > 1e-9:
        out.append(f"{path}: not a multiple of {m}")
