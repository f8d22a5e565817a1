"""An agent's history holding a tool call `max_tokens` cut short, sent back as the official
openai client keeps it (`arguments` the text received), through real router and neuron
processes: the session goes on. `tiny` renders earlier calls with tojson (Qwen3's
hermes format), `qwen35` with `arguments|items` (Qwen3.5's XML)."""

from __future__ import annotations

import json

import openai
import pytest
from tokenizers import Tokenizer

from helexa.router.json_depth import MAX_JSON_DEPTH

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "required": ["path"],
                   "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}}
CUT = '{"lines": 40, "path": "src/ma'  # as received when max_tokens cut the call
# The cut call as each template renders it: the pairs written, the string as far as it got.
RENDERED = {"tiny": '{"name": "read_file", "arguments": {"lines": 40, "path": "src/ma"}}',
            "qwen35": "<function=read_file>\n<parameter=lines>\n40\n</parameter>\n"
                      "<parameter=path>\nsrc/ma\n</parameter>\n</function>"}
FIELD = "messages[2].tool_calls[0].function.arguments"


def history(arguments: str) -> list[dict]:
    return [{"role": "system", "content": "You read files."},
            {"role": "user", "content": "Open the main module."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read_file", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1",
             "content": "error: arguments are not valid JSON"}]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, tiny_checkpoint) -> dict[str, Tokenizer]:
    qwen35 = tiny_checkpoint("qwen3_5", chat_template="qwen3_5")
    return {m: Tokenizer.from_file(str(d / "tokenizer.json"))
            for m, d in (("tiny", tiny_model_dir), ("qwen35", qwen35))}


@pytest.mark.parametrize("model", ["tiny", "qwen35"])
def test_a_history_with_a_cut_call_is_answered_and_renders_what_was_written(
        router, tokenizers, model):
    c = router.client()
    kw = dict(model=model, messages=history(CUT), tools=[READ], max_tokens=2, temperature=0,
              extra_body={"return_token_ids": True})
    r = c.chat.completions.create(**kw)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = r.model_dump()["prompt_token_ids"]
    assert RENDERED[model] in tokenizers[model].decode(ids, skip_special_tokens=False)
    # the next turn renders the same history the same: the same tokens, the prefix cache hit
    again = c.chat.completions.create(**kw)
    assert again.model_dump()["prompt_token_ids"] == ids
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    log = [json.loads(line) for line in router.log_path.read_text().splitlines()
           if '"request.history_call_repaired"' in line]
    assert log and log[-1]["fields"] == [FIELD] and log[-1]["model"] == model


@pytest.mark.parametrize("model", ["tiny", "qwen35"])
def test_a_call_cut_by_max_tokens_goes_back_as_the_sdk_keeps_it(router, model):
    """The real loop: a forced call cut by max_tokens inside its string (48 tokens: past the
    call's head in both formats), its message appended as the SDK returned it, a tool
    result for it, and the next turn."""
    c = router.client()
    msgs: list = history("{}")[:2]
    cut = c.chat.completions.create(model=model, messages=msgs, tools=[READ], max_tokens=48,
                                    temperature=0, tool_choice="required")
    [call] = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason == "length"
    assert call.function.arguments.startswith('{"path": "')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # cut inside the path
    msgs += [cut.choices[0].message,
             {"role": "tool", "tool_call_id": call.id, "content": "error: not valid JSON"}]
    r = c.chat.completions.create(model=model, messages=msgs, tools=[READ], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_responses_function_call_cut_short_is_answered(router):
    c = router.client()
    r = c.responses.create(model="tiny", max_output_tokens=2, tools=[
        {"type": "function", "name": "read_file", "parameters": READ["function"]["parameters"]}],
        input=[{"role": "user", "content": "Open the main module."},
               {"type": "function_call", "call_id": "call_1", "name": "read_file",
                "arguments": CUT},
               {"type": "function_call_output", "call_id": "call_1", "output": "error"}])
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize("arguments", ['{"path" "src/ma"}', '{"path": "src/main.py"} x',
                                       '["src/ma'])
def test_arguments_that_are_no_start_of_an_object_are_still_a_400(router, arguments):
    with pytest.raises(openai.BadRequestError) as e:
        router.client().chat.completions.create(model="tiny", messages=history(arguments),
                                                tools=[READ], max_tokens=2)
    assert e.value.body["param"] == FIELD and FIELD in e.value.body["message"]


@pytest.mark.parametrize("model", ["tiny", "qwen35"])
def test_whole_arguments_nested_to_the_limit_render_and_past_it_are_a_400(router, model):
    # json.loads and the template recurse per level: to the body's depth limit both cope
    # (tojson and `arguments|items`); past it a 400 names the field and the limit, where
    # it was the template failing ("maximum recursion depth") or "must be a JSON object"
    def nested(depth: int) -> str:
        return '{"a":' * depth + "1" + "}" * depth

    c = router.client()
    r = c.chat.completions.create(model=model, messages=history(nested(MAX_JSON_DEPTH)),
                                  tools=[READ], max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for depth in (MAX_JSON_DEPTH + 1, 990):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=history(nested(depth)),
                                      tools=[READ], max_tokens=1)
        assert e.value.body["param"] == FIELD
        assert f"deeper than {MAX_JSON_DEPTH} levels" in e.value.body["message"], depth
