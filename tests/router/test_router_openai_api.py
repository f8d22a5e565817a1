"""Request validation: what is accepted, and the 400 (naming the param) for what is not."""

from __future__ import annotations

import pytest

from helexa.router.errors import ApiError
from helexa.router.openai_api import parse_request

MSG = [{"role": "user", "content": "hi"}]


def refused(body: dict, kind: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(body, kind)
    assert e.value.status == 400
    return e.value


def test_chat_with_all_supported_fields():
    r = parse_request({
        "model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok", "name": "bot"},
            {"role": "developer", "content": "dev"}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5, "seed": 3,
        "stop": "\n", "presence_penalty": 1, "frequency_penalty": -1, "logprobs": True,
        "top_logprobs": 2, "n": 2, "user": "u", "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "metadata": {"a": "b"}, "tools": None}, "chat")
    assert [(t.role, t.content) for t in r.messages] == [
        ("system", "be brief"), ("user", "ab"), ("assistant", "ok"), ("system", "dev")]
    assert r.max_tokens == 7  # max_completion_tokens wins
    assert (r.temperature, r.top_p, r.seed, r.stop) == (0.0, 0.5, 3, ["\n"])
    assert (r.logprobs, r.top_logprobs, r.n, r.include_usage, r.return_token_ids) == (
        True, 2, 2, True, True)
    assert r.prompt_chars == len("be briefabokdev")


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"1": 2}), ("functions", [{}]), ("function_call", "auto"),
    ("guided_json", {}),
])
def test_unsupported_fields_are_refused_naming_the_param(field, value):
    e = refused({"model": "m", "messages": MSG, field: value})
    assert e.param == field and "not supported" in e.message and e.code == "invalid_request_error"


def test_unknown_field_is_refused_and_harmless_ones_pass():
    assert refused({"model": "m", "messages": MSG, "frobnicate": 1}).param == "frobnicate"
    parse_request({"model": "m", "messages": MSG, "store": False, "service_tier": "auto",
                   "response_format": {"type": "text"}}, "chat")


def test_bad_image_and_video_parts_and_the_function_role_are_refused():
    # images are served (docs/api.md#images): a URL that is neither data: nor http(s) is not
    e = refused({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert e.param == "messages[0].content[1].image_url" and "data: URL" in e.message
    e = refused({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}]}]})
    assert e.param == "messages[0].content[0].type" and "video" in e.message
    e = refused({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/bmp;base64,AA=="}}]}]})
    assert "image/bmp" in e.message
    e = refused({"model": "m", "messages": [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    assert e.param == "messages[0].content" and "an assistant message (user and tool" in e.message
    assert refused({"model": "m", "messages": [{"role": "function", "content": "x"}]}).param == \
        "messages[0].role"


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "m", "messages": MSG, "temperature": 3}, "temperature"),
    ({"model": "m", "messages": MSG, "temperature": "hot"}, "temperature"),
    ({"model": "m", "messages": MSG, "top_p": -0.1}, "top_p"),
    ({"model": "m", "messages": MSG, "top_p": 1.5}, "top_p"),
    ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"model": "m", "messages": MSG, "n": 0}, "n"),
    ({"model": "m", "messages": MSG, "n": 17}, "n"),
    ({"model": "m", "messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": "m", "messages": MSG, "stop": [""]}, "stop[0]"),
    ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
])
def test_ranges_and_types(body, param):
    assert refused(body).param == param


