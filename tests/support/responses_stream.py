"""The Responses event stream as codex reads it, checked whole: the agent replay (tiny model)
and the CLI-turn tests (fake neuron) share this one checker."""

from __future__ import annotations

from typing import Any


def check_responses_stream(events: list[tuple[str | None, Any]],
                           input_tokens_over: int = 0) -> dict:
    """`events`: (event name, data) of each SSE event (router_procs.sse_events). Checks the
    stream's opening, its end, the sequence numbers (from 0, as OpenAI's), each event's
    name against its type, that each output item added is in the final response in order,
    and the usage; returns the final response."""
    data = [d for _, d in events]
    assert all(isinstance(d, dict) for d in data), data
    kinds = [d["type"] for d in data]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:2]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds[-1]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert all(n == d["type"] for n, d in events), [n for n, _ in events]
    final: dict = data[-1]["response"]
    if final["status"] == "incomplete":
        assert final["incomplete_details"]["reason"] == "max_output_tokens"
    added = [d["item"]["id"] for d in data
             if d["type"] == "response.output_item.added"]
    assert added == [item["id"] for item in final["output"]]
    assert final["usage"]["input_tokens"] > input_tokens_over, final["usage"]
    return final
