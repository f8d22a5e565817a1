"""Tool calls back out of a model's answer text: one parser per format, streaming.

Each parser is fed the answer text as it comes and returns the text that is
plain content plus `CallPiece`s: the first piece of a call carries its
`index`, `id` and `name`, later pieces more of its `arguments` — the shape of
OpenAI's streamed `delta.tool_calls` and of Anthropic's `input_json_delta`.
`whole_calls` folds pieces into complete calls for replies that do not stream.

- `hermes` (Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  anywhere in the answer. Once `{"name": "...", "arguments": ` has arrived
  the arguments stream as they are written, holding back only what may be
  the closing `}` and tag; a call that does not start that way is parsed
  whole at its closing tag, and one that is not JSON stays text. Models
  write raw newlines and tabs inside the arguments' strings, which JSON
  forbids: those go out escaped (`StrictJson`), so a client that parses
  arguments strictly (the SDKs, codex, Claude Code) reads them. Arguments
  written as a JSON string holding an object (double-encoded; llama3_json's
  too) are that object, sent whole when the call closes (`_object_text`).
- `llama3_json`: the answer is `{"name", "parameters"}` (several joined by
  `;`), parsed when the answer ends; any other answer is text.
- `qwen3_xml` (Qwen3.5, Qwen3-Coder): xml_tool_parser.py.
- `json_args` (a named tool_choice on a model with no call format): the
  answer, constrained to the function's arguments, streams as them;
  `llama3_args` is the same inside a llama3_json call's head and closing `}`.
- `json_list` (tool_choice required on a model with no call format): the
  answer, constrained to a list of `{"name", "arguments"}`, is parsed when it
  ends; cut short by max_tokens, its whole calls and the last one's partial
  arguments are calls still.

A call cut short (max_tokens) whose JSON is whole, only its closing tag
missing, is a call. One cut inside its JSON before any piece of it went out
(a reply that does not stream is fed whole, with `final`) stays text, as the
model wrote it, unless the choice was forced (`forced`: tool_choice required
or a named function): then the output is calls and never text, the last one
with the arguments written so far, and the finish reason says `length`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from helexa.router.json_depth import loads
from helexa.tool_grammar import llama3_head

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def call_id() -> str:
    return "call_" + os.urandom(12).hex()


def held(buf: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of buf[start:] that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf) - start), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


@dataclass
class CallPiece:
    index: int
    arguments: str = ""
    id: str | None = None  # set on a call's first piece
    name: str | None = None  # set on a call's first piece


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
_SIGNIFICANT = re.compile(r'["\\\x00-\x1f]')


class StrictJson:
    """JSON text fed piece by piece, with the control characters inside its strings
    escaped (`\\n`, `\\t`, `\\u0001`); outside strings they are whitespace or errors, and
    stay as written."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False  # the last character was a backslash inside a string

    def __call__(self, text: str) -> str:
        out, pos, i = [], 0, 0
        if self.escaped and text:  # the character a backslash in the last piece escapes
            self.escaped, i = False, 1
        while (m := _SIGNIFICANT.search(text, i)) is not None:
            ch, i = m.group(), m.end()
            if ch == '"':
                self.in_string = not self.in_string
            elif not self.in_string:
                continue
            elif ch == "\\":
                if i < len(text):
                    i += 1
                else:
                    self.escaped = True
            else:
                out += [text[pos:m.start()], _ESCAPES.get(ch) or f"\\u{ord(ch):04x}"]
                pos = i
        return "".join(out) + text[pos:] if out else text


def whole_calls(pieces: list[CallPiece]) -> list[dict[str, str]]:
    """[{"id", "name", "arguments"}] from the pieces, in index order."""
    calls: dict[int, dict[str, str]] = {}
    for p in pieces:
        c = calls.setdefault(p.index, {"id": "", "name": "", "arguments": ""})
        c["id"] = p.id or c["id"]
        c["name"] = p.name or c["name"]
        c["arguments"] += p.arguments
    return [calls[i] for i in sorted(calls)]