def test_completion_prompt_forms():
    assert parse_request({"model": "m", "prompt": "hi"}, "completion").prompt_text == "hi"
    assert parse_request({"model": "m", "prompt": ["hi"]}, "completion").prompt_text == "hi"
    r = parse_request({"model": "m", "prompt": [1, 2, 3], "logprobs": 2}, "completion")
    assert (r.prompt_ids, r.logprobs, r.top_logprobs) == ([1, 2, 3], True, 2)
    assert parse_request({"model": "m", "prompt": [[4, 5]]}, "completion").prompt_ids == [4, 5]
    # a batch of several prompts: each its own choices
    batch = parse_request({"model": "m", "prompt": ["a", "b"]}, "completion")
    assert [(r.prompt_text, r.prompt_ids) for r in batch.per_prompt()] == [("a", None),
                                                                          ("b", None)]
    ids = parse_request({"model": "m", "prompt": [[1], [2, 3]]}, "completion").per_prompt()
    assert [r.prompt_ids for r in ids] == [[1], [2, 3]]
    assert refused({"model": "m", "prompt": ["a", [1]]}, "completion").param == "prompt"
    assert refused({"model": "m", "prompt": [1, -2]}, "completion").param == "prompt[1]"
    assert parse_request({"model": "m", "prompt": "x", "echo": True}, "completion").echo
    # echo of token ids (the neuron decodes them), with logprobs (the prompt's), and with
    # max_tokens 0 (the prompt alone: lm-eval's loglikelihood), which only echo may ask
    assert parse_request({"model": "m", "prompt": [1], "echo": True}, "completion").echo
    r = parse_request({"model": "m", "prompt": "x", "echo": True, "logprobs": 1,
                       "max_tokens": 0}, "completion")
    assert (r.echo, r.top_logprobs, r.max_tokens) == (True, 1, 0)
    assert refused({"model": "m", "prompt": "x", "max_tokens": 0},
                   "completion").param == "max_tokens"
    assert refused({"model": "m", "prompt": "x", "echo": True, "max_tokens": -1},
                   "completion").param == "max_tokens"
    assert refused({"model": "m", "prompt": "x", "logprobs": 6}, "completion").param == "logprobs"
    # Chat-only fields are unknown to completions.
    assert refused({"model": "m", "prompt": "x", "messages": MSG}, "completion").param == "messages"


def test_body_must_be_an_object():
    assert refused([1, 2]).param is None


@pytest.mark.parametrize("body,kind,param", [
    ({"model": "m", "messages": [{"role": ["user"], "content": "x"}]}, "chat", "messages[0].role"),
    ({"model": "m", "messages": [{"role": {"a": 1}, "content": "x"}]}, "chat", "messages[0].role"),
    ({"model": "m", "messages": MSG, "max_tokens": 2**31}, "chat", "max_tokens"),
    ({"model": "m", "messages": MSG, "max_tokens": 2**64 + 1}, "chat", "max_tokens"),
    ({"model": "m", "messages": MSG, "max_completion_tokens": 2**63}, "chat",
     "max_completion_tokens"),
    ({"model": "m", "messages": MSG, "top_k": 2**40}, "chat", "top_k"),
    ({"model": "m", "messages": MSG, "stop_token_ids": [1, 2**31]}, "chat", "stop_token_ids[1]"),
    ({"model": "m", "messages": MSG, "seed": 2**63}, "chat", "seed"),
    ({"model": "m", "messages": MSG, "temperature": 1e400}, "chat", "temperature"),
    ({"model": "m", "messages": MSG, "n": 2**70}, "chat", "n"),
    ({"model": "m", "messages": MSG, "stream_options": {"include_usage": "yes"}}, "chat",
     "stream_options.include_usage"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": 1}]}]}, "chat",
     "messages[0].content[0].type"),
    ({"model": "m", "prompt": [1, 2**31]}, "completion", "prompt[1]"),
    ({"model": "m", "prompt": [[1, 2**32]]}, "completion", "prompt[0][1]"),
    ({"model": "m", "prompt": [1, "a"]}, "completion", "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": 2**31}, "completion", "max_tokens"),
    ({"model": ["m"], "prompt": "x"}, "completion", "model"),
    # ignored, but typed and bounded as OpenAI's own API types and bounds them
    ({"model": "m", "messages": MSG, "store": "yes"}, "chat", "store"),
    ({"model": "m", "messages": MSG, "metadata": {str(i): "v" for i in range(17)}}, "chat",
     "metadata"),
    ({"model": "m", "messages": MSG, "metadata": {"k": "v" * 513}}, "chat", "metadata[...]"),
    ({"model": "m", "messages": MSG, "user": "u" * 257}, "chat", "user"),
    ({"model": "m", "prompt": "x", "user": "u" * 10_000}, "completion", "user"),
])
def test_hostile_values_are_400_naming_the_field(body, kind, param):
    e = refused(body, kind)
    assert e.param == param and e.code == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in e.message


