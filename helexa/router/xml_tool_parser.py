"""Qwen3.5 / Qwen3.6 / Qwen3-Coder XML tool calls back out of the answer text, streaming.

The format (`qwen3_xml`; helexa/tool_grammar.py writes its grammar for forced choices):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    value
    </parameter>
    </function>
    </tool_call>

Values become the types of the tool's JSON schema (`tool_grammar.value_types`,
which the grammar reads too): a parameter that is only ever a string is its raw
text (the newline after the opening tag and the one before the closing tag
are markup); otherwise JSON is tried, then a boolean or null word in JSON's or
Python's spelling (Qwen3.5's template renders `True`), else the raw text stays
a string. The arguments stream as JSON: `{"key": "` as soon as a string
parameter opens, then its text as the model writes it (holding back only
what may start `</parameter>` and the newline before it), other values when
their parameter closes, `}` when the function closes.

Calls may follow text and each other (whitespace between calls is dropped);
text between parameters is dropped; a `<tool_call>` not followed by
`<function=` stays text. A call cut short (max_tokens) before any piece of it
was handed out is text, as the model wrote it (a reply that does not stream
is fed whole, so there it always is), unless the choice was forced (`forced`:
then the output is calls, never text); once pieces have streamed, or when
forced, the call keeps the arguments written so far and the finish reason
says `length`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from helexa.router.json_depth import loads
from helexa.router.tool_parsers import CALL_OPEN, CallPiece, ToolParser, held
from helexa.tool_grammar import type_of, value_types

CALL_CLOSE = "</tool_call>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
_FUNCTION_HEAD = re.compile(r"\s*<function=([^>\n]*)>")
_SPACE = re.compile(r"\s*")
_OUR_TAG = re.compile("<(?=parameter=|/function>)")
_WORDS: dict[str, dict[str, Any]] = {"boolean": {"true": True, "false": False},
                                     "null": {"null": None, "none": None}}
TEXT = frozenset({"string"})  # the types of a value that is only ever raw text
_MORE, _GO = "more", "go"  # what a state step says: wait for more text, or go on


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def convert(text: str, types: frozenset[str] | None) -> Any:
    """A parameter's raw text as a value of the schema's types (None: any)."""
    if types == TEXT:
        return text
    try:
        value = loads(text, parse_constant=_no_constants)  # too deep: text, as not JSON
    except ValueError:
        pass
    else:
        kind = type_of(value)
        if types is None or kind in types or (kind == "integer" and "number" in types):
            return value
    word = text.strip().lower()
    for kind, words in _WORDS.items():
        if types is not None and kind in types and word in words:
            return words[word]
    return text


class Qwen3XmlParser(ToolParser):
    def __init__(self, tool_name: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tool_name, tools)
        self._schemas = {t["function"]["name"]: t["function"].get("parameters")
                         for t in tools or [] if "function" in t}
        self._state = "text"  # text | function | params | value | end
        self._pos = 0  # the cursor: self._buf before it is read
        self._raw: list[str] = []  # the open call as written (it may still turn out to be text)
        self._pending: list[CallPiece] = []  # the open call's pieces not yet handed out
        self._sent = False  # pieces of the open call went out: it stays a call
        self._schema: Any = None  # the open call's parameters schema
        self._num_args = 0
        self._types: frozenset[str] | None = None  # the open parameter's value types
        self._head = ""  # the open parameter's `"key": ` (values that do not stream)
        self._value: list[str] = []  # the open parameter's text so far (values that do not stream)
        self._started = False  # the open parameter's first character has been seen
        self._content: list[str] = []  # this feed's text
        self._out: list[CallPiece] = []  # this feed's pieces of calls that stay calls

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        # The buffer is read through a cursor (`_pos`) and cut once a feed: a step that
        # copied the rest of the buffer made a whole reply's stray `<` quadratic (120,000
        # of them inside a function held the router's loop for 1.8 s).
        self._buf += text
        self._content, self._out = [], []
        while True:
            if self._state == "text":
                buf, pos = self._buf, self._pos
                i = buf.find(CALL_OPEN, pos)
                # a forced reply is calls only: a next call's tag cut at the end is not text
                keep = held(buf, CALL_OPEN, pos) if not final or self.forced else 0
                end = i if i >= 0 else len(buf) - keep
                part = buf[pos:end]
                gap = self.num_calls and (not part or part.isspace())  # between calls
                if gap and i < 0 and not final:
                    break  # a gap after a call, or the start of text after it: wait
                self._pos = end
                if not gap:
                    self._content.append(part)
                if i < 0:
                    self._pos = len(buf) if final else self._pos
                    break
                self._pos, self._raw, self._state = end + len(CALL_OPEN), [CALL_OPEN], \
                    "function"
                self._pending, self._sent = [], False
                continue
            step = getattr(self, "_in_" + self._state)(final)
            if step == _MORE:
                break
        self._buf, self._pos = self._buf[self._pos:], 0
        self._sent = self._sent or bool(self._pending)
        out, self._out, self._pending = self._out + self._pending, [], []
        return "".join(self._content), out

    def _rest(self, n: int | None = None) -> str:
        """The unread buffer, or its first n characters."""
        return self._buf[self._pos:] if n is None else self._buf[self._pos:self._pos + n]

    def _skip_space(self) -> int:
        """The count of whitespace characters at the cursor."""
        m = _SPACE.match(self._buf, self._pos)
        return m.end() - self._pos if m is not None else 0

    # ---------------------------------------------------------------- the states

    def _in_function(self, final: bool) -> str:
        """After <tool_call>: `<function=NAME>` must follow, else the call is text."""
        m = _FUNCTION_HEAD.match(self._buf, self._pos)
        if m is not None:
            self._take(m.end() - self._pos)
            name = m.group(1).strip()
            self._pending.append(self._start(name))
            self._schema, self._num_args, self._state = self._schemas.get(name), 0, "params"
            return _GO
        at = self._pos + self._skip_space()
        rest = self._buf[at:at + len(FUNCTION_OPEN)]  # enough to tell
        if not final and (len(self._buf) - at <= len(FUNCTION_OPEN)
                          and FUNCTION_OPEN.startswith(rest)
                          or rest == FUNCTION_OPEN and self._buf.find("\n", at) < 0):
            return _MORE
        if self.forced and final:  # cut before its name: nothing to call, never text
            self._pos, self._state = len(self._buf), "text"
            return _GO
        self._content.append("".join(self._raw))  # not a call: text; what follows is read again
        self._state = "text"
        return _GO

    def _in_params(self, final: bool) -> str:
        """Between parameters: the next `<parameter=KEY>`, or `</function>`."""
        gap = self._skip_space()
        at = self._pos + gap
        buf = self._buf
        j = buf.find(">", at) if buf.startswith(PARAM_OPEN, at) else -1
        if j >= 0:
            self._take(j + 1 - self._pos)
            self._open_param(buf[at + len(PARAM_OPEN):j].strip())
            return _GO
        if buf.startswith(FUNCTION_CLOSE, at):
            self._take(gap + len(FUNCTION_CLOSE))
            self._piece("}" if self._num_args else "{}")
            self._state = "end"
            return _GO
        left = len(buf) - at
        if not left or PARAM_OPEN.startswith(buf[at:at + len(PARAM_OPEN)]) \
                or left <= len(FUNCTION_CLOSE) and FUNCTION_CLOSE.startswith(buf[at:]):
            return self._cut() if final else _MORE
        # stray text inside the function: dropped up to the next tag of ours, or to a `<` in
        # the buffer's last characters that may begin one (each stray `<` a step of its own
        # was 2 µs of CPU apiece)
        m = _OUR_TAG.search(buf, at + 1)
        k = buf.find("<", max(at + 1, len(buf) - len(FUNCTION_CLOSE)))
        ends = [e for e in (m.start() if m is not None else -1, k) if e >= 0]
        self._take((min(ends) if ends else len(buf)) - self._pos)
        return _GO

    def _in_value(self, final: bool) -> str:
        if not self._started:
            if self._pos == len(self._buf):
                return self._cut() if final else _MORE
            if self._buf.startswith("\n", self._pos):  # the markup's newline after <parameter=KEY>
                self._take(1)
            self._started = True
        j = self._buf.find(PARAM_CLOSE, self._pos)
        if j >= 0:
            text = self._take(j - self._pos)
            self._take(len(PARAM_CLOSE))
            self._close_param(text.removesuffix("\n"))
            self._state = "params"
            return _GO
        if final:
            return self._cut()
        safe = len(self._buf) - held(self._buf, PARAM_CLOSE, self._pos) - self._pos
        if safe and self._buf.startswith("\n", self._pos + safe - 1):
            safe -= 1  # may be the newline before </parameter>
        self._add_text(self._take(safe))
        return _MORE

    def _in_end(self, final: bool) -> str:
        """After </function>: its </tool_call> (a call that lacks it still counts)."""
        at = self._pos + self._skip_space()
        rest = self._buf[at:at + len(CALL_CLOSE) + 1]  # enough to tell
        if not final and CALL_CLOSE.startswith(rest):
            return _MORE
        if rest.startswith(CALL_CLOSE) or CALL_CLOSE.startswith(rest):
            self._take(at - self._pos + min(len(rest), len(CALL_CLOSE)))
        self._out, self._pending, self._state = self._out + self._pending, [], "text"
        return _GO

    # -------------------------------------------------------------- the pieces

    def _take(self, n: int) -> str:
        taken = self._buf[self._pos:self._pos + n]
        self._pos += len(taken)
        self._raw.append(taken)
        return taken

    def _piece(self, arguments: str) -> None:
        if arguments:
            self._pending.append(CallPiece(self.num_calls - 1, arguments))

    def _streams(self) -> bool:
        return self._types == TEXT

    def _open_param(self, key: str) -> None:
        head = ("{" if not self._num_args else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._num_args += 1
        self._types, self._value, self._started = self._param_types(key), [], False
        self._state = "value"
        if self._streams():
            self._piece(head + '"')
        else:
            self._head = head

    def _add_text(self, text: str) -> None:
        if self._streams():
            self._piece(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value.append(text)

    def _close_param(self, text: str) -> None:
        if self._streams():
            self._piece(json.dumps(text, ensure_ascii=False)[1:-1] + '"')
        else:
            value = convert("".join(self._value) + text, self._types)
            self._piece(self._head + json.dumps(value, ensure_ascii=False))

    def _param_types(self, key: str) -> frozenset[str] | None:
        schema = self._schema
        if not isinstance(schema, dict):
            return None
        props = schema.get("properties")
        if isinstance(props, dict) and key in props:
            return value_types(props[key], schema)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return value_types(extra, schema)
        # A key the schema does not know is text, as vLLM and llama.cpp read it.
        return TEXT if props else None

    def _cut(self) -> str:
        """The output ended inside the call."""
        if not self._sent and not self.forced:  # nothing went out: text, as written
            self._content.append("".join(self._raw) + self._rest())
            self._pending, self.num_calls = [], self.num_calls - 1
        elif self._state == "value" and self._streams():
            self._add_text(self._rest())  # the arguments as far as they were written
        self._pos, self._state = len(self._buf), "text"
        return _GO
