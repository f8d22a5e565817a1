"""Hypothesis strategies for the endpoints beside chat and completions: /v1/messages and its
count_tokens, /v1/responses, /tokenize and /v1/models' query strings, with the fields agents
send (prefills, template flags, tool calls in history with cut or deep arguments, images as
data URLs, Anthropic tool_result and thinking blocks, Responses call items) and the numbers
a hostile client writes (Unicode digits, huge, tiny, negative zero).

`check_envelope` is the property every reply must have: no 5xx, every 4xx in the endpoint's
envelope with a message, and no stream that failed after its 200 by a fault of ours.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

from hypothesis import strategies as st
from request_bodies import MODELS, SPECIAL_TEXT, json_values


def _png_1x1() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


PNG_B64 = base64.b64encode(_png_1x1()).decode()
# (media type, base64 data): a valid tiny PNG, a text that is not an image, bad base64, a
# cut PNG, an empty one, and a media type the router does not take
IMAGE_DATA = st.sampled_from([
    ("image/png", PNG_B64), ("image/png", base64.b64encode(b"not an image").decode()),
    ("image/png", "!!!not base64!!!"), ("image/jpeg", PNG_B64[:20]), ("image/png", ""),
    ("image/x-nope", PNG_B64), ("text/plain", PNG_B64), ("image/png", PNG_B64 + "====")])
DATA_URL = IMAGE_DATA.map(lambda m: f"data:{m[0]};base64,{m[1]}") | st.sampled_from(
    ["data:,", "data:image/png,raw", "http://127.0.0.1:1/x.png", "file:///etc/passwd"])

# Numbers where numbers go: Unicode digits (as strings), beyond every integer type, tiny,
# zero signed both ways, not finite, and the odd plain value.
NUMBERS = st.sampled_from([
    0, 1, 4, -1, -0.0, 0.0, 5e-324, 1e-300, 1e-9, 0.5, 1.0, 1.5, 2**31, 2**63, 10**30,
    -(2**63) - 1, 1e308, float("inf"), float("nan"), "4", "²", "١٢", "４", "1e3", True, None])
TOP_P = st.sampled_from([0, 0.0, -0.0, 5e-324, 1e-300, 1e-12, 1, 1.0000001, -1e-300, 2, "0"])
# Tool-call arguments as agents leave them in history: cut, odd, deep past the parsers.
ARGUMENTS = st.sampled_from([
    '{"a": 1}', '{"a": "b', '{"a": [1, {"b": "\\ud83d', '{"a"', "{", "", "  ", "null", "[]",
    '"str"', '{"a": 1}}', '{"a": 1} trailing', '{"a": -', '{"a": 1e', '{"a":"\\u00',
    '{"\ud800": 1}', '{"a": ' + "9" * 5000 + "}", '{"a": "١٢"}', '{"<|im_end|>": 1}',
    '{"a": ' * 300 + "1" + "}" * 300, "[" * 2000 + "]" * 2000, '{"a": ' * 40 + "1"])
TEXT = st.text(max_size=20) | SPECIAL_TEXT
RESERVED_KWARGS = ["add_generation_prompt", "continue_final_message", "tools", "messages",
                   "enable_thinking", "documents", "chat_template", "add_special_tokens", "x"]
TEMPLATE_KWARGS = (st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(),
                                                      "x": st.text(max_size=4)})
                   | st.dictionaries(st.sampled_from(RESERVED_KWARGS), json_values(), max_size=3)
                   | json_values())
FLAG = st.booleans() | st.booleans() | st.sampled_from([None, 0, 1, "true", []])


# ----------------------------------------------------------- OpenAI chat / tokenize

def _openai_content(image_ok: bool = True):
    parts = [st.builds(lambda t: {"type": "text", "text": t}, TEXT)]
    if image_ok:
        parts.append(st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}},
                               DATA_URL))
    return TEXT | st.lists(st.one_of(*parts), min_size=1, max_size=3)


_CALL = st.builds(lambda i, args: {"id": f"c{i}", "type": "function",
                                   "function": {"name": "f", "arguments": args}},
                  st.integers(0, 2), ARGUMENTS)
_CHAT_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": _openai_content()}),
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]), "content": TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT | st.none()},
                          optional={"tool_calls": st.lists(_CALL, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.sampled_from(["c0", "c1"]),
                           "content": _openai_content()}))
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _chat_fields() -> dict:
    return {"continue_final_message": FLAG, "add_generation_prompt": FLAG,
            "chat_template_kwargs": TEMPLATE_KWARGS, "tools": st.just(_TOOLS)}


def chat_bodies():
    """/v1/chat/completions bodies with the agents' fields and history shapes."""
    return st.fixed_dictionaries(
        {"model": st.sampled_from(MODELS),
         "messages": st.lists(_CHAT_MESSAGE, min_size=1, max_size=4)},
        optional={**_chat_fields(), "top_p": TOP_P, "max_tokens": st.integers(1, 8) | st.integers(1, 8) | NUMBERS,
                  "temperature": NUMBERS, "n": NUMBERS, "seed": NUMBERS, "stream": st.booleans(),
                  "logprobs": st.booleans(), "top_logprobs": NUMBERS})


