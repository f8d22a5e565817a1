"""Responses' `input` as the turns a chat template takes (responses_api.py's docstring says the
mapping): its items' structs, and the translation, in order. `instructions` and the `system` /
`developer` messages `input` opens with make the system turn; a later one is a system turn
where it stands, held past any call outputs that follow it (so nothing stands between calls
and the tool turns answering them), so the prompt before it is kept and the prefix cache
holds it: joined to the system prompt, a developer message codex sends mid-session changed
the prompt's first tokens. Where the model's template takes a system turn only at the
start, the neuron makes it a `<system>` note (helexa/neuron/system_turns.py).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from helexa.router import agent_request, custom_tools, images, tool_pairing
from helexa.router.errors import bad_request, unsupported
from helexa.router.openai_api import Turn
from helexa.router.request_model import ImageDetail

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class Part(msgspec.Struct, kw_only=True):
    """One content part of an input item: text, or (user messages, tool outputs) an
    input_image."""

    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data: URL or an http(s) URL
    file_id: str | None = None  # input_image from OpenAI's Files API: refused by name
    detail: ImageDetail | None = None  # input_image: checked as chat's, then ignored


class Item(msgspec.Struct, kw_only=True):
    """One input item; which fields matter depends on `type` (a message may omit it)."""

    type: str = "message"
    role: str | None = None  # message
    content: str | list[Part] | None = None  # message, reasoning
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    input: str | None = None  # custom_tool_call
    output: str | list[Part] | None = None  # function_call_output, custom_tool_call_output
    summary: list[Part] | None = None  # reasoning
    id: Any = None  # accepted: ids of earlier output items
    status: Any = None
    phase: Any = None
    namespace: Any = None
    encrypted_content: Any = None


def _text(content: str | list[Part] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS and p.type != "refusal":
            raise unsupported(f"{param}[{j}].type", f"content parts of type `{p.type}`")
        out.append(p.text or "")
    return "".join(out)


def _parts_turn(role: str, content: str | list[Part] | None, param: str,
                call_id: str = "") -> Turn:
    """A user message or a tool's output (a screenshot codex's view_image took): its text,
    and its parts in order where it holds input_image parts."""
    if content is None or isinstance(content, str):
        return Turn(role=role, content=content or "", tool_call_id=call_id)
    parts: list[str | images.ImagePart] = []
    for j, part in enumerate(content):
        q = f"{param}[{j}]"
        if part.type == "input_image":
            if part.image_url is None:
                if part.file_id is not None:
                    raise unsupported(f"{q}.file_id", "images by file_id (this router has no "
                                      "Files API); send image_url")
                raise bad_request(f"`{q}.image_url` is required", f"{q}.image_url")
            parts.append(images.from_url(part.image_url, f"{q}.image_url"))
        elif part.type in images.VIDEO_PART_TYPES:
            raise unsupported(f"{q}.type", f"video content parts (`{part.type}`)")
        elif part.type in _TEXT_PARTS or part.type == "refusal":
            parts.append(part.text or "")
        else:
            raise unsupported(f"{q}.type", f"content parts of type `{part.type}`")
    text = "".join(x for x in parts if isinstance(x, str))
    has_images = any(isinstance(x, images.ImagePart) for x in parts)
    return Turn(role=role, content=text, tool_call_id=call_id,
                parts=parts if has_images else None)


def turns_of(instructions: str | None, input: str | list[Item], repaired: list[str]
             ) -> list[Turn]:
    """`instructions` and `input` as the turns the template takes (module docstring)."""
    system = [instructions] if instructions else []
    items = [Item(role="user", content=input)] if isinstance(input, str) else input
    turns: list[Turn] = []
    calls: list[dict[str, Any]] = []  # the open assistant turn's calls
    thought: list[str] = []  # reasoning for the next assistant turn
    held: list[str] = []  # later system messages' text, held past the outputs after them
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if it.type not in _CALLS and calls:
            _close_calls(turns, calls, thought)
        if held and it.type not in _OUTPUTS:
            _place(turns, held)
        if it.type == "message":
            role = it.role or "user"
            if role in ("system", "developer") and not turns:
                system.append(_text(it.content, f"{p}.content"))
            elif role in ("system", "developer"):
                if text := _text(it.content, f"{p}.content"):
                    held.append(text)
            elif role == "user":
                turns.append(_parts_turn("user", it.content, f"{p}.content"))
            elif role == "assistant":
                turns.append(Turn(role=role, content=_text(it.content, f"{p}.content"),
                                  reasoning="".join(thought)))
                thought.clear()
            else:
                raise bad_request(f"`{p}.role`: invalid value `{role}`", f"{p}.role")
        elif it.type == "function_call":
            if not it.call_id or not it.name:
                raise bad_request(f"`{p}` needs `call_id` and `name`", p)
            args = agent_request.call_arguments(it.arguments or "", f"{p}.arguments", repaired)
            calls.append({"id": it.call_id, "type": "function", "function": {
                "name": it.name, "arguments": args or "{}"}})
        elif it.type == "custom_tool_call":
            if not it.call_id or not it.name:
                raise bad_request(f"`{p}` needs `call_id` and `name`", p)
            calls.append({"id": it.call_id, "type": "function", "function": {
                "name": it.name, "arguments": custom_tools.arguments_of(it.input or "")}})
        elif it.type in _OUTPUTS:
            if not it.call_id:
                raise bad_request(f"`{p}.call_id` is required", f"{p}.call_id")
            turns.append(_parts_turn("tool", it.output, f"{p}.output", it.call_id))
        elif it.type == "reasoning":
            text = _text(it.content, f"{p}.content") or _text(it.summary, f"{p}.summary")
            thought.append(text)
        elif it.type == "item_reference":
            raise bad_request(f"`{p}`: this router keeps no state, so no item can be "
                              f"referenced; send the item itself", p)
        else:
            raise unsupported(f"{p}.type", f"input items of type `{it.type}`")
    if calls:
        _close_calls(turns, calls, thought)
    _place(turns, held)
    tool_pairing.check_input(items)
    if system:
        turns.insert(0, Turn(role="system", content="\n\n".join(system)))
    if not any(t.role != "system" for t in turns):
        raise bad_request("`input` holds no user, assistant or tool item", "input")
    return turns


_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def _place(turns: list[Turn], held: list[str]) -> None:
    turns.extend(Turn(role="system", content=text) for text in held)
    held.clear()


def _close_calls(turns: list[Turn], calls: list[dict[str, Any]], thought: list[str]) -> None:
    """The calls since the last item as one assistant turn (merged into an assistant message
    right before them: a reply's text and calls are one turn)."""
    if turns and turns[-1].role == "assistant" and not turns[-1].tool_calls_json:
        turns[-1].tool_calls_json = json.dumps(calls)
    else:
        turns.append(Turn(role="assistant", content="", tool_calls_json=json.dumps(calls),
                          reasoning="".join(thought)))
        thought.clear()
    calls.clear()
