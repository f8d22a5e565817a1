"""The requests real agents send, replayed through a real router and neuron.

tests/fixtures/agents/ holds request bodies captured from Claude Code, codex
and opencode run unchanged against a loopback capture server, or against a
router over a scripted fake neuron (claude_code-3, claude_code-explore,
codex-3: test_agent_cli_turns.py replays those sessions; README.md there
says how). Each is sent as captured, but for the model (the tiny
checkpoint, whose 128k context holds them) and a smaller output budget (the
random-weight model would write thousands of noise tokens), and its answer
is checked for the shape that client accepts: Anthropic's event sequence,
the Responses event stream, OpenAI chat chunks. Every tool schema of those
lists is also checked to constrain a forced call.

These prompts are long (Claude Code's is ~70k tiny-model tokens): one neuron
with room for them serves this module, behind a router that takes their
size (the shared one allows 64 KiB bodies). Claude Code's prefill takes
minutes on a shared CPU, so its replays are marked slow (`-m slow`); codex's
and opencode's (~20k tokens) run by default. tests/router/test_agent_schemas.py
checks every captured tool schema without a neuron.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest
import tomli_w
from router_procs import RouterProcess, sse_events, start_router, wait_for
from support.agent_fixtures import fixture
from support.neuron import NeuronProcess, start_neuron, write_neuron_config
from support.responses_stream import check_responses_stream

MODEL = "agent-tiny"
TOKEN = "replay-token"


@pytest.fixture(scope="module")
def replay(tmp_path_factory, tiny_model_dir) -> Iterator[RouterProcess]:
    d = tmp_path_factory.mktemp("replay")
    (d / "token").write_text(TOKEN + "\n")
    cfg = {"server": {"name": "nr", "listen": "127.0.0.1:0", "token_file": "token",
                      "drain_secs": 5.0, "heartbeat_secs": 1.0},
           "engine": {"torch_threads": 1, "max_slots": 2},
           # 512 B a token: 128 MiB hold two of the tiny model's 131,072-token contexts
           "kv": {"kv_budget_mb": 128, "activation_headroom_mb": 0},
           "admission": {"kv_max_wait_secs": 30.0},
           "models": [{"id": MODEL, "path": str(tiny_model_dir), "thinking_budget_tokens": 16}]}
    neuron: NeuronProcess = start_neuron(write_neuron_config(d / "nr.toml", cfg),
                                         log_path=d / "nr.log")
    try:
        (d / "router.toml").write_text(tomli_w.dumps({
            "server": {"listen": "127.0.0.1:0", "max_body_bytes": 8 * 1024 * 1024},
            "neurons": {"token_file": "token",
                        "endpoints": [{"name": "nr", "address": neuron.address}]},
            "timeouts": {"request_secs": 600}}))
        r = start_router(d / "router.toml")
        try:
            wait_for(lambda: httpx2.get(r.url + "/health").status_code == 200, timeout=30)
            yield r
        finally:
            r.stop()
    finally:
        neuron.stop(timeout_secs=15)


def sse(router: RouterProcess, path: str, body: dict) -> list[tuple[str | None, object]]:
    """(event name or None, data) of each SSE event the router sends for body."""
    return sse_events(router.url, path, body)


# ------------------------------------------------------------------ Claude Code


def check_anthropic_stream(events: list) -> None:
    """The event sequence Claude Code's SDK accumulates (and no error event)."""
    names = [n for n, _ in events]
    assert "error" not in names, events[-1]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    usage = events[0][1]["message"]["usage"]  # a real prompt's count, uncached and cached
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 1000
    assert events[-2][1]["usage"]["input_tokens"] == usage["input_tokens"]
    open_index = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            assert data["delta"]["type"] in ("text_delta", "thinking_delta", "signature_delta",
                                             "input_json_delta")
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["claude_code-1", "claude_code-2", "claude_code-3",
                                  "claude_code-explore"])
