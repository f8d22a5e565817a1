"""An earlier tool call cut short by `max_tokens`, as agents send it back.

An OpenAI-style client (codex, the openai SDK's loops, langchain) keeps a call the
model was writing when `max_tokens` cut it with `arguments` as the text it
received (`{"path": "src/ma`), runs the tool (which reports the parse error as
its result) and sends that history back on every later turn. Refusing it would
end the session, so the router reads such text as the object it began
(`repair`):

- the pairs written whole are kept as written;
- a string value cut short is kept as the part received (`"src/ma"`: the model
  sees what it wrote, and the template renders the same text it generated), less
  an escape cut in the middle (`\\`, `\\u00`) and half a surrogate pair;
- a number cut short is kept where its digits are a number (`12` of `123`) and
  dropped where they are not yet one (`-`, `1.`, `1e`); a cut `true` / `false` /
  `null`, a cut key, and a key without its value are dropped;
- the open arrays and objects are closed.

Only text that is a prefix of a JSON object is read so: anything else (`[1, 2]`,
`"hello"`, `{"a" 1}`, a whole object with more after it, a raw control character
in a string, as json.loads refuses) stays a 400 naming the field, and so does
nesting deeper than a request body may (MAX_JSON_DEPTH, json_depth.py). The
repaired object goes to the neuron as JSON text (json.dumps: the same history
renders the same tokens every turn, so the prefix cache still hits). The result is deterministic and never raises.

Why not jiter's partial mode (pulled in by the openai and anthropic SDKs): it also
reads text that is no prefix of any JSON (`{"a": 1 2`, `{"a": "b"c`,
`{"a": 1.5.` and `{"a": 1} x` all parse, as `{"a": 1}` and `{"a": "b"}`), so
telling a cut call from garbage would need this scan anyway; the standard
library's json decodes each complete string and number here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from helexa.router.json_depth import MAX_JSON_DEPTH

_WS = re.compile(r"[ \t\n\r]*")
# A string as json.loads reads it (strict: no raw control character), closed or not.
_STRING = re.compile(r'"((?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*)(")?')
_ESCAPE_HEAD = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")  # an escape the text ended inside
_NUMBER_RUN = re.compile(r"[-+.0-9eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORD = re.compile(r"[a-zA-Z]+")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}
_DROP = object()  # a value the text ended before it meant anything


class _NotAPrefix(Exception):
    pass


def repair(text: str) -> dict[str, Any] | None:
    """The object a cut JSON object's text began, or None where text is no proper prefix of
    a JSON object (a whole object, with or without more after it, is None too)."""
    r = _Reader(text)
    try:
        if r.ended() or text[r.i] != "{":
            return None
        obj, closed = r.object(1)
    except _NotAPrefix:
        return None
    return None if closed else obj


class _Reader:
    """A JSON prefix read left to right; each value comes back with whether it was closed
    (an unclosed one ended the text, so everything around it is unclosed too)."""

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    def ended(self) -> bool:
        """Skips whitespace; True where the text has ended."""
        if self.i < len(self.s) and self.s[self.i] not in " \t\n\r":
            return False
        self.i = _WS.match(self.s, self.i).end()  # type: ignore[union-attr]
        return self.i >= len(self.s)

    def value(self, depth: int) -> tuple[Any, bool]:
        if self.ended():
            return _DROP, False
        c = self.s[self.i]
        if c == "{":
            return self.object(depth + 1)
        if c == "[":
            return self.array(depth + 1)
        if c == '"':
            return self.string()
        if c == "-" or "0" <= c <= "9":  # not isdigit(): `²` is no JSON number
            return self.number()
        return self.literal()

    def object(self, depth: int) -> tuple[dict[str, Any], bool]:
        if depth > MAX_JSON_DEPTH:
            raise _NotAPrefix
        self.i += 1
        out: dict[str, Any] = {}
        first = True
        while True:
            if self.ended():
                return out, False
            if self.s[self.i] == "}" and first:
                self.i += 1
                return out, True
            first = False
            if self.s[self.i] != '"':
                raise _NotAPrefix
            key, closed = self.string()
            if not closed or self.ended():
                return out, False
            if self.s[self.i] != ":":
                raise _NotAPrefix
            self.i += 1
            v, closed = self.value(depth)
            if v is not _DROP:
                out[key] = v
            if not closed or self.ended():
                return out, False
            if self.s[self.i] == "}":
                self.i += 1
                return out, True
            if self.s[self.i] != ",":
                raise _NotAPrefix
            self.i += 1

    def array(self, depth: int) -> tuple[list[Any], bool]:
        if depth > MAX_JSON_DEPTH:
            raise _NotAPrefix
        self.i += 1
        out: list[Any] = []
        first = True
        while True:
            if self.ended():
                return out, False
            if self.s[self.i] == "]" and first:
                self.i += 1
                return out, True
            first = False
            v, closed = self.value(depth)
            if v is not _DROP:
                out.append(v)
            if not closed or self.ended():
                return out, False
            if self.s[self.i] == "]":
                self.i += 1
                return out, True
            if self.s[self.i] != ",":
                raise _NotAPrefix
            self.i += 1

    def string(self) -> tuple[str, bool]:
        m = _STRING.match(self.s, self.i)
        assert m is not None  # it starts at a quote and may take no character
        if m.group(2):
            self.i = m.end()
            return json.loads(m.group()), True
        rest = self.s[m.end():]
        if rest and not _ESCAPE_HEAD.fullmatch(rest):
            raise _NotAPrefix  # a bad escape or a raw control character, not a cut
        self.i = len(self.s)
        got: str = json.loads('"' + m.group(1) + '"')
        if got and "\ud800" <= got[-1] <= "\udbff":
            got = got[:-1]  # half a surrogate pair: the character's other half was cut
        return got, False

    def number(self) -> tuple[Any, bool]:
        m = _NUMBER_RUN.match(self.s, self.i)
        assert m is not None  # it starts at `-` or a digit
        run, self.i = m.group(), m.end()
        if _NUMBER.fullmatch(run):
            try:
                return json.loads(run), True
            except ValueError:  # over int()'s 4,300 digits, as json.loads refuses it
                raise _NotAPrefix from None
        if self.i == len(self.s) and _NUMBER.fullmatch(run + "0"):
            return _DROP, False  # `-`, `1.`, `1e`, `1e+`: not a number yet
        raise _NotAPrefix

    def literal(self) -> tuple[Any, bool]:
        m = _WORD.match(self.s, self.i)
        if m is None:
            raise _NotAPrefix
        word, self.i = m.group(), m.end()
        if word in _LITERALS:
            return _LITERALS[word], True
        if self.i == len(self.s) and any(lit.startswith(word) for lit in _LITERALS):
            return _DROP, False
        raise _NotAPrefix
