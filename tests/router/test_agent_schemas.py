"""Every tool schema Claude Code, codex and opencode send (tests/fixtures/agents/) is
served: as prompt text under auto, and as a grammar under a forced choice of that tool."""

from __future__ import annotations

import json

import pytest
from support.agent_fixtures import fixture

from helexa.router import anthropic, responses_api
from helexa.router.openai_api import parse_request


def _tool_sets() -> list[tuple[str, list]]:
    return [("claude_code", fixture("claude_code-2")["body"]["tools"]),
            ("codex", fixture("codex-2")["body"]["tools"]),
            ("opencode", fixture("opencode-2")["body"]["tools"])]


@pytest.mark.parametrize("agent,tools", _tool_sets(), ids=[a for a, _ in _tool_sets()])
def test_every_captured_tool_schema_is_served_under_auto_and_forced(agent, tools):
    user = [{"role": "user", "content": "hi"}]
    if agent == "claude_code":
        auto = anthropic.parse_request(json.dumps({"model": "m", "max_tokens": 8,
                                                   "messages": user, "tools": tools}).encode())
        names = [t["name"] for t in tools]
        forced = [anthropic.parse_request(json.dumps({
            "model": "m", "max_tokens": 8, "messages": user, "tools": tools,
            "tool_choice": {"type": "tool", "name": n}}).encode()) for n in names]
    elif agent == "codex":
        auto = responses_api.parse_request(json.dumps({"model": "m", "input": "hi",
                                                       "tools": tools}).encode())
        names = [t["function"]["name"] for t in auto.tools]
        forced = [responses_api.parse_request(json.dumps({
            "model": "m", "input": "hi", "tools": tools,
            "tool_choice": {"type": "function", "name": n}}).encode()) for n in names]
    else:
        auto = parse_request({"model": "m", "messages": user, "tools": tools}, "chat")
        names = [t["function"]["name"] for t in tools]
        forced = [parse_request({"model": "m", "messages": user, "tools": tools, "tool_choice": {
            "type": "function", "function": {"name": n}}}, "chat") for n in names]
    assert auto.tool_choice == "auto" and auto.constraint is None and len(names) >= 8
    assert all(r.constraint is not None for r in forced)  # each compiles, none refused