class ToolParser:
    """No tools: everything is content. tool_name: a named choice's function; tools:
    the request's tools (OpenAI's shape), whose schemas type the XML format's values."""

    def __init__(self, tool_name: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.tool_name = tool_name
        self.num_calls = 0
        self.forced = False  # the grammar forced calls: a cut call stays a call
        self._buf = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        return text, []

    def _start(self, name: str, arguments: str = "") -> CallPiece:
        self.num_calls += 1
        return CallPiece(self.num_calls - 1, arguments, call_id(), name)

    def _parsed(self, body: str, key: str = "arguments") -> CallPiece | None:
        """A whole call `{"name", key}` as one piece, or None when it is not one."""
        try:
            obj = loads(body, strict=False)  # models write raw newlines in strings
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args: Any = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            return self._start(obj["name"], _object_text(args) or args)
        return self._start(obj["name"], json.dumps(args))


class HermesParser(ToolParser):
    def __init__(self, tool_name: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tool_name, tools)
        self._in_call = False
        self._streaming: CallPiece | None = None  # the call whose arguments are streaming
        self._lead = False  # its arguments have not begun (whitespace may come first)
        self._sent = ""  # the arguments of the streaming call sent so far, as written
        self._strict = StrictJson()  # its arguments as they go out
        self._quoted = False  # they are a JSON string: read whole, as the object it holds

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        self._buf += text
        content, pieces = "", []
        while True:
            if self._in_call:
                done, piece, text_part = self._call(final)
                content += text_part
                if piece is not None:
                    pieces.append(piece)
                if not done:
                    return content, pieces
                continue
            i = self._buf.find(CALL_OPEN)
            # a forced reply is calls only: a next call's tag cut at the end is not text
            keep = held(self._buf, CALL_OPEN) if not final or self.forced else 0
            end = i if i >= 0 else len(self._buf) - keep
            text_part, self._buf = self._buf[:end], self._buf[end:]
            if not (self.num_calls and not text_part.strip()):  # the gaps between calls
                content += text_part
            if i < 0:
                self._buf = "" if final else self._buf
                return content, pieces
            self._buf, self._in_call = self._buf[len(CALL_OPEN):], True

    def _call(self, final: bool) -> tuple[bool, CallPiece | None, str]:
        """Advance the open call: (whether it closed, a piece to send or None, text that
        turned out not to be a call)."""
        j = self._buf.find(CALL_CLOSE)
        if self._streaming is None and j < 0:
            if final:
                return self._cut()
            head = _HERMES_HEAD.match(self._buf)
            if head is not None:  # stream the arguments from here on
                self._streaming = self._start(json.loads(f'"{head.group(1)}"'))
                self._buf, self._lead, self._sent = self._buf[head.end():], True, ""
                self._strict = StrictJson()
                return False, self._streaming, ""
            return False, None, ""
        if self._streaming is None:  # closed before its head was seen: parse it whole
            body, self._buf = self._buf[:j], self._buf[j + len(CALL_CLOSE):]
            self._in_call = False
            piece = self._whole(body)
            return True, piece, "" if piece is not None else CALL_OPEN + body + CALL_CLOSE
        if self._lead:  # the whitespace between the head and the arguments
            self._buf = self._buf.lstrip()
            if not self._buf and j < 0 and not final:
                return False, None, ""
            self._lead, self._quoted = False, self._buf.startswith('"')
            j = self._buf.find(CALL_CLOSE)
        index = self._streaming.index
        if self._quoted and j < 0 and not final:
            return False, None, ""
        if j >= 0 or final:
            end = j if j >= 0 else len(self._buf) - held(self._buf, CALL_CLOSE)
            args = self._buf[:end].rstrip()
            # the call's own }: always before its closing tag; in a call cut short
            # (max_tokens) only when the arguments before it are whole JSON already
            if args.endswith("}") and (j >= 0 or _is_json(self._sent + args[:-1])):
                args = args[:-1].rstrip()
            self._buf = self._buf[end + len(CALL_CLOSE):] if j >= 0 else ""
            self._in_call, self._streaming = False, None
            args = (self._quoted and _unquoted(args)) or self._strict(args)
            return True, CallPiece(index, args) if args else None, ""
        keep = held(self._buf, CALL_CLOSE)
        safe = self._buf[:len(self._buf) - keep].rstrip()
        safe = safe[:-1] if safe.endswith("}") else safe  # may be the call's own }
        self._buf = self._buf[len(safe):]
        self._sent += safe
        return False, CallPiece(index, self._strict(safe)) if safe else None, ""

    def _whole(self, body: str) -> CallPiece | None:
        """A whole call's body as one piece, its arguments as written (as a stream sends
        them), or None when it is not one."""
        piece = self._parsed(body)
        head = _HERMES_HEAD.match(body)
        if piece is not None and head is not None:
            args = body[head.end():].rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args
            piece.arguments = (args.startswith('"') and _unquoted(args)) or StrictJson()(args)
        return piece

    def _cut(self) -> tuple[bool, CallPiece | None, str]:
        """The output ended inside a call none of which went out yet."""
        raw, self._buf, self._in_call = self._buf, "", False
        body = raw[:len(raw) - held(raw, CALL_CLOSE)].rstrip()
        piece = self._whole(body)  # only the closing tag is missing: a call
        if piece is not None or not self.forced:  # else text, as the model wrote it
            return True, piece, "" if piece is not None else CALL_OPEN + raw
        head = _HERMES_HEAD.match(body)
        if head is None:  # cut before its name was whole: nothing to call, and never text
            return True, None, ""
        return True, self._start(json.loads(f'"{head.group(1)}"'),
                                 StrictJson()(body[head.end():])), ""


class Llama3JsonParser(ToolParser):
    def __init__(self, tool_name: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tool_name, tools)
        self._plain: bool | None = None

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        if self._plain:
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if self._plain is None and head:
            self._plain = not head.startswith(("{", "<|python_tag|>"))
            if self._plain:
                out, self._buf = self._buf, ""
                return out, []
        if not final:
            return "", []
        body, self._buf = self._buf.strip().removeprefix("<|python_tag|>"), ""
        pieces = [self._parsed(part, "parameters") for part in body.split(";") if part.strip()]
        found = [p for p in pieces if p is not None]
        if found and len(found) == len(pieces):
            return "", found
        self.num_calls = 0
        return body, []


class ForcedArgsParser(ToolParser):
    """The answer is one call's arguments, after `prefix` and before `suffix` where the
    format wraps them (the grammar wrote both exactly)."""

    prefix, suffix = "", ""
    _skip = 0  # prefix characters still to drop

    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        pieces = []
        if not self.num_calls and (text or final):
            pieces.append(self._start(self.tool_name or ""))
            self._skip = len(self.prefix)
        self._buf += text
        skip = min(self._skip, len(self._buf))
        self._buf, self._skip = self._buf[skip:], self._skip - skip
        keep = 0 if final else min(len(self.suffix), len(self._buf))
        args, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if final and self.suffix:
            args = args.removesuffix(self.suffix)
        if args:
            pieces.append(CallPiece(0, args))
        return "", pieces


class Llama3ArgsParser(ForcedArgsParser):
    def __init__(self, tool_name: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tool_name, tools)
        self.prefix, self.suffix = llama3_head(tool_name or ""), "}"


class ForcedListParser(ToolParser):
    def feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        self._buf += text
        if not final:
            return "", []
        body, self._buf = self._buf, ""
        try:
            items = loads(body)
        except ValueError:
            return self._cut(body)
        pieces = [self._parsed(json.dumps(i)) for i in items] if isinstance(items, list) else []
        found = [p for p in pieces if p is not None]
        if found and len(found) == len(pieces):
            return "", found
        self.num_calls = 0
        return body, []


    def _cut(self, body: str) -> tuple[str, list[CallPiece]]:
        """A list the output budget cut short: its whole calls, and the last one's name with
        the arguments written so far (finish_reason says length), never the JSON as text:
        an agent would take that for its answer."""
        pieces: list[CallPiece] = []
        decoder, i = json.JSONDecoder(), body.find("[") + 1
        while 0 < i < len(body):
            while i < len(body) and body[i] in " \n\t,":
                i += 1
            try:
                item, i = decoder.raw_decode(body, i)
            except (ValueError, RecursionError):  # not whole, or nested past Python's limit
                head = _FORCED_HEAD.match(body, i)
                if head is not None:
                    pieces.append(self._start(json.loads(f'"{head.group(1)}"'),
                                              body[head.end():]))
                break
            piece = self._parsed(json.dumps(item))
            if piece is not None:
                pieces.append(piece)
        if pieces or body.lstrip().startswith("["):
            return "", pieces
        return body, []


def _object_text(value: str) -> str | None:
    """Arguments a model wrote as a JSON string holding the object (double-encoded, as
    some do): that object's JSON text; None where the string holds no object."""
    try:
        obj = loads(value, strict=False)
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def _unquoted(text: str) -> str | None:
    """_object_text of the JSON string text is (`"{\\"a\\": 1}"`), or None."""
    try:
        value = loads(text, strict=False)
    except ValueError:
        return None
    return _object_text(value) if isinstance(value, str) else None


def _is_json(text: str) -> bool:
    try:
        loads(text, strict=False)
    except ValueError:
        return False
    return True


# A forced call's head as the grammar writes it (compact, name first).
_FORCED_HEAD = re.compile(r'\{"name":"((?:[^"\\]|\\.)*)","arguments":')

PARSERS: dict[str, type[ToolParser]] = {
    "none": ToolParser, "hermes": HermesParser, "llama3_json": Llama3JsonParser,
    "json_args": ForcedArgsParser, "llama3_args": Llama3ArgsParser,
    "json_list": ForcedListParser}
