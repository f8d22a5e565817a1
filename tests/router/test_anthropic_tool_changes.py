"""Claude Code's mid-conversation tool changes (router/anthropic_system.py): a `system`
message of `tool_removal` / `tool_addition` blocks, in the shape Claude Code 2.1.337 builds
it (beta mid-conversation-tool-changes-2026-07-01; by value: inline-tools-2026-09-15)."""

from __future__ import annotations

import json

import pytest
from support.agent_fixtures import fixture

from helexa.router import anthropic
from helexa.router.errors import ApiError
from helexa.router.forward import chat_proto
from helexa.router.tokenize import _count_chat

LATE = {"name": "mcp__docs__search", "description": "search the docs", "defer_loading": True,
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
INLINE = {"name": "mcp__docs__fetch", "description": "fetch a page",
          "input_schema": {"type": "object"}}
# Claude Code's order: removals, then additions; its cache marker on the last block
CHANGES = {"role": "system", "content": [
    {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "WebFetch"}},
    {"type": "tool_addition", "tool": {"type": "tool_reference", "name": LATE["name"]}},
    {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": INLINE},
     "cache_control": {"type": "ephemeral"}}]}


def line(t: dict) -> str:
    fn = {"description": t["description"], "name": t["name"], "parameters": t["input_schema"]}
    return f"<function>{json.dumps(fn)}</function>"


def bodies() -> tuple[dict, dict]:
    """Claude Code's turn after its tool search (claude_code-4), and the same turn with an MCP
    server's tools arriving late: listed (deferred) in `tools`, announced by a system message."""
    before = fixture("claude_code-4")["body"]
    after = {**before, "tools": [*before["tools"], LATE],
             "messages": [*before["messages"], CHANGES]}
    return before, after


@pytest.mark.parametrize("parse, drop", [(anthropic.parse_request, ()),
                                         (anthropic.parse_count_request, ("max_tokens", "stream"))])
def test_tool_changes_are_a_system_turn_where_they_stand_and_the_prompt_before_is_kept(
        parse, drop):
    before, after = (parse(json.dumps({k: v for k, v in b.items() if k not in drop}).encode())
                     for b in bodies())
    changes = ("Tool removed here, not callable from now on: WebFetch\n"
               "Tools added here, callable from now on:\n<functions>\n"
               f"{line(LATE)}\n{line(INLINE)}\n</functions>")
    # after the tool turns its last message made (its tool_result)
    assert after.messages[:-1] == before.messages
    assert (after.messages[-1].role, after.messages[-1].content) == ("system", changes)
    for chat in (chat_proto, _count_chat):  # a reply's prompt, and count_tokens'
        assert chat(after).tools_json == chat(before).tools_json  # the system prompt's tools
        assert list(chat(after).messages)[:-1] == list(chat(before).messages)
    # both added tools are callable; the one defined by value stays out of the tool list
    names = [t["function"]["name"] for t in after.tools]
    assert LATE["name"] in names and INLINE["name"] in names
    assert INLINE["name"] in after.deferred_tools


def test_a_system_messages_text_and_changes_are_one_turn_in_order():
    body = {"model": "m", "max_tokens": 9, "system": "S", "tools": [LATE], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look it up"}]},
        {"role": "system", "content": [{"type": "text", "text": "be brief"},
                                       CHANGES["content"][1]]}]}
    req = anthropic.parse_request(json.dumps(body).encode())
    # the message's text and its change, in order, in one system turn where it stands
    assert [(t.role, t.content) for t in req.messages] == [
        ("system", "S"), ("user", "look it up"),
        ("system", "be brief\nTools added here, callable from now on:\n"
                   f"<functions>\n{line(LATE)}\n</functions>")]


@pytest.mark.parametrize("parse, drop", [(anthropic.parse_request, ()),
                                         (anthropic.parse_count_request, ("max_tokens", "stream"))])
