"""A model's text back into its parts: thought, answer and tool calls, streaming or not.

One `OutputParser` per choice is fed the text deltas the neuron sends and
returns `Parts` (reasoning text, content text, tool-call pieces). Both
front ends (OpenAI chat, Anthropic messages) encode from these parts.

- Thought (`reasoning_parser` "think", from the model's Watch status):
  `<think>...</think>` at the start of the output is reasoning; when the
  prompt opened the thought (the neuron's first message says
  `thought_open`), the output starts inside it.
- Tool calls: the answer goes through the parser of the model's format
  (`tool_parser` from Watch: tool_parsers.py, xml_tool_parser.py). A forced
  choice (`required` or a named function) was constrained to calls in that
  same format (helexa/tool_grammar.py), so the same parser reads it; a model
  whose template teaches no format was constrained to JSON, read by the
  parser of that JSON.
Text that only might be the start of a marker is held back until it is
known, so no marker ever reaches the client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from helexa.router.tool_parsers import CALL_CLOSE, PARSERS, CallPiece, ToolParser, held
from helexa.router.xml_tool_parser import Qwen3XmlParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PARSERS: dict[str, type[ToolParser]] = {**PARSERS, "qwen3_xml": Qwen3XmlParser}


@dataclass
class Parts:
    """What one feed produced."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)  # tool calls, piece by piece


class OutputParser:
    def __init__(self, *, reasoning_parser: str = "", tool_mode: str = "none",
                 tool_name: str | None = None, tools: list[dict[str, Any]] | None = None,
                 forced: bool = False) -> None:
        """tool_mode: none | hermes | llama3_json | qwen3_xml | json_list | json_args or
        llama3_args (tool_name); tools: the request's, whose schemas type XML values;
        forced: the grammar forced calls (a call max_tokens cut is a call, never text)."""
        self.think = reasoning_parser == "think"
        self.phase = "opening" if self.think else "answer"
        self.tools = _PARSERS[tool_mode](tool_name, tools)
        self.tools.forced = forced
        self._buf = ""  # thought text not yet emitted (a marker may be starting)
        self._after_thought = False
        self._tail = ""  # the text fed so far, its last len(CALL_CLOSE) - 1 characters

    # ------------------------------------------------------------------ feeding

    def thought_opened(self) -> None:
        """The neuron says the prompt opened a thought: the output starts inside it."""
        if self.phase == "opening":
            self.phase = "thinking"

    def feed(self, text: str) -> Parts:
        out = Parts()
        answer = self._thought(text, out, final=False)
        self._answer_part(answer, out, final=False)
        return out

    def feed_in_order(self, text: str) -> list[Parts]:
        """feed(), a piece at a time, each piece ending where a call closes (a closing tag
        begun in an earlier feed included): one Parts holds no order, and text after a
        call in the same delta (coalesced deltas, a speculative step's run) follows it.
        The event streams, whose items or blocks have an order, read these."""
        seen = self._tail + text
        cuts = [m.end() - len(self._tail) for m in re.finditer(re.escape(CALL_CLOSE), seen)
                if m.end() > len(self._tail)]
        self._tail = seen[-(len(CALL_CLOSE) - 1):]
        bounds = [0, *cuts, len(text)]
        return [self.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)
                if b > a or b == len(text)]

    def finish(self, text: str = "") -> Parts:
        """The output's end; text: its last piece, or a whole reply that did not stream
        (a call that reply leaves open is then text, as the model wrote it)."""
        out = Parts()
        answer = self._thought(text, out, final=True)
        self._answer_part(answer, out, final=True)
        return out

    def _thought(self, text: str, out: Parts, final: bool) -> str:
        """Route text through the thought; return what belongs to the answer."""
        if self.phase == "answer":
            if self._after_thought:  # the newlines after </think> are the marker's
                text = text.lstrip("\n")
                self._after_thought = not text
            return text
        self._buf += text
        if self.phase == "opening":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self.phase = head[len(THINK_OPEN):], "thinking"
            elif THINK_OPEN.startswith(head) and not final:
                return ""  # may still become <think>
            else:
                self.phase, rest, self._buf = "answer", self._buf, ""
                return rest
        i = self._buf.find(THINK_CLOSE)
        if i >= 0:
            out.reasoning += self._buf[:i]
            rest = self._buf[i + len(THINK_CLOSE):].lstrip("\n")
            self._buf, self.phase, self._after_thought = "", "answer", not rest
            return rest
        keep = 0 if final else held(self._buf, THINK_CLOSE)
        out.reasoning += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return ""

    def _answer_part(self, text: str, out: Parts, final: bool) -> None:
        content, pieces = self.tools.feed(text, final)
        out.content += content
        out.calls += pieces


def parser_for(req: object, tool_parser: str, reasoning_parser: str) -> OutputParser:
    """The parser of one chat request (openai_api.ParsedRequest) on a model's formats."""
    choice = getattr(req, "tool_choice", "none")
    if choice in ("required", "function"):  # constrained to calls in the model's format
        mode = tool_parser or {"required": "json_list", "function": "json_args"}[choice]
        mode = "llama3_args" if (mode, choice) == ("llama3_json", "function") else mode
    else:
        mode = (tool_parser or "hermes") if choice == "auto" else "none"
    return OutputParser(reasoning_parser=reasoning_parser, tool_mode=mode,
                        tool_name=getattr(req, "tool_name", None),
                        tools=getattr(req, "tools", None),
                        forced=choice in ("required", "function"))
