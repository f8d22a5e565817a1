"""A model's text back into its parts: thought, answer and tool calls, streaming or not.

One `OutputParser` per choice is fed the text deltas the neuron sends and
returns `Parts` (reasoning text, content text, finished tool calls). Both
front ends (OpenAI chat, Anthropic messages) encode from these parts.

- Thought (`reasoning_parser` "think", from the model's Watch status):
  `<think>...</think>` at the start of the output is reasoning; when the
  client asked to think, the prompt may have opened the thought, so the
  output starts inside it.
- Tool calls, one parser per format (`tool_parser` from Watch):
  "hermes" (Qwen): `<tool_call>{"name", "arguments"}</tool_call>` anywhere
  in the answer; "llama3_json": the answer is one JSON object
  `{"name", "parameters"}` (or several joined by `;`). A forced choice
  (`required` or a named function) was constrained to JSON by the engine
  (agent_request.py) whatever the model's own format: a list of
  `{"name", "arguments"}`, or the named function's arguments.
Text that only might be the start of a marker is held back until it is
known, so no marker ever reaches the client.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return "call_" + os.urandom(12).hex()


@dataclass
class Parts:
    """What one feed produced."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}


def _held(buf: str, marker: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class OutputParser:
    def __init__(self, *, reasoning_parser: str = "", starts_in_thought: bool = False,
                 tool_mode: str = "none", tool_name: str | None = None) -> None:
        """tool_mode: none | hermes | llama3_json | json_list | json_args (tool_name)."""
        self.think = reasoning_parser == "think"
        self.phase = ("thinking" if starts_in_thought else "opening") if self.think else "answer"
        self.tool_mode = tool_mode
        self.tool_name = tool_name
        self._buf = ""  # thought text not yet emitted (a marker may be starting)
        self._answer = ""  # answer text not yet emitted
        self._in_call = False
        self._whole = tool_mode in ("json_list", "json_args")  # parse the answer at the end
        self.num_calls = 0
        self._after_thought = False

    # ------------------------------------------------------------------ feeding

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
        keep = 0 if final else _held(self._buf, THINK_CLOSE)
        out.reasoning += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return ""

    def _answer_part(self, text: str, out: Parts, final: bool) -> None:
        self._answer += text
        if self._whole or self.tool_mode == "llama3_json":
            self._json_answer(out, final)
        elif self.tool_mode == "hermes":
            self._hermes(out, final)
        else:
            out.content += self._answer
            self._answer = ""

    def _hermes(self, out: Parts, final: bool) -> None:
        while True:
            if self._in_call:
                j = self._answer.find(CALL_CLOSE)
                if j < 0:
                    if final:  # an unclosed call is text, as the model wrote it
                        out.content += CALL_OPEN + self._answer
                        self._answer = ""
                    return
                body, self._answer = self._answer[:j], self._answer[j + len(CALL_CLOSE):]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    out.content += CALL_OPEN + body + CALL_CLOSE
                else:
                    out.calls.append(call)
                continue
            i = self._answer.find(CALL_OPEN)
            if i >= 0:
                text = self._answer[:i]
                out.content += text if not (self.num_calls and not text.strip()) else ""
                self._answer, self._in_call = self._answer[i + len(CALL_OPEN):], True
                continue
            keep = 0 if final else _held(self._answer, CALL_OPEN)
            text = self._answer[:len(self._answer) - keep]
            out.content += text if not (self.num_calls and not text.strip()) else ""
            self._answer = self._answer[len(self._answer) - keep:]
            return

    def _json_answer(self, out: Parts, final: bool) -> None:
        if self.tool_mode == "llama3_json" and not self._whole:
            head = self._answer.lstrip()
            if not head:
                return
            if not head.startswith(("{", "<|python_tag|>")):
                self.tool_mode = "none"  # plain text: no call
                out.content += self._answer
                self._answer = ""
                return
            self._whole = True
        if not final:
            return
        text, self._answer = self._answer, ""
        calls = self._parse_whole(text)
        if calls is None:
            out.content += text
        else:
            out.calls.extend(calls)

    # ------------------------------------------------------------------ formats

    def _call(self, body: str, key: str = "arguments") -> dict[str, str] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(key, obj.get("parameters", obj.get("arguments", {})))
        self.num_calls += 1
        return {"id": call_id(), "name": obj["name"],
                "arguments": args if isinstance(args, str) else json.dumps(args)}

    def _parse_whole(self, text: str) -> list[dict[str, str]] | None:
        text = text.strip()
        if self.tool_mode == "json_args":
            try:
                json.loads(text)
            except ValueError:
                return None
            self.num_calls += 1
            return [{"id": call_id(), "name": self.tool_name or "", "arguments": text}]
        if self.tool_mode == "json_list":
            try:
                items = json.loads(text)
            except ValueError:
                return None
            calls = [self._call(json.dumps(i)) for i in items] if isinstance(items, list) else []
            return _all_or_none(calls)
        # llama3_json: one object, or several joined by ";"
        text = text.removeprefix("<|python_tag|>")
        return _all_or_none([self._call(part, key="parameters")
                             for part in text.split(";") if part.strip()])


def _all_or_none(calls: list[dict[str, str] | None]) -> list[dict[str, str]] | None:
    """The calls when every part parsed as one, else None (the text stays text)."""
    found = [c for c in calls if c is not None]
    return found if found and len(found) == len(calls) else None


def parser_for(req: object, tool_parser: str, reasoning_parser: str) -> OutputParser:
    """The parser of one chat request (openai_api.ParsedRequest) on a model's formats."""
    choice = getattr(req, "tool_choice", "none")
    mode = {"required": "json_list", "function": "json_args"}.get(choice)
    if mode is None:
        mode = (tool_parser or "hermes") if choice == "auto" else "none"
    return OutputParser(reasoning_parser=reasoning_parser,
                        starts_in_thought=bool(getattr(req, "thinking_requested", False))
                        and getattr(req, "constraint", None) is None,
                        tool_mode=mode, tool_name=getattr(req, "tool_name", None))