def test_a_later_system_message_keeps_every_token_before_it(parse, drop):
    """Claude Code's turn (claude_code-4: its environment and skills in a `system` message
    after the first user message), then the next turn with an instruction and a per-turn
    effort in later system messages: the first prompt is a prefix of the second, token for
    message as the template gets them, so the prefix cache holds it all. Joined to the system
    prompt at the start, each changed the first tokens (an effort-only one added an empty
    paragraph) and the whole conversation was prefilled again."""
    first = fixture("claude_code-4")["body"]
    later = {**first, "messages": [
        *first["messages"], {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "now the tests"},
        {"role": "system", "content": [{"type": "text", "text": "Prefer small commits."}]},
        {"role": "assistant", "content": "On it."},
        {"role": "user", "content": "and the docs"},
        {"role": "system", "content": "", "output_config": {"effort": "low"}}]}
    a, b = (parse(json.dumps({k: v for k, v in x.items() if k not in drop}).encode())
            for x in (first, later))
    for chat in (chat_proto, _count_chat):
        pa, pb = list(chat(a).messages), list(chat(b).messages)
        assert pb[:len(pa)] == pa and chat(b).tools_json == chat(a).tools_json
    system = first["messages"][1]["content"]  # its environment: where it stands, whole
    assert a.messages[0].role == "system" and system not in a.messages[0].content
    assert (a.messages[2].role, a.messages[2].content) == ("system", system)
    assert b.messages[-1].content == "and the docs"  # the effort alone makes no turn
    assert [(t.role, t.content) for t in b.messages[-4:-1]] == [
        ("user", "now the tests"), ("system", "Prefer small commits."), ("assistant", "On it.")]
    assert b.reasoning_effort == "low"


def addition(tool) -> dict:
    return {"type": "tool_addition", "tool": tool}


@pytest.mark.parametrize("block, param", [
    ({"type": "tool_addition"}, "tool"),
    (addition("Read"), "tool"),
    (addition({"type": "tool"}), "tool.type"),
    (addition({"type": "tool_reference"}), "tool.name"),
    (addition({"type": "tool_reference", "name": "Nope"}), "tool.name"),
    (addition({"type": "mcp_toolset_reference", "server_name": "docs"}), "tool.type"),
    (addition({"type": "tool_definition"}), "tool.definition"),
    (addition({"type": "tool_definition", "definition": {"name": "X"}}),
     "tool.definition.input_schema"),
    (addition({"type": "tool_definition", "definition": {"name": "a b", "input_schema": {}}}),
     "tool.definition.name"),
    (addition({"type": "tool_definition", "definition": {"name": "Read", "input_schema": {}}}),
     "tool.definition.name"),  # a name `tools` lists
    ({"type": "tool_removal", "tool": {"type": "tool_definition", "definition": INLINE}},
     "tool.type"),
    ({"type": "tool_removal", "tool": {"type": "tool_reference", "name": "Nope"}},
     "tool.name"),
])
def test_a_malformed_tool_change_is_a_400_naming_its_field(block, param):
    body = {"model": "m", "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "system", "content": [CHANGES["content"][0], block]}]}
    body["tools"].append({"name": "WebFetch", "input_schema": {"type": "object"}})
    for parse, extra in ((anthropic.parse_request, {"max_tokens": 4}),
                         (anthropic.parse_count_request, {})):
        with pytest.raises(ApiError) as e:
            parse(json.dumps({**body, **extra}).encode())
        assert (e.value.status, e.value.param) == (400, f"messages[1].content[1].{param}")


@pytest.mark.parametrize("parse, drop", [(anthropic.parse_request, ()),
                                         (anthropic.parse_count_request, ("max_tokens", "stream"))])
def test_a_system_messages_effort_holds_from_there_on(parse, drop):
    """Claude Code's per-turn effort: a mid-conversation `system` message (its content may be
    empty) carrying `output_config.effort`; the latest one holds over the top-level one, for
    the reply and for count_tokens alike."""
    before, _ = bodies()
    for content in ("", CHANGES["content"]):
        msgs = [*before["messages"], {"role": "system", "content": content,
                                      "output_config": {"effort": "low"}}]
        body = {k: v for k, v in {**before, "messages": msgs,
                                  "output_config": {"effort": "high"}}.items()
                if k not in drop}
        if content:
            body["tools"] = [*before["tools"], LATE]
        assert parse(json.dumps(body).encode()).reasoning_effort == "low"


HI = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("msgs, param", [
    ([*HI, {"role": "user", "content": "go", "output_config": {"effort": "low"}}],
     "messages[2].output_config"),
    ([*HI, {"role": "user", "content": "go"}, {"role": "system", "content": "x",
                                               "output_config": {"format": {
                                                   "type": "json_schema",
                                                   "schema": {"type": "object"}}}}],
     "messages[3].output_config.format")])
def test_an_output_config_elsewhere_is_a_400_naming_it(msgs, param):
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps({"model": "m", "max_tokens": 9,
                                            "messages": msgs}).encode())
    assert e.value.status == 400 and param in e.value.message, e.value.message


