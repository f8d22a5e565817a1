"""Output constraints (structured output, forced tool calls) as llguidance grammars.

One rule, one owner: this module alone turns a request's constraint (a JSON
schema, any JSON object, a regex or a Lark grammar) into the grammar text the
engine's matchers run (helexa/neuron/engine/grammar.py), and checks it. The router
calls `check` so a schema the library cannot serve is a 400 naming the
problem before any neuron sees it; the neuron calls `grammar_text` again when
it builds the request (under a millisecond: llguidance builds its parser
lazily, per token, with no ahead-of-time compilation).

JSON is generated compact (no whitespace between tokens), and an object
schema that lists `properties` without saying `additionalProperties` gets
`additionalProperties: false` (as OpenAI's strict mode requires and
xgrammar's strict mode assumes): a model, above all a weak one, that may add
free whitespace or keys of its own can loop on them until its tokens run out.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Literal

import msgspec

Kind = Literal["json_schema", "json_object", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark")
# The JSON compiler's options: compact separators, no whitespace runs.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says what is wrong."""


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must follow: `source` is the schema's JSON text, the regex or the
    Lark grammar ("" for json_object)."""

    kind: Kind
    source: str = ""


def json_schema(schema: dict | bool) -> Constraint:
    return Constraint(kind="json_schema", source=json.dumps(strict(schema)))


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict(schema: Any) -> Any:
    """A copy of the schema whose objects with `properties` allow no other keys unless
    they say so."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(v) for v in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    if "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar for a constraint, checked; raises GrammarError."""
    return _grammar(c.kind, c.source)


def check(c: Constraint) -> None:
    """Raise GrammarError naming the problem when the constraint cannot be served."""
    _grammar(c.kind, c.source)


@lru_cache(maxsize=256)
def _grammar(kind: str, source: str) -> str:
    import llguidance

    m = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(source)
            except ValueError as e:
                raise GrammarError(f"the schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("the schema must be a JSON object")
            grammar = m.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        elif kind == "json_object":
            grammar = m.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            grammar = m.grammar_from_regex(source)
        elif kind == "lark":
            grammar = m.grammar_from_lark(source)
        else:
            raise GrammarError(f"unknown constraint kind `{kind}`")
    except (ValueError, TypeError) as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(str(e)) from None
    error = m.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())
    return grammar