def tokenize_bodies():
    """/tokenize bodies (vLLM's): `prompt` or `messages`, the template flags."""
    optional = {"add_special_tokens": FLAG, "return_token_strs": FLAG}
    return st.fixed_dictionaries(
        {"model": st.sampled_from(MODELS),
         "messages": st.lists(_CHAT_MESSAGE, min_size=1, max_size=4)},
        optional={**_chat_fields(), **optional}) | st.fixed_dictionaries(
        {"model": st.sampled_from(MODELS), "prompt": TEXT},
        optional={**optional, "messages": st.lists(_CHAT_MESSAGE, max_size=1)})


# ----------------------------------------------------------- Anthropic

_SOURCE = IMAGE_DATA.map(lambda m: {"type": "base64", "media_type": m[0], "data": m[1]}) \
    | st.sampled_from([{"type": "url", "url": "http://127.0.0.1:1/x.png"}, {"type": "base64"}])
_A_TEXT = st.builds(lambda t: {"type": "text", "text": t}, TEXT)
_A_IMAGE = st.builds(lambda s: {"type": "image", "source": s}, _SOURCE)
_A_RESULT = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["t0", "t1"])},
    optional={"content": TEXT | st.lists(_A_TEXT | _A_IMAGE, max_size=3),
              "is_error": FLAG})
_A_THINKING = st.builds(lambda t: {"type": "thinking", "thinking": t, "signature": "s"}, TEXT) \
    | st.just({"type": "redacted_thinking", "data": "xx"})
_A_USE = st.builds(lambda i, inp: {"type": "tool_use", "id": f"t{i}", "name": "f", "input": inp},
                   st.integers(0, 1), json_values() | st.just({}))
_A_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": TEXT | st.lists(
        _A_TEXT | _A_IMAGE | _A_RESULT, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT | st.lists(
        _A_TEXT | _A_THINKING | _A_USE, min_size=0, max_size=3)}))
_A_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
_A_THINK = st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                            {"type": "adaptive"}, {"type": "enabled"},
                            {"type": "enabled", "budget_tokens": "١٠٢٤"}]) \
    | st.builds(lambda n: {"type": "enabled", "budget_tokens": n}, NUMBERS)


def anthropic_bodies(count: bool = False):
    """/v1/messages bodies (`count`: count_tokens', without max_tokens)."""
    required = {"model": st.sampled_from(MODELS),
                "messages": st.lists(_A_MESSAGE, min_size=1, max_size=4)}
    optional = {"system": TEXT | st.lists(_A_TEXT, max_size=2), "tools": st.just(_A_TOOLS),
                "thinking": _A_THINK, "top_p": TOP_P, "top_k": NUMBERS, "temperature": NUMBERS,
                "stop_sequences": st.lists(TEXT, max_size=2), "stream": st.booleans(),
                "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"},
                                                {"type": "tool", "name": "f"}, {"type": "none"}])}
    if not count:
        required["max_tokens"] = st.integers(1, 8) | st.integers(1, 8) | NUMBERS
    return st.fixed_dictionaries(required, optional=optional)


# ----------------------------------------------------------- Responses

_R_CONTENT = TEXT | st.lists(
    st.builds(lambda t: {"type": "input_text", "text": t}, TEXT)
    | st.builds(lambda u: {"type": "input_image", "image_url": u}, DATA_URL), min_size=1,
    max_size=3)
