"""Sessions of the real agent CLIs, replayed turn by turn over a scripted fake neuron.

tests/fixtures/agents/claude_code-3.json, claude_code-explore.json and codex-3.json
were captured (README.md there) from Claude Code 2.1.197 (`claude -p ... --model
helexa/balanced`) and codex-cli 0.171.0 (`codex exec`) run against a router over the
fake neuron (tests/router/router_fake_neuron.py) with a logging proxy between them;
claude_code-4.json so from Claude Code 2.1.337, the turn after its tool search.
Their prompts carry the fake's `[[emit:...]]` markers, so the fake answered as a model
would: the user's prompt asks for a thought and a shell call, the file that call
reads asks for the final answer (the last marker in a prompt wins). Both CLIs ran the
call, sent its result back and ended the session with that answer. Replayed here, the
router must take each request as the CLI sent it (a mid-conversation system message,
the thought sent back with its empty signature, codex's reasoning item with no
encrypted content) and answer in the shape that CLI parsed. tests/integration/router/
test_agent_replay.py sends the same bodies to the tiny model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest
from router_procs import RouterProcess, router_over_fake, sse_events
from support.agent_fixtures import fixture
from support.responses_stream import check_responses_stream

ANSWER = "The notes say the answer is 42."


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[RouterProcess]:
    # a Qwen3-like model (think, hermes) with room for Claude Code's 20k-token prompts
    with router_over_fake(tmp_path_factory.mktemp("cli"), "cli", "--context", "262144",
                          "--formats", "think,hermes") as r:
        yield r


def sse(router: RouterProcess, path: str, body: dict) -> list[dict]:
    """The data of each SSE event, its name checked against its type."""
    out: list[dict] = []
    for name, data in sse_events(router.url, path, {**body, "model": "tiny"}, timeout=60):
        assert isinstance(data, dict) and data["type"] == name, (name, data)
        out.append(data)
    return out


def test_claude_codes_first_turn_gets_its_thought_and_bash_call(router):
    body = fixture("claude_code-3")["body"]
    first = body["messages"][:2]  # the turn before the call: a user and a system message
    assert [m["role"] for m in first] == ["user", "system"]
    events = sse(router, "/v1/messages", {**body, "messages": first})
    names = [e["type"] for e in events]
    assert "error" not in names and "ping" not in names
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use"]
    assert starts[1]["name"] == "Bash"
    thought = "".join(e["delta"].get("thinking", "") for e in events
                      if e["type"] == "content_block_delta")
    args = "".join(e["delta"].get("partial_json", "") for e in events
                   if e["type"] == "content_block_delta")
    assert thought == "I should read it."
    assert json.loads(args) == {"command": "cat notes.txt", "description": "Show notes"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_claude_codes_turn_after_its_thought_and_call_is_taken(router):
    body = fixture("claude_code-3")["body"]
    sent = body["messages"][2]["content"]  # the thought goes back with its empty signature
    assert [b["type"] for b in sent] == ["thinking", "tool_use"] and sent[0]["signature"] == ""
    events = sse(router, "/v1/messages", body)
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == ANSWER
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_claude_codes_explore_subagent_request_is_taken(router):
    # Claude Code sends its subagents' requests under its haiku model name; this one was
    # captured with ANTHROPIC_DEFAULT_HAIKU_MODEL set (docs/operating.md)
    body = fixture("claude_code-explore")["body"]
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    events = sse(router, "/v1/messages", body)
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert "".join(e["delta"].get("text", "") for e in events
                   if e["type"] == "content_block_delta").startswith("w0 ")


def test_claude_codes_turn_after_a_tool_search_is_taken(router):
    # claude_code-4 (2.1.337): the turn after a ToolSearch call, whose result is a
    # tool_reference to the deferred WebFetch, listed with `defer_loading`; it asks
    # `thinking.display: "updates"`. Refused, Claude Code sent it five times, then gave up
    # tool search for the session. A marker in WebFetch's description is the prompt's last
    # only where its definition stands in the tool turn, after the user's prompt.
    body = fixture("claude_code-4")["body"]
    assert body["thinking"] == {"type": "adaptive", "display": "updates"}
    result = body["messages"][-1]["content"][0]
    assert result["content"] == [{"type": "tool_reference", "tool_name": "WebFetch"}]
    tools = [{**t, "description": t["description"] + " [[emit:1:WebFetch is loaded.]]"}
             if t["name"] == "WebFetch" and t.get("defer_loading") else t
             for t in body["tools"]]
    events = sse(router, "/v1/messages", {**body, "tools": tools})
    assert "error" not in [e["type"] for e in events]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "WebFetch is loaded."
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def responses_output(router: RouterProcess, body: dict) -> list[dict]:
    """The output of a Responses stream, the stream checked whole as the replay checks it
    (support/responses_stream.py) and completed."""
    final = check_responses_stream(sse_events(router.url, "/v1/responses",
                                              {**body, "model": "tiny"}, timeout=60))
    assert final["status"] == "completed", final["status"]
    return final["output"]


def test_codexs_first_turn_gets_its_reasoning_and_exec_command_call(router):
    body = fixture("codex-3")["body"]
    first = body["input"][:-3]  # before its reasoning item, call and the call's output
    assert [i["type"] for i in body["input"][-3:]] == ["reasoning", "function_call",
                                                       "function_call_output"]
    out = responses_output(router, {**body, "input": first})
    assert [i["type"] for i in out] == ["reasoning", "function_call"]
    assert out[0]["summary"] == [{"type": "summary_text", "text": "I should read it."}]
    assert out[1]["name"] == "exec_command"
    assert json.loads(out[1]["arguments"]) == {"cmd": "cat notes.txt"}


def test_codexs_turn_after_its_reasoning_and_call_is_taken(router):
    body = fixture("codex-3")["body"]
    reasoning = body["input"][-3]  # helexa's own item, sent back with no encrypted content
    assert reasoning["encrypted_content"] is None and reasoning["summary"]
    out = responses_output(router, body)
    assert [i["type"] for i in out] == ["message"]
    assert out[0]["content"][0]["text"] == ANSWER


def test_claude_codes_tool_changes_are_taken_and_read_where_they_stand(router):
    # the system message Claude Code 2.1.337 sends when its tool set changes mid-session
    # (beta mid-conversation-tool-changes-2026-07-01), built as its code builds it: removals,
    # then additions, the cache marker on the last. Refused, it resends without them and
    # sticks to that until /clear. A marker in the added tool's description is the prompt's
    # last only where the note stands, after the tool result.
    body = fixture("claude_code-4")["body"]
    late = {"name": "mcp__docs__fetch", "input_schema": {"type": "object"},
            "description": "Fetch a docs page. [[emit:1:The docs tool is here.]]"}
    change = {"role": "system", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "WebFetch"}},
        {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": late},
         "cache_control": {"type": "ephemeral"}}]}
    body = {**body, "messages": [*body["messages"], change]}
    events = sse(router, "/v1/messages", body)
    assert "error" not in [e["type"] for e in events]
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "The docs tool is here."
    # count_tokens takes it too, and counts the note
    counts = [httpx2.post(router.url + "/v1/messages/count_tokens", timeout=60, json={
        k: v for k, v in {**b, "model": "tiny"}.items() if k not in ("max_tokens", "stream")},
        headers={"x-api-key": "sk-any", "anthropic-version": "2023-06-01"}) for b in (
        body, {**body, "messages": body["messages"][:-1]})]
    assert [c.status_code for c in counts] == [200, 200], counts[0].text
    assert counts[0].json()["input_tokens"] > counts[1].json()["input_tokens"]
