"""System messages after the first, for a chat template that takes a system turn only at
the start.

OpenAI's chat API takes a `system` (or `developer`) message anywhere, and agents send them
mid-conversation (a framework's summary, a mode change). Many templates render one where
it stands (Qwen3's, Llama 3's); others refuse it (Qwen3.5's, the flagship's: "System
message must be at the beginning.", which failed the request) or drop it without a word.
For those, `fold` keeps the leading system messages as the one system turn and makes each
later one a `<system>` note where it stands: at the end of the user turn before it, else at
the start of the user message right after it, else a user turn of its own there (after an
assistant's calls, once their tool turns are done, so they stay together). The router
sends Anthropic's and Responses' later system messages as system turns where they stand
(helexa/router/anthropic_system.py, helexa/router/responses_input.py), so they come here
too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The later system message a template is tried with (Tokenizer.takes_later_system): text no
# real prompt holds, so seeing it rendered means the template rendered that message.
PROBE = "\u2063later system message\u2063"


def takes_later_system(render: Callable[[list[dict]], str]) -> bool:
    """Whether the template renders a system message after a user and an assistant turn,
    where it stands (`render`: the template on messages); a refusal, a silent drop, or one
    moved ahead of the turns before it (to the system prompt, changing the prompt's first
    tokens): False."""
    answer = "\u2063an earlier answer\u2063"
    try:
        text = render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": answer},
                       {"role": "system", "content": PROBE}, {"role": "user", "content": "v"}])
    except Exception:  # the template's raise_exception, or a template that breaks on it
        return False
    return PROBE in text and answer in text and text.index(PROBE) > text.index(answer)


def fold(messages: list[dict]) -> list[dict]:
    """`messages` with the system messages after the first non-system one as notes
    (module docstring); the leading ones joined into one. Each note stays where it stands
    in every later request too (the prefix cache holds the prompt before it): after a user
    message, at its end; else a user turn of its own there, or the start of the user
    message right after it; after an assistant's calls, once their tool turns are done.
    The input is not changed."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    if lead <= 1 and not any(m.get("role") == "system" for m in messages[lead:]):
        return messages
    out: list[dict] = []
    if lead:
        out.append({**messages[0], "content": "\n\n".join(
            _text(m.get("content")) for m in messages[:lead])} if lead > 1 else messages[0])
    held: list[str] = []  # notes waiting for the tool turns before them to end
    for m in messages[lead:]:
        role = m.get("role")
        if held and role not in ("tool", "system"):
            if role == "user":  # the next message: the note opens it
                m = _with(m, "\n\n".join(held), at_end=False)
            else:  # an assistant's: the note is a user turn of its own before it
                out.append({"role": "user", "content": "\n\n".join(held)})
            held = []
        if role != "system":
            out.append(m)
            continue
        note = f"<system>\n{_text(m.get('content'))}\n</system>"
        if out and out[-1].get("role") == "user" and not held:
            out[-1] = _with(out[-1], note, at_end=True)
        else:
            held.append(note)
    if held:
        out.append({"role": "user", "content": "\n\n".join(held)})
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _with(m: dict, note: str, *, at_end: bool) -> dict:
    """A copy of user message `m` with `note` after (at_end) or before its content."""
    content = m.get("content")
    if isinstance(content, list):
        part = {"type": "text", "text": note}
        gap = {"type": "text", "text": "\n\n"}
        parts = [*content, gap, part] if at_end else [part, gap, *content]
        return {**m, "content": parts}
    text = content if isinstance(content, str) else ""
    if not text:
        return {**m, "content": note}
    return {**m, "content": f"{text}\n\n{note}" if at_end else f"{note}\n\n{text}"}
