"""The Responses API's `custom` tools: free-text input, offered to the model as a function.

A custom tool (`{"type": "custom", "name", "description", "format"}`; codex's
freeform `apply_patch` is one) takes text, not JSON. Chat templates render
only function schemas, so this module, the one place that decides it,
renders a custom tool as a function with one required string parameter,
`input`, whose description states the format (docs/api.md,
"`POST /v1/responses` (OpenAI Responses)", its custom tools):

- `format` `text` (or none): any text;
- `grammar` with `syntax: regex`: the parameter's `pattern` is the whole
  input anchored (`^(?:...)$`), so a forced call is held to it in every
  call format (helexa.grammar enforces `pattern`);
- `grammar` with `syntax: lark`: the parameter carries the grammar under
  tool_grammar.LARK_KEY; a forced call is held to it where the model's
  format writes the value as raw text (`qwen3_xml`), and not in the JSON
  formats, whose string escapes a Lark grammar cannot describe.

A grammar that does not compile is a 400 naming `tools[i].format.definition`
with llguidance's reason; before it is compiled (`compile_check`, on the
router's compile pool: agent_request.py), one over its cap is a 400 naming
the cap: a regex longer than `limits.max_pattern_chars`, a Lark grammar of
more than `limits.max_grammar_bytes` (llguidance's Lark compile grows faster
than the grammar: 8,000 alternatives, 79 KB, took 0.23 CPU s; 40,000, 429 KB,
5 s). A call of the function comes back as a
`custom_tool_call` whose `input` is the string (`input_of`); an earlier
`custom_tool_call` in `input` goes back to the template as the same
function's call (`arguments_of`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from helexa import grammar
from helexa.router.errors import bad_request
from helexa.router.json_depth import loads
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps
from helexa.tool_grammar import LARK_KEY

INPUT = "input"
_SYNTAX: dict[str, grammar.Kind] = {"lark": "lark", "regex": "regex"}


def format_of(fmt: Any, where: str, caps: RequestCaps = DEFAULT_CAPS) -> dict[str, Any]:
    """The tool's format as OpenAI echoes it, its caps checked (not yet compiled:
    `compile_check`); a 400 naming the field otherwise. where: the tool as the client listed
    it (`tools[3]`)."""
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request(f"`{where}.format` must be an object", f"{where}.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"type": "text"}
    if kind != "grammar":
        raise bad_request(f"`{where}.format.type` must be `text` or `grammar`, not "
                          f"{json.dumps(kind)}", f"{where}.format.type")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if not isinstance(syntax, str) or syntax not in _SYNTAX:  # a list: unhashable, a 500
        raise bad_request(f"`{where}.format.syntax` must be `lark` or `regex`, not "
                          f"{json.dumps(syntax)}", f"{where}.format.syntax")
    if not isinstance(definition, str) or not definition.strip():
        raise bad_request(f"`{where}.format.definition` is required: the grammar's text",
                          f"{where}.format.definition")
    if syntax == "regex" and len(definition) > caps.max_pattern_chars:
        raise bad_request(f"`{where}.format.definition`: a regex of {len(definition)} "
                          f"characters is longer than {caps.max_pattern_chars}, the limit "
                          f"(limits.max_pattern_chars)", f"{where}.format.definition")
    size = len(definition.encode())
    if syntax == "lark" and size > caps.max_grammar_bytes:
        raise bad_request(f"`{where}.format.definition`: a grammar of {size} bytes is more "
                          f"than {caps.max_grammar_bytes}, the limit (limits.max_grammar_bytes)",
                          f"{where}.format.definition")
    return {"type": "grammar", "syntax": syntax, "definition": definition}


def compile_check(fmt: dict[str, Any], where: str) -> None:
    """Compile a grammar format (from format_of) to check it; a 400 naming the field with
    llguidance's reason where it cannot be used."""
    if fmt["type"] != "grammar":
        return
    syntax, definition = fmt["syntax"], fmt["definition"]
    try:
        grammar.check(grammar.Constraint(kind=_SYNTAX[syntax], source=definition))
    except grammar.GrammarError as e:
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise bad_request(f"`{where}.format.definition`: the {syntax} grammar cannot be "
                          f"used: {reason}", f"{where}.format.definition") from None


def parameters(fmt: dict[str, Any]) -> dict[str, Any]:
    """The function parameters a custom tool of this (checked) format is offered with."""
    prop: dict[str, Any] = {"type": "string"}
    if fmt["type"] == "text":
        prop["description"] = "The input, as free text (not JSON)."
    elif fmt["syntax"] == "regex":
        prop["description"] = ("The input, as text the whole of which matches this regular "
                               "expression: " + fmt["definition"])
        prop["pattern"] = f"^(?:{fmt['definition']})$"
    else:
        prop["description"] = ("The input, as text in the language of this Lark grammar:\n"
                               + fmt["definition"])
        prop[LARK_KEY] = fmt["definition"]
    return {"type": "object", "properties": {INPUT: prop}, "required": [INPUT],
            "additionalProperties": False}