def test_claude_codes_requests_get_a_stream_it_accepts(replay, name):
    # -3 and -explore (asked for as helexa/balanced, -1 and -2 as claude-sonnet-4-5) carry a
    # system message after the user's, `output_config.effort` and `thinking: adaptive` (the
    # catalogue budget); the Explore subagent sends no thinking and 17 tools
    f = fixture(name)
    body = {**f["body"], "model": MODEL, "max_tokens": 48}
    if "thinking" in body:
        body["thinking"] = {**body["thinking"], "budget_tokens": 16}
    assert body["stream"] and len(body["tools"]) > 15
    check_anthropic_stream(sse(replay, f["path"], body))


@pytest.mark.slow
def test_claude_codes_mid_conversation_system_message(replay):
    # The first failure: Claude Code put a system message at messages[1]
    f = fixture("claude_code-2")
    msgs = f["body"]["messages"]
    body = {**f["body"], "model": MODEL, "max_tokens": 8, "thinking": {"type": "disabled"},
            "messages": [msgs[0], {"role": "system", "content": "Be terse."}, *msgs[1:]]}
    check_anthropic_stream(sse(replay, f["path"], body))


# ------------------------------------------------------------------ codex


# codex-3 (a reasoning item sent back) runs its session turn by turn over a fake neuron in
# the default run (test_agent_cli_turns.py); on the tiny model it is a slow check
@pytest.mark.parametrize("name", ["codex-1", "codex-2",
                                  pytest.param("codex-3", marks=pytest.mark.slow)])
def test_codexs_requests_get_a_stream_it_accepts(replay, name):
    f = fixture(name)
    body = {**f["body"], "model": MODEL, "max_output_tokens": 48}
    assert {t["type"] for t in body["tools"]} >= {"function", "namespace", "web_search"}
    final = check_responses_stream(sse(replay, f["path"], body), input_tokens_over=1000)
    for item in final["output"]:
        assert item["type"] in ("reasoning", "message", "function_call")


# ------------------------------------------------------------------ opencode


@pytest.mark.parametrize("name", ["opencode-title", "opencode-1", "opencode-2"])
def test_opencodes_requests_get_chunks_it_accepts(replay, name):
    f = fixture(name)
    body = {**f["body"], "model": MODEL, "max_tokens": 48}
    events = sse(replay, f["path"], body)
    assert events[-1][1] == "[DONE]"
    chunks = [d for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes in (["stop"], ["length"], ["tool_calls"])
    for c in chunks:
        for call in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            assert "index" in call and "arguments" in call["function"]


# ------------------------------------------------------------------ a forced call


@pytest.mark.parametrize("agent", [pytest.param("claude_code", marks=pytest.mark.slow),
                                   "opencode"])
def test_a_required_call_over_a_captured_tool_list_validates(replay, agent):
    from helexa import grammar
    from helexa.router.schema_check import violations

    user = [{"role": "user", "content": "go"}]
    if agent == "claude_code":
        tools = fixture("claude_code-2")["body"]["tools"]
        r = httpx2.post(replay.url + "/v1/messages", timeout=600, json={
            "model": MODEL, "max_tokens": 120, "temperature": 0, "tools": tools,
            "tool_choice": {"type": "any"}, "messages": user}).json()
        cut = r["stop_reason"] == "max_tokens"
        text = [b for b in r["content"] if b["type"] == "text"]
        calls = [(b["name"], json.dumps(b["input"])) for b in r["content"]
                 if b["type"] == "tool_use"]
        schemas = {t["name"]: t["input_schema"] for t in tools}
    else:
        tools = fixture("opencode-2")["body"]["tools"]
        r = httpx2.post(replay.url + "/v1/chat/completions", timeout=600, json={
            "model": MODEL, "max_tokens": 120, "temperature": 0, "tools": tools,
            "tool_choice": "required", "messages": user}).json()
        choice = r["choices"][0]
        cut = choice["finish_reason"] == "length"
        text = [choice["message"]["content"]] if choice["message"]["content"] else []
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"].get("tool_calls") or []]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    # calls, never text, even when max_tokens cut the list (the last call is then partial)
    assert calls and not text and all(name in schemas for name, _ in calls)
    whole = calls[:-1] if cut else calls
    # what the grammar enforces holds (what it cannot is checked after and only logged)
    found = [v for name, args in whole
             for v in violations(json.loads(args), grammar.enforceable(schemas[name]).schema)]
    assert not found, found
