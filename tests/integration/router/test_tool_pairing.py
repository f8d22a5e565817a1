"""Tool calls and results that do not pair up are a 400 on every agent API, in each API's
envelope and its reference's words, naming the message and the id; paired ones are served
(docs/api.md, "Tool calls and their results"). A router process over a fake neuron: the
refusals come before any neuron is asked."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest
from router_procs import RouterProcess, router_over_fake
from support.lazy_import import Lazy

anthropic = Lazy("anthropic")


@pytest.fixture(scope="module")
def fake(tmp_path_factory) -> Iterator[RouterProcess]:
    with router_over_fake(tmp_path_factory.mktemp("pairing"), "pairing") as router:
        yield router


def _call(i: str) -> dict:
    return {"id": i, "type": "function", "function": {"name": "read", "arguments": "{}"}}


def _asks(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _answers(i: str) -> dict:
    return {"role": "tool", "tool_call_id": i, "content": "done"}


USER = {"role": "user", "content": "read it"}
READ = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("messages, param, words", [
    ([USER, _answers("call_x")], "messages[1].tool_call_id",
     ["`messages[1]`", "must be a response to a preceeding message with 'tool_calls'",
      "`call_x`"]),
    ([USER, _asks("call_a"), _answers("call_b")], "messages[2].tool_call_id",
     ["`messages[2]`", "`call_b`"]),
    ([USER, _asks("call_a"), _answers("call_a"), _answers("call_a")],
     "messages[3].tool_call_id", ["`messages[3]`", "`call_a`", "already answered"]),
    ([USER, _asks("call_a", "call_b"), _answers("call_a"), USER], "messages[1]",
     ["`messages[1]`: An assistant message with 'tool_calls' must be followed by tool messages",
      "did not have response messages: call_b"]),
    ([USER, _asks("call_a", "call_b")], "messages[1]",
     ["did not have response messages: call_a, call_b"]),
    ([USER, _asks("call_a", "call_a"), _answers("call_a"), _answers("call_a")],
     "messages[1].tool_calls[1].id", ["`call_a` is given twice"]),
])
def test_chat_calls_and_tool_messages_that_do_not_pair_are_a_400(fake, messages, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        fake.client(None).chat.completions.create(model="tiny", messages=messages,
                                                  tools=[READ], max_tokens=2)
    assert e.value.status_code == 400
    err = e.value.body  # the SDK's: the envelope's `error`
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error",
                                                        "invalid_request_error", param)
    for w in words:
        assert w in err["message"]


def test_chat_paired_calls_are_served_in_any_order_and_ids_may_recur_later(fake):
    r = fake.client(None).chat.completions.create(
        model="tiny", tools=[READ], max_tokens=2,
        messages=[USER, _asks("call_a", "call_b"), _answers("call_b"), _answers("call_a"),
                  USER, _asks("call_a"), _answers("call_a")])  # a server that numbers per turn
    assert r.choices[0].message.content


def _anthropic(fake: RouterProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=fake.url, api_key="sk-any", max_retries=0, timeout=60)


def _use(i: str) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "read",
                                              "input": {}}]}


def _result(*ids: str, text: str = "") -> dict:
    return {"role": "user", "content": [
        *({"type": "tool_result", "tool_use_id": i, "content": "done"} for i in ids),
        *([{"type": "text", "text": text}] if text else [])]}


AUSER = {"role": "user", "content": "read it"}
ATOOL = {"name": "read", "input_schema": {"type": "object"}}


@pytest.mark.parametrize("messages, words", [
    ([AUSER, _use("toolu_a"), AUSER],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
     "toolu_a. Each `tool_use` block must have a corresponding `tool_result` block in the next "
     "message."),
    ([AUSER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {}},
        {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {}}]},
      _result("toolu_b", text="and the other?")],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
     "toolu_a."),
    ([AUSER, _use("toolu_a"), {"role": "user", "content": [
        {"type": "text", "text": "Here it is:"},
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "done"}]}],
     "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
     "toolu_a. Each `tool_use` block must have a corresponding `tool_result` block in the next "
     "message. In the user message containing tool results, the tool_result blocks must come "
     "FIRST in the content array: messages.2.content.0 is a `text` block before them."),
    ([AUSER, _use("toolu_a"), AUSER, _result("toolu_a")],  # combined, the text comes first
     "the tool_result blocks must come FIRST in the content array: messages.2.content is a "
     "`text` block before them."),
    ([_result("toolu_x")],
     "messages.0.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_x. "
     "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
     "message."),
    ([AUSER, _use("toolu_a"), _result("toolu_a"), {"role": "assistant", "content": "ok"},
      _result("toolu_a")],
     "messages.4.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_a."),
])
def test_anthropic_tool_use_and_tool_result_that_do_not_pair_are_a_400(fake, messages, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(fake).messages.create(model="tiny", max_tokens=2, messages=messages,
                                         tools=[ATOOL])
    assert e.value.status_code == 400
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": e.value.body["error"]["message"]}}
    assert words in e.value.body["error"]["message"]
    # count_tokens reads the same messages, and refuses them alike
    r = httpx2.post(fake.url + "/v1/messages/count_tokens", timeout=30,
                    json={"model": "tiny", "messages": messages, "tools": [ATOOL]})
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_anthropic_final_assistant_tool_use_is_refused_as_a_prefill(fake):
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(fake).messages.create(model="tiny", max_tokens=2, tools=[ATOOL],
                                         messages=[AUSER, _use("toolu_a")])
    assert "text only, no tool calls" in e.value.body["error"]["message"]


def test_anthropic_paired_tool_use_is_served(fake):
    r = _anthropic(fake).messages.create(model="tiny", max_tokens=2, tools=[ATOOL], messages=[
        AUSER, {"role": "assistant", "content": [
            {"type": "text", "text": "Reading both."},
            {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {}},
            {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {}}]},
        _result("toolu_b", "toolu_a", text="go on")])
    assert r.content[0].text


def test_anthropic_consecutive_messages_of_one_role_pair_as_one_turn(fake):
    # Anthropic combines consecutive messages of one role: the call may be in the first of
    # two assistant messages, and a user message may follow the one holding its result
    # (before it, its text would come first in the combined turn: refused above)
    r = _anthropic(fake).messages.create(model="tiny", max_tokens=2, tools=[ATOOL], messages=[
        AUSER, _use("toolu_a"), {"role": "assistant", "content": "Reading it."},
        _result("toolu_a"), AUSER])
    assert r.content[0].text


def _fc(i: str, kind: str = "function_call") -> dict:
    if kind == "custom_tool_call":
        return {"type": kind, "call_id": i, "name": "patch", "input": "x"}
    return {"type": kind, "call_id": i, "name": "read", "arguments": "{}"}


def _out(i: str, kind: str = "function_call_output") -> dict:
    return {"type": kind, "call_id": i, "output": "done"}


RUSER = {"role": "user", "content": "read it"}
RTOOLS = [{"type": "function", "name": "read", "parameters": {"type": "object"}},
          {"type": "custom", "name": "patch"}]


@pytest.mark.parametrize("items, param, words", [
    ([RUSER, _out("call_x")], "input[1].call_id",
     "`input[1]`: No tool call found for function call output with call_id call_x."),
    ([RUSER, _out("call_x", "custom_tool_call_output")], "input[1].call_id",
     "`input[1]`: No tool call found for custom tool call output with call_id call_x."),
    ([RUSER, _fc("call_a"), _out("call_a"), _out("call_a")], "input[3].call_id",
     "with call_id call_a."),
    ([RUSER, _fc("call_a"), RUSER, _out("call_a")], "input[1]",
     "`input[1]`: No tool output found for function call call_a."),
    ([RUSER, _fc("call_a"), _fc("call_b", "custom_tool_call"), _out("call_a")], "input[2]",
     "`input[2]`: No tool output found for custom tool call call_b."),
    ([RUSER, _fc("call_a"), _fc("call_a"), _out("call_a")], "input[2].call_id",
     "`call_a` is given twice"),
])
def test_responses_calls_and_outputs_that_do_not_pair_are_a_400(fake, items, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        fake.client(None).responses.create(model="tiny", input=items, tools=RTOOLS,
                                           max_output_tokens=2)
    assert e.value.status_code == 400
    err = e.value.body  # the SDK's: the envelope's `error`
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error",
                                                        "invalid_request_error", param)
    assert words in err["message"]


def test_responses_outputs_answer_earlier_calls_with_items_between(fake):
    # as codex echoes a reply: the text the model wrote after its calls comes before the
    # outputs, which answer in any order; a developer message between changes nothing
    r = fake.client(None).responses.create(model="tiny", tools=RTOOLS, max_output_tokens=2,
                                           input=[
        RUSER, _fc("call_a"), _fc("call_b", "custom_tool_call"),
        {"role": "assistant", "content": [{"type": "output_text", "text": "Reading."}]},
        {"role": "developer", "content": "be brief"},
        _out("call_b", "custom_tool_call_output"), _out("call_a"), RUSER])
    assert r.output_text