def arguments_of(text: str) -> str:
    """An earlier custom call's input as the function call's arguments."""
    return json.dumps({INPUT: text}, ensure_ascii=False)


def input_of(arguments: str) -> str:
    """A call's arguments (JSON text) as the custom tool's input: the `input` string (of a
    call cut short: as much of it as was written); a model that named its one argument
    otherwise, or wrote the arguments as one JSON string (freeform, as OpenAI's models
    call custom tools), gets that string; anything else is the arguments' text."""
    try:
        args = loads(arguments, strict=False)  # a raw newline in a string, as models write
    except ValueError:
        partial = partial_input(arguments)
        if partial is None and ('{"' + INPUT + '":"').startswith("".join(arguments.split())):
            return ""  # cut before the input's string opened: none of it was written
        return arguments if partial is None else partial
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        if isinstance(args.get(INPUT), str):
            return str(args[INPUT])
        if len(args) == 1 and isinstance(next(iter(args.values())), str):
            return str(next(iter(args.values())))
    return arguments


def partial_input(arguments: str) -> str | None:
    """The decoded part of `input` in arguments written so far (`{"input": "abc\\` gives
    `abc`; arguments that are one JSON string: of that string), or None before its string
    opens; what streams as input deltas."""
    p = PartialInput()
    p.feed(arguments)
    return p.decoded() if p.opened else None


_PLAIN = re.compile(r'[^"\\]*')  # a run of a JSON string's characters that need no decoding
_HEAD = '{"' + INPUT + '":"'  # the arguments' head before the input's text, less whitespace
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "/": "/", "r": "\r", "b": "\b",
            "f": "\f"}
_SPACE_BEFORE = (0, 1, len(_HEAD) - 2, len(_HEAD) - 1)  # where in _HEAD whitespace may come


class PartialInput:
    """A custom call's arguments as they stream, decoded as they come: each `feed` reads
    only what it adds, so a call of n tokens costs O(n), not the O(n^2) of decoding the
    whole arguments again at every delta (an 8,000-token input took 22 CPU s of the
    router's loop that way)."""

    def __init__(self) -> None:
        self.text = ""  # the arguments so far
        self.opened = False  # the input's string has opened: what follows is its text
        self._head = 0  # how much of the head (_HEAD; "" for a bare string) has been read
        self._bare = False
        self._dead = False  # not arguments of this shape, or an escape JSON cannot decode
        self._at = 0  # where in `text` decoding goes on
        self._pieces: list[str] = []

    def decoded(self) -> str:
        """The input decoded so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def feed(self, more: str) -> str:
        """Take the arguments' next text; return what it adds to the decoded input."""
        self.text += more
        if not self.opened and not self._dead:
            self._read_head()
        if not self.opened or self._dead:
            return ""
        added = self._decode()
        self._pieces.extend(added)
        return "".join(added)

    def _read_head(self) -> None:
        text, i = self.text, self._at
        while i < len(text) and not self.opened:
            c = text[i]
            i += 1
            if c.isspace() and self._head in _SPACE_BEFORE:
                continue  # JSON's whitespace: before the brace, around the key and colon
            if self._head == 0 and c == '"':
                self._bare = self.opened = True
            elif c == _HEAD[self._head]:
                self._head += 1
                self.opened = self._head == len(_HEAD)
            else:
                self._dead = True
                break
        self._at = i

    def _decode(self) -> list[str]:
        text, i, out = self.text, self._at, []
        while i < len(text):
            plain = _PLAIN.match(text, i)
            end = plain.end() if plain else i
            if end > i:
                out.append(text[i:end])
                i = end
            if i >= len(text) or text[i] == '"':  # the input's end: nothing after it counts
                self._dead = i < len(text)
                break
            step = 6 if text[i + 1:i + 2] == "u" else 2
            if step == 6 and "d800" <= text[i + 2:i + 6].lower() < "dc00":
                step = 12  # a surrogate pair's first half waits for its second
            if i + step > len(text):
                break  # an escape cut short waits for the rest of it
            short = _ESCAPES.get(text[i + 1]) if step == 2 else None
            try:
                out.append(short if short is not None
                           else json.loads('"' + text[i:i + step] + '"', strict=False))
            except ValueError:
                self._dead = True
                break
            i += step
        self._at = i
        return out
