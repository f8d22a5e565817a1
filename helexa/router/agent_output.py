"""A model's text back into its parts: thought, answer and tool calls, streaming or not.

One `OutputParser` per choice is fed the text deltas the neuron sends and
returns `Parts` (reasoning text, content text, tool-call pieces). Both
front ends (OpenAI chat, Anthropic messages) encode from these parts.

- Thought (`reasoning_parser` "think", from the model's Watch status):
  `<think>...</think>` at the start of the output is reasoning; when the
  prompt opened the thought (the neuron's first message says
  `thought_open`), the output starts inside it.
- Tool calls: the answer goes through the parser of the model's format
  (`tool_parser` from Watch, tool_parsers.py), or, for a forced choice
  (`required` or a named function) that the engine constrained to JSON
  whatever the model's own format (agent_request.py), the parser of that JSON.
Text that only might be the start of a marker is held back until it is
known, so no marker ever reaches the client.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helexa.router.tool_parsers import PARSERS, CallPiece, held

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Parts:
    """What one feed produced."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)  # tool calls, piece by piece


class OutputParser:
    def __init__(self, *, reasoning_parser: str = "",
                 tool_mode: str = "none", tool_name: str | None = None) -> None:
        """tool_mode: none | hermes | llama3_json | json_list | json_args (tool_name)."""
        self.think = reasoning_parser == "think"
        self.phase = "opening" if self.think else "answer"
        self.tools = PARSERS[tool_mode](tool_name)
        self._buf = ""  # thought text not yet emitted (a marker may be starting)
        self._after_thought = False

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

    def finish(self) -> Parts:
        out = Parts()
        answer = self._thought("", out, final=True)
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
    mode = {"required": "json_list", "function": "json_args"}.get(choice)
    if mode is None:
        mode = (tool_parser or "hermes") if choice == "auto" else "none"
    return OutputParser(reasoning_parser=reasoning_parser, tool_mode=mode,
                        tool_name=getattr(req, "tool_name", None))
