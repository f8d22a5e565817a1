"""Output constraints (structured output, forced tool calls) as llguidance grammars.

One rule, one owner: this module alone turns a request's constraint (a JSON
schema, any JSON object, a regex or a Lark grammar) into the grammar text the
engine's matchers run (helexa/neuron/engine/grammar.py), and checks it. The router
calls `check` so a schema the library cannot serve is a 400 naming the
problem before any neuron sees it; the neuron calls `grammar_text` again when
it builds the request (text, under a millisecond; the engine compiles it into
a matcher off its step loop, seconds for a large schema: engine/grammar.py).

JSON is generated compact (no whitespace between tokens), and an object
schema that lists `properties` without saying `additionalProperties` gets
`additionalProperties: false` (as OpenAI's strict mode requires and
xgrammar's strict mode assumes): a model, above all a weak one, that may add
free whitespace or keys of its own can loop on them until its tokens run out.

Not every JSON Schema keyword can be enforced token by token: `enforceable`
drops the ones the library does not implement (`UNENFORCED_KEYWORDS`, a
`format` outside `FORMATS`, a `pattern` it cannot compile) and says which
it dropped; the JSON the grammar then produces is still valid for every
other keyword, and the router checks the reply against the whole schema
after generation (helexa/router/schema_check.py). docs/api.md has the table.

What is computed for a schema is cached per principal (helexa/principal_cache.py): a
caller's repeated schema compiles once, and no key can time whether another sent it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import msgspec

from helexa.principal_cache import per_principal

Kind = Literal["json_schema", "json_object", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "lark")
# The JSON compiler's options: compact separators, no whitespace runs.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says what is wrong."""


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must follow: `source` is the schema's JSON text, the regex or the
    Lark grammar ("" for json_object)."""

    kind: Kind
    source: str = ""


# Keywords llguidance refuses to compile ("Unimplemented keys"): they constrain how values relate
# to each other or to other schemas, which a left-to-right grammar cannot enforce.
UNENFORCED_KEYWORDS = frozenset({
    "propertyNames", "uniqueItems", "not", "if", "then", "else", "contains", "minContains",
    "maxContains", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef", "$recursiveAnchor"})
# The string formats the grammar enforces; any other (`binary`, `int64`, `byte`, `password`,
# `uri-reference`, ...) is dropped and the string left free.
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uuid", "uri", "unknown"})
_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLES = ("items", "additionalProperties")
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")


@dataclass
class Reduced:
    """A schema as the grammar can enforce it, and the keywords dropped to get there (as
    `path: keyword`, e.g. `properties.tags: uniqueItems`)."""

    schema: Any
    dropped: list[str] = field(default_factory=list)

    @property
    def keywords(self) -> list[str]:
        """The dropped keywords, each once, in order."""
        return list(dict.fromkeys(d.rpartition(": ")[2] for d in self.dropped))


def enforceable(schema: Any) -> Reduced:
    """The schema without what the grammar library cannot enforce; raises GrammarError for a
    schema that is wrong in itself (an unknown type, a dangling `$ref`)."""
    out = Reduced(schema)
    extra: set[str] = set()  # keywords a newer or older library also refuses
    formats: set[str] = set()
    for _ in range(8):
        out = Reduced(None)
        out.schema = _reduce(schema, "", out.dropped, extra, formats)
        try:
            check(json_schema(out.schema))
            return out
        except GrammarError as e:
            keys = _UNIMPLEMENTED.search(str(e))
            fmt = _UNKNOWN_FORMAT.search(str(e))
            if keys:
                extra |= {k.strip().strip('"') for k in keys.group(1).split(",")}
            elif fmt:
                formats.add(fmt.group(1).strip('"`,.'))
            else:
                raise
    return out


def _reduce(s: Any, path: str, dropped: list[str], extra: set[str], formats: set[str]) -> Any:
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    where = path or "(root)"
    for k, v in s.items():
        if k == "not" and (v is True or v == {}) and not path:
            # Every value matches `{}`, so none matches `not {}`: at the root no output can
            # be right (deeper, it is the idiom that forbids an optional key).
            raise GrammarError(f"`not {json.dumps(v)}` at its root allows no value at all")
        if k in UNENFORCED_KEYWORDS or k in extra:
            dropped.append(f"{where}: {k}")
        elif k == "format" and isinstance(v, str) and (v not in FORMATS or v in formats) \
                and s.get("type") != "integer" and s.get("type") != "number":
            dropped.append(f"{where}: format {v}")
        elif k == "pattern" and isinstance(v, str) and not _regex_ok(v):
            dropped.append(f"{where}: pattern")
        elif k in _MAPS and isinstance(v, dict):
            out[k] = {n: _reduce(sub, f"{path}.{k}.{n}".lstrip("."), dropped, extra, formats)
                      for n, sub in v.items()}
        elif k in _LISTS and isinstance(v, list):
            out[k] = [_reduce(sub, f"{path}.{k}[{i}]".lstrip("."), dropped, extra, formats)
                      for i, sub in enumerate(v)]
        elif k in _SINGLES and isinstance(v, dict):
            out[k] = _reduce(v, f"{path}.{k}".lstrip("."), dropped, extra, formats)
        else:
            out[k] = v
    return out


@per_principal(1024)
def _regex_ok(pattern: str) -> bool:
    try:
        check(Constraint(kind="regex", source=pattern))
        return True
    except GrammarError:
        return False


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
    """Raise GrammarError naming the problem when the constraint cannot be served: it does
    not compile, or what it forces never ends."""
    _refuse_endless(_grammar(c.kind, c.source))


# Rounds of forced bytes followed before a grammar counts as finite; each round is one
# stretch with no choice in it, so a real schema ends or branches in a few.
_FORCED_ROUNDS = 64


@per_principal(256, 64 * 2**20)
def _refuse_endless(grammar: str) -> None:
    """Raise GrammarError when the grammar forces an endless output, like a schema whose
    required property is the schema itself (`{"a": {"a": ...`): it compiles, but no finite
    value satisfies it, and the engine's matcher fails on the first token (llguidance gives
    up following the forced tokens), or one that allows nothing at all, like a `$ref` that
    leads only to itself (the engine would stop at once with an empty, invalid reply).
    Follows the forced bytes on a byte-level matcher: the
    same parser, no model tokenizer needed (~10 ms where it fails, well under 1 ms where
    it does not)."""
    import llguidance

    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    for _ in range(_FORCED_ROUNDS):
        forced = m.compute_ff_bytes()
        if not forced or m.is_error() or not m.consume_tokens(list(forced)):
            break
    if m.is_error():
        raise GrammarError("no finite value satisfies it (what it requires nests without end: "
                           f"{m.get_error().splitlines()[0]})")
    if not m.is_accepting():  # where the forced bytes end, some byte must be allowed
        m.compute_bitmask()
        if m.is_error():  # none is (NoExtensionBias): the engine would stop with nothing
            raise GrammarError("no value satisfies it (nothing it allows can be written: "
                               "references that lead only to each other, for one)")


@lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer("byte")  # token id = byte value


@per_principal(256, 64 * 2**20)
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
            grammar = m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
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
