"""Anthropic's mid-conversation `system` messages: where one may stand, and the tool
changes (`tool_addition` / `tool_removal` blocks) one may carry.

Claude Code (2.1.337, beta `mid-conversation-tool-changes-2026-07-01`) sends them in a
`system` message when its tool set changes mid-session (an MCP server connecting late):
`{"type": "tool_removal", "tool": {"type": "tool_reference", "name"}}` and
`{"type": "tool_addition", "tool": {"type": "tool_reference", "name"}}`, the named tool
listed in `tools`, or, with beta `inline-tools-2026-09-15`, `{"type": "tool_addition",
"tool": {"type": "tool_definition", "definition": {"name", "description",
"input_schema"}}}`, a tool `tools` does not list. Anthropic's API offers an added tool to the
model from that point on and withdraws a removed one. Here the changes become a system turn
at that point of the prompt, naming the removed tools and giving each added one's definition
in the `<functions>` encoding of tool_reference.py, so the prompt before it is unchanged and
the prefix cache still holds it; the message's text is in the same turn, in order. Anthropic
places a mid-conversation system message where it stands so that later instructions keep
the earlier turns' cache; joined to the system prompt at the start, one arriving late (or
an effort-only one, which added an empty paragraph) changed the prompt's first tokens and
the whole conversation was prefilled again. A template that takes a system turn only at the
start gets it as a `<system>` note in the user turn next to it (neuron/system_turns.py).
A tool defined by value is callable from then on, as a
deferred tool (out of the prompt's tool list). docs/api.md, "`POST /v1/messages`
(Anthropic)".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from helexa.router.errors import ApiError, bad_request, unsupported
from helexa.router.request_model import decode_as
from helexa.router.tool_reference import function_line, functions, listed

CHANGES = ("tool_addition", "tool_removal")
CLEAR_AT = "next_user_message"  # a turn-scoped system message's `clear_at`
KEPT = "never"  # the other value: the message stays (as one without `clear_at`)


def check_placement(messages: Sequence[Any], i: int) -> None:
    """Anthropic's placement rules for a `system` message in `messages` (its mid-conversation
    system messages; docs/api.md, "`POST /v1/messages` (Anthropic)"): never the first
    entry, right after a user message (helexa runs no server tools, whose use an assistant
    message could end in), never beside another, and last or followed by an assistant
    turn; a request that breaks one is a 400, as Anthropic's is. A run of them that holds
    a turn-scoped one (`clear_at`) stands as one: Claude Code sends its reminder right
    after the system message it belongs to, and a per-turn effort after both."""
    param = f"messages[{i}].role"
    start, end = i, i + 1
    while start > 0 and messages[start - 1].role == "system":
        start -= 1
    while end < len(messages) and messages[end].role == "system":
        end += 1
    before = messages[start - 1].role if start else None
    after = messages[end].role if end < len(messages) else None
    if before is None:
        why = ("cannot be the first entry in `messages`; instructions that apply from the "
               "start go in the top-level `system` field")
    elif end - start > 1 and not any(messages[j].clear_at == CLEAR_AT
                                     for j in range(start, end)):
        why = "cannot be next to another `system` message"
    elif before != "user":
        why = f"must follow a `user` message, not an `{before}` one"
    elif after not in (None, "assistant"):
        why = "must be the last entry in `messages` or be followed by an `assistant` message"
    else:
        return
    raise bad_request(f"`{param}`: a `system` message {why}", param)


def check_clear_at(m: Any, i: int) -> None:
    """A 400 naming `messages[i].clear_at` unless it is absent, or `next_user_message` or
    `never` on a system message."""
    if m.clear_at is None or (m.clear_at in (CLEAR_AT, KEPT) and m.role == "system"):
        return
    why = (f"expected `{CLEAR_AT}` or `{KEPT}`, not `{m.clear_at}`" if m.role == "system"
           else "clear_at is only permitted on a `system` message")
    raise bad_request(f"`messages[{i}].clear_at`: {why}", f"messages[{i}].clear_at")


def cleared(messages: Sequence[Any], i: int) -> bool:
    """Whether `messages[i]` is a turn-scoped system message (`clear_at:
    "next_user_message"`, Claude Code's reminders) that a later user message cleared: it
    held for the turn it was sent in, and is no longer in the prompt."""
    return messages[i].clear_at == CLEAR_AT and any(
        m.role == "user" for m in messages[i + 1:])


def _target(b: Any, param: str) -> tuple[str, Any]:
    """A change block's `tool`: ("tool_reference", its name) or ("tool_definition", its
    definition), else a 400 naming the field."""
    tool = b.tool
    if not isinstance(tool, dict):
        what = "must be an object" if tool is not None else "is required"
        raise bad_request(f"`{param}.tool` {what}", f"{param}.tool")
    kind = tool.get("type")
    if kind == "tool_reference":
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"`{param}.tool.name` is required (a string)", f"{param}.tool.name")
        return kind, name
    if kind == "tool_definition" and b.type == "tool_addition":
        if not isinstance(tool.get("definition"), dict):
            raise bad_request(f"`{param}.tool.definition` is required (an object)",
                              f"{param}.tool.definition")
        return kind, tool["definition"]
    if kind in ("mcp_tool_reference", "mcp_toolset_reference"):
        raise unsupported(f"{param}.tool.type", f"MCP tool references (`{kind}`)")
    allowed = "`tool_reference` or `tool_definition`" if b.type == "tool_addition" \
        else "`tool_reference`"
    raise bad_request(f"`{param}.tool.type` must be {allowed}", f"{param}.tool.type")


def inline_tools(messages: Sequence[Any], tools: list[Any], tool_type: type) -> list[Any]:
    """`tools` and, deferred, each tool a `tool_addition` defines by value (the latest
    definition of a name), so a call to one parses; a name `tools` lists is a 400."""
    listed, added = {t.name for t in tools}, {}
    for i, m in enumerate(messages):
        if m.role != "system" or isinstance(m.content, str):
            continue
        for j, b in enumerate(m.content):
            if b.type != "tool_addition":
                continue
            param = f"messages[{i}].content[{j}]"
            kind, target = _target(b, param)
            if kind == "tool_definition":
                t = _definition(target, f"{param}.tool.definition", tool_type)
                if t.name in listed:
                    raise bad_request(f"`{param}.tool.definition.name`: `{t.name}` is already "
                                      "used by a tool in `tools`", f"{param}.tool.definition.name")
                added[t.name] = t
    return [*tools, *added.values()]


def _definition(d: dict[str, Any], param: str, tool_type: type) -> Any:
    try:
        t = decode_as(msgspec.json.encode(d), tool_type)
    except ApiError as e:
        raise bad_request(f"`{param}`: {e.message}",
                          f"{param}.{e.param}" if e.param else param) from None
    if t.type not in (None, "custom"):
        raise unsupported(f"{param}.type", f"server tools (`{t.type}`)")
    if t.input_schema is None:
        raise bad_request(f"`{param}.input_schema` is required", f"{param}.input_schema")
    t.defer_loading = True
    return t


def text_of(content: Any, param: str, tools: Sequence[Any], tool_type: type) -> str:
    """A system message's content as the system turn it makes where it stands ("" when it has
    none: an effort alone): its text and its tool changes, in order."""
    if isinstance(content, str):
        return content
    lines = []
    adding: list[str] = []  # consecutive additions: one <functions> block
    for j, b in enumerate([*content, None]):
        if adding and (b is None or b.type != "tool_addition"):
            lines += ["Tools added here, callable from now on:", functions(adding)]
            adding = []
        if b is None:
            break
        if b.type == "text":
            if b.text:
                lines.append(b.text)
            continue
        if b.type not in CHANGES:
            raise unsupported(f"{param}[{j}].type", f"blocks of type `{b.type}` here")
        kind, target = _target(b, f"{param}[{j}]")
        if kind == "tool_definition":
            adding.append(function_line(_definition(target, f"{param}[{j}].tool.definition",
                                                    tool_type)))
            continue
        t = listed(tools, target, f"{param}[{j}].tool.name",
                   "a tool a change references must be listed")
        if b.type == "tool_addition":
            adding.append(function_line(t))
        else:
            lines.append(f"Tool removed here, not callable from now on: {target}")
    return "\n".join(lines)