def test_raw_bytes_decode_like_objects():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'
    assert parse_request(raw, "chat").max_tokens == 3
    with pytest.raises(ApiError) as e:
        parse_request(b'{"model": "m", "messages": [', "chat")
    assert e.value.status == 400 and "not valid JSON" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_request(b'{"model": "m", "prompt": [1, 99999999999999999999999]}', "completion")
    assert e.value.status == 400 and e.value.param == "prompt[1]"


def test_vllms_continue_final_message_continues_the_assistants_answer():
    prefill = [*MSG, {"role": "assistant", "content": "The sea"}]
    for extra in ({}, {"add_generation_prompt": False}):
        r = parse_request({"model": "m", "messages": prefill, "continue_final_message": True,
                           **extra}, "chat")
        assert r.continue_final and r.messages[-1].content == "The sea"
    assert not parse_request({"model": "m", "messages": prefill}, "chat").continue_final
    for body, param in (
            ({"messages": MSG, "continue_final_message": True}, "messages[0]"),
            ({"messages": prefill, "continue_final_message": True,
              "add_generation_prompt": True}, "add_generation_prompt"),
            ({"messages": MSG, "add_generation_prompt": False}, "add_generation_prompt"),
            ({"messages": prefill, "continue_final_message": True,
              "response_format": {"type": "json_object"}}, "messages[1]")):
        assert refused({"model": "m", **body}).param == param, body


def test_chat_template_kwargs_may_carry_vllms_flags_and_no_other_request_field():
    # vLLM merges chat_template_kwargs over the request's own add_generation_prompt and
    # continue_final_message; a key naming another field is a 400 naming it, never a clash
    # at the neuron's template call
    prefill = [*MSG, {"role": "assistant", "content": "The sea"}]
    r = parse_request({"model": "m", "messages": prefill, "chat_template_kwargs": {
        "continue_final_message": True, "add_generation_prompt": False, "x": 1}}, "chat")
    assert r.continue_final and r.template_kwargs == {"x": 1}
    r = parse_request({"model": "m", "messages": prefill, "continue_final_message": True,
                       "chat_template_kwargs": {"continue_final_message": False}}, "chat")
    assert not r.continue_final and r.template_kwargs == {}
    # a refused flag is named where the client put it
    assert refused({"model": "m", "messages": prefill, "chat_template_kwargs": {
        "continue_final_message": True, "add_generation_prompt": True}}).param \
        == "chat_template_kwargs.add_generation_prompt"
    assert refused({"model": "m", "messages": prefill, "continue_final_message": True,
                    "add_generation_prompt": True}).param == "add_generation_prompt"
    assert refused({"model": "m", "messages": MSG, "chat_template_kwargs": {
        "add_generation_prompt": False}}).param == "chat_template_kwargs.add_generation_prompt"
    for key in ("messages", "tools", "chat_template", "tokenize"):
        e = refused({"model": "m", "messages": MSG, "chat_template_kwargs": {key: []}})
        assert e.param == f"chat_template_kwargs.{key}" and "not a template variable" \
            in e.message, key
    e = refused({"model": "m", "messages": MSG,
                 "chat_template_kwargs": {"add_generation_prompt": "no"}})
    assert e.param == "chat_template_kwargs.add_generation_prompt" and "boolean" in e.message