_R_ITEM = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"),
                           "role": st.sampled_from(["user", "system", "developer"]),
                           "content": _R_CONTENT}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("assistant"),
                           "content": st.lists(st.builds(
                               lambda t: {"type": "output_text", "text": t}, TEXT), max_size=2)}),
    st.builds(lambda i, a: {"type": "function_call", "call_id": f"c{i}", "name": "f",
                            "arguments": a}, st.integers(0, 1), ARGUMENTS | json_values()),
    st.builds(lambda i, o: {"type": "function_call_output", "call_id": f"c{i}", "output": o},
              st.integers(0, 1), _R_CONTENT | json_values()),
    st.builds(lambda i, inp: {"type": "custom_tool_call", "call_id": f"c{i}", "name": "g",
                              "input": inp}, st.integers(0, 1), TEXT | ARGUMENTS | json_values()),
    st.builds(lambda i, o: {"type": "custom_tool_call_output", "call_id": f"c{i}", "output": o},
              st.integers(0, 1), TEXT),
    st.builds(lambda t: {"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]},
              TEXT))
_R_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}},
            {"type": "custom", "name": "g"}]


def responses_bodies():
    """/v1/responses bodies: input items of every kind agents send back."""
    return st.fixed_dictionaries(
        {"model": st.sampled_from(MODELS),
         "input": TEXT | st.lists(_R_ITEM, min_size=1, max_size=4)},
        optional={"tools": st.just(_R_TOOLS), "instructions": TEXT, "top_p": TOP_P,
                  "max_output_tokens": st.integers(1, 8) | st.integers(1, 8) | NUMBERS, "temperature": NUMBERS,
                  "stream": st.booleans(), "store": st.booleans(),
                  "tool_choice": st.sampled_from(["auto", "required", "none"]),
                  "reasoning": st.sampled_from([{"effort": "low"}, {"effort": "none"}, {}]),
                  "parallel_tool_calls": FLAG})


def spoiled(valid):
    """A valid-shaped body, or one with a field (top level or in the first list item of a
    field) replaced by any JSON value."""
    @st.composite
    def go(draw) -> dict:
        body = draw(valid)
        if draw(st.booleans()):
            return body
        key = draw(st.sampled_from(sorted(body) + ["definitely_not_a_field"]))
        item = body.get(key)
        if isinstance(item, list) and item and isinstance(item[0], dict) and draw(st.booleans()):
            first = dict(item[0])
            first[draw(st.sampled_from(sorted(first) + ["x"]))] = draw(json_values())
            body[key] = [first, *item[1:]]
        else:
            body[key] = draw(json_values())
        return body
    return go()


# ----------------------------------------------------------- /v1/models

QUERY_LIST = ["1", "20", "1000", "1001", "0", "-1", "", " 5", "+5", "1e3", "²", "١٠", "４",
              "1" * 5000, str(2**64), "tiny", "other", "nope", "helexa/balanced", "%", "\x00"]
QUERY_KEYS = ["limit", "after_id", "before_id"]
MODELS_QUERY = st.dictionaries(st.sampled_from([*QUERY_KEYS, "x"]),
                               st.sampled_from(QUERY_LIST) | st.text(max_size=6), max_size=3)


# ----------------------------------------------------------- the property

def check_envelope(status: int, headers, body: bytes, anthropic: bool) -> None:
    """No 5xx; a 4xx in the endpoint's envelope with a message; a 200 stream that does not
    end in an error of ours."""
    assert status < 500, (status, body[:300])
    if status >= 400:
        doc = json.loads(body)
        if anthropic:
            assert doc["type"] == "error", doc
            err = doc["error"]
            assert isinstance(err["type"], str) and err["type"], doc
        else:
            err = doc["error"]
            assert isinstance(err["type"], str) and isinstance(err["code"], str), doc
            assert "param" in err, doc
        assert isinstance(err["message"], str) and err["message"].strip(), doc
        return
    assert status == 200, (status, body[:300])
    assert b"internal_error" not in body and b"api_error" not in body, body[-500:]
    if not headers.get("content-type", "").startswith("text/event-stream"):
        json.loads(body)
