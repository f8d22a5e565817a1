"""The Responses API's `custom` tools end to end with the official `openai` SDK: a forced call
comes back as a `custom_tool_call` whose free-text input keeps to the tool's grammar (a regex
on `tiny`, whose calls are hermes JSON; a Lark grammar on `qwen35`, whose XML calls carry the
input as raw text), streamed as `response.custom_tool_call_input` events, and its
`custom_tool_call_output` goes back as the tool's turn. The models' weights are random: only
the grammar makes them call."""

from __future__ import annotations

import re

import openai
import pytest
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseCustomToolCallInputDeltaEvent,
    ResponseCustomToolCallInputDoneEvent,
)

TICKET = {"type": "custom", "name": "ticket", "description": "Open a ticket",
          "format": {"type": "grammar", "syntax": "regex",
                     "definition": r"[A-Z]{2,3}-[0-9]{1,4}"}}
# A bounded apply_patch: one added file of one line, so a random model's call ends.
PATCH_LARK = '''start: "*** Begin Patch\\n" file "*** End Patch"
file: "*** Add File: " NAME "\\n+" WORD "\\n"
NAME: /[a-z]{1,8}\\.txt/
WORD: /[a-z]{1,8}/
'''
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
         "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK}}
PATCH_RE = r"\*\*\* Begin Patch\n\*\*\* Add File: [a-z]{1,8}\.txt\n\+[a-z]{1,8}\n\*\*\* End Patch"
NOTE = {"type": "custom", "name": "note", "description": "Write a note"}  # format: free text


@pytest.mark.parametrize("model,tool,pattern", [
    ("tiny", TICKET, TICKET["format"]["definition"]), ("qwen35", PATCH, PATCH_RE)])
def test_a_forced_custom_call_keeps_to_its_grammar_whole_and_streamed(router, model, tool,
                                                                      pattern):
    c = router.client()
    kw = dict(model=model, input="Do it.", tools=[NOTE, tool], max_output_tokens=120,
              temperature=0, tool_choice={"type": "custom", "name": tool["name"]})
    r = c.responses.create(**kw)
    assert r.status == "completed" and r.tool_choice.type == "custom"
    call = r.output[-1]
    assert isinstance(call, ResponseCustomToolCall) and call.name == tool["name"]
    assert re.fullmatch(pattern, call.input), call.input
    assert [t.type for t in r.tools] == ["custom", "custom"]
    with c.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = [e for e in events if isinstance(e, ResponseCustomToolCallInputDeltaEvent)]
    done = [e for e in events if isinstance(e, ResponseCustomToolCallInputDoneEvent)]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "custom_tool_call" and added.item.input == ""
    assert len(done) == 1 and done[0].input == call.input  # greedy: the same call
    assert "".join(d.delta for d in deltas) == call.input
    assert {d.item_id for d in deltas} == {done[0].item_id}
    streamed = final.output[-1]
    assert isinstance(streamed, ResponseCustomToolCall) and streamed.input == call.input


def test_a_custom_call_and_its_output_go_back_as_the_next_turn(router):
    c = router.client()
    r = c.responses.create(model="tiny", input="Open one.", tools=[TICKET], temperature=0,
                           max_output_tokens=60, tool_choice="required")
    call = r.output[-1]
    assert call.type == "custom_tool_call" and re.fullmatch(r"[A-Z]{2,3}-[0-9]{1,4}", call.input)
    follow = c.responses.create(model="tiny", tools=[TICKET], max_output_tokens=8, temperature=0,
                                input=[{"role": "user", "content": "Open one."},
                                       call.model_dump(exclude_none=True),
                                       {"type": "custom_tool_call_output",
                                        "call_id": call.call_id, "output": "opened"}])
    assert follow.status in ("completed", "incomplete") and follow.output
    # the earlier call reached the template as the tool's call, with its output after it
    n = follow.usage.input_tokens
    bare = c.responses.create(model="tiny", tools=[TICKET], max_output_tokens=1,
                              input="Open one.").usage.input_tokens
    assert n > bare


@pytest.mark.parametrize("fmt,param,reason", [
    ({"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"},
     "tools[1].format.definition", "missing_rule"),
    ({"type": "grammar", "syntax": "regex", "definition": "[z-a]"},
     "tools[1].format.definition", "invalid"),
    ({"type": "grammar", "syntax": "ebnf", "definition": "x"}, "tools[1].format.syntax", "lark"),
    ({"type": "json"}, "tools[1].format.type", "grammar"),
])
def test_a_bad_format_is_a_400_naming_the_field(router, fmt, param, reason):
    with pytest.raises(openai.BadRequestError) as e:
        router.client().responses.create(model="tiny", input="hi", tools=[
            NOTE, {"type": "custom", "name": "bad", "format": fmt}])
    assert e.value.body["param"] == param and reason in e.value.body["message"]