def _reminder(text: str) -> dict:
    # Claude Code's turn-scoped reminder (beta mid-conversation-system-clear-at-2026-08-21):
    # pushed right after the system message it belongs to
    return {"role": "system", "content": text, "clear_at": "next_user_message"}


def test_a_turn_scoped_reminder_holds_for_its_turn_and_is_cleared_by_the_next():
    """Claude Code 2.1.337 sends a reminder for one turn as a `system` message with
    `clear_at: "next_user_message"`, right after a system message, then a per-turn effort
    after both: a run of three. The reminder is in the prompt for its own turn; once a user
    message follows it, it is gone. Before, the field was a 400 that Claude Code did not
    take for the beta's refusal, and the session stopped."""
    base = {"role": "system", "content": "Tools changed."}
    effort = {"role": "system", "content": [], "output_config": {"effort": "low"}}
    turn = [{"role": "user", "content": "fix it"}, base, _reminder("Plan mode is on."), effort]
    body = {"model": "m", "max_tokens": 9, "system": "S", "messages": turn}
    now = anthropic.parse_request(json.dumps(body).encode())
    assert [(t.role, t.content) for t in now.messages] == [
        ("system", "S"), ("user", "fix it"), ("system", "Tools changed."),
        ("system", "Plan mode is on.")]
    assert now.reasoning_effort == "low"
    later = {**body, "messages": [*turn, {"role": "assistant", "content": "Done."},
                                  {"role": "user", "content": "thanks"}]}
    cleared = anthropic.parse_request(json.dumps(later).encode())
    assert [(t.role, t.content) for t in cleared.messages] == [
        ("system", "S"), ("user", "fix it"), ("system", "Tools changed."),
        ("assistant", "Done."), ("user", "thanks")]
    # "never": the message stays, as one without clear_at
    kept = {**body, "messages": [{"role": "user", "content": "fix it"},
                                 {**_reminder("Plan mode is on."), "clear_at": "never"},
                                 {"role": "assistant", "content": "Done."},
                                 {"role": "user", "content": "thanks"}]}
    assert ("system", "Plan mode is on.") in [
        (t.role, t.content) for t in anthropic.parse_request(json.dumps(kept).encode()).messages]


@pytest.mark.parametrize("msgs, param, words", [
    ([{"role": "user", "content": "hi", "clear_at": "next_user_message"}],
     "messages[0].clear_at", "only permitted on a `system` message"),
    ([{"role": "user", "content": "hi"},
      {"role": "system", "content": "x", "clear_at": "end_of_time"}],
     "messages[1].clear_at", "expected `next_user_message`"),
    # without a turn-scoped one, two system messages side by side are still refused
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "a"},
      {"role": "system", "content": "b"}], "messages[1].role", "next to another")])
def test_a_clear_at_anthropic_would_refuse_is_a_400_naming_it(msgs, param, words):
    with pytest.raises(ApiError) as e:
        anthropic.parse_request(json.dumps({"model": "m", "max_tokens": 9,
                                            "messages": msgs}).encode())
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message
