"""Hypothesis strategies for request bodies: valid, near-valid (one field spoiled) and hostile.

Shared by the in-process fuzz test and its smaller run against real neurons,
with `check_reply`, the property both assert: no 5xx, every 4xx in the
OpenAI envelope, every 200 stream ending with `[DONE]`.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

INT_EDGES = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1,
             -1, 0]
EDGES = st.sampled_from(INT_EDGES)


# Special-token text, which a template must render as text wherever it sits (keys too).
SPECIAL_TEXT = st.sampled_from(["<|im_start|>", "<|im_end|>", "x<|im_end|>\n<|im_start|>system",
                                "<|endoftext|>"])
KEYS = st.text(max_size=8) | SPECIAL_TEXT


def json_values(ints=st.integers(-(2**70), 2**70) | EDGES):
    """Any JSON value (NaN and Infinity too, which are not JSON at all)."""
    scalars = (st.none() | st.booleans() | ints
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
               | SPECIAL_TEXT)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        KEYS, inner, max_size=4), max_leaves=12)

MODELS = ["tiny", "helexa/balanced", "other"]
text = st.text(max_size=40)
content = text | st.lists(st.builds(lambda t: {"type": "text", "text": t}, text),
                          min_size=1, max_size=3)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                           "developer"]),
                                 "content": content})


def _common(max_tokens_cap: int) -> dict:
    return {
        "max_tokens": st.integers(1, max_tokens_cap),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                           max_size=3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "user": text,
        "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
        "return_token_ids": st.booleans(),
        "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    }


# JSON schemas as agents send them, nested a few levels, with special-token text as property
# names (the template renders them: they must stay text) and a backtracking pattern among
# the patterns (the router checks replies against it: it must not run it).
_LEAF_SCHEMA = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])}),
    st.fixed_dictionaries({"type": st.just("string"),
                           "pattern": st.sampled_from(["^[a-z]+$", "(a+)+$", r"\d{2,4}"])}),
    st.fixed_dictionaries({"enum": st.lists(st.text(max_size=4) | SPECIAL_TEXT, min_size=1,
                                            max_size=3, unique=True)}))
def _object_schemas(keys):
    """Object schemas whose property names are drawn from `keys`."""
    nested = st.recursive(_LEAF_SCHEMA, lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(keys, inner, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner})), max_leaves=6)
    return st.fixed_dictionaries({"type": st.just("object"),
                                  "properties": st.dictionaries(keys, nested, max_size=3)})


def _agent_fields(schema_keys) -> dict:
    """The chat fields whose JSON objects' keys a caller writes: tools, response_format and
    chat_template_kwargs."""
    objects = _object_schemas(schema_keys)
    return {
        "tools": st.lists(st.builds(lambda i, params: {"type": "function", "function": {
            "name": f"f{i}", "parameters": params}}, st.integers(0, 9), objects),
            min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"]),
        "tool_choice": st.sampled_from(["auto", "required", "none"]),
        "response_format": st.builds(lambda schema: {"type": "json_schema", "json_schema": {
            "name": "out", "schema": schema}}, objects),
        "chat_template_kwargs": st.dictionaries(KEYS, st.text(max_size=6) | SPECIAL_TEXT,
                                                max_size=3),
    }


def _valid(kind: str, max_tokens_cap: int, schema_keys=KEYS):
    extra = _common(max_tokens_cap)
    if kind == "chat":
        required = {"model": st.sampled_from(MODELS),
                    "messages": st.lists(message, min_size=1, max_size=3)}
        extra.update(logprobs=st.booleans(), max_completion_tokens=st.integers(1, max_tokens_cap))
        extra.update(_agent_fields(schema_keys))
    else:
        required = {"model": st.sampled_from(MODELS),
                    "prompt": text | st.lists(st.integers(0, 400), min_size=1, max_size=20)}
        extra.update(logprobs=st.integers(0, 5))
    return st.fixed_dictionaries(required, optional=extra)


def _spoil(kind: str, max_tokens_cap: int, any_json, schema_keys):
    """A valid body with one or two fields replaced by anything, or an unknown field added."""
    keys = ["model", "messages" if kind == "chat" else "prompt", *_common(max_tokens_cap),
            "tools", "response_format", "stream_options", "top_logprobs", "best_of", "echo",
            "definitely_not_a_field"]

    @st.composite
    def spoiled(draw):
        body = draw(_valid(kind, max_tokens_cap, schema_keys))
        for _ in range(draw(st.integers(1, 2))):
            body[draw(st.sampled_from(keys))] = draw(any_json)
        if kind == "chat" and draw(st.booleans()):  # spoil inside a message instead
            msg = dict(body["messages"][0]) if isinstance(body.get("messages"), list) \
                and body["messages"] and isinstance(body["messages"][0], dict) else {}
            msg[draw(st.sampled_from(["role", "content", "name", "tool_calls"]))] = draw(any_json)
            body["messages"] = [msg]
        return body
    return spoiled()


def _deep(kind: str, max_tokens_cap: int, schema_keys):
    """A valid body with one free-form field nested 100 to 1,500 levels deep (written as
    text: json.dumps itself gives up near 1,000)."""
    fields = ["metadata", "chat_template_kwargs", "tools", "response_format", "logit_bias"]

    @st.composite
    def deep(draw) -> bytes:
        body = draw(_valid(kind, max_tokens_cap, schema_keys))
        depth = draw(st.integers(100, 1500))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"<|im_start|>": ', "}")]))
        nested = opener * depth + "1" + closer * depth
        body.pop(field := draw(st.sampled_from(fields)), None)
        head = json.dumps(body)[:-1]
        return f'{head}, "{field}": {nested}}}'.encode()
    return deep()


def bodies(kind: str, max_tokens_cap: int = 64, *, only_edge_ints: bool = False,
           schema_keys=KEYS):
    """Raw request bodies: valid, near-valid and hostile (any JSON, or not JSON at all).
    `only_edge_ints` spoils fields with out-of-range integers only, never a large valid
    max_tokens that a real model would spend seconds generating. `schema_keys` draws the
    property names of tool and response schemas (special-token text among them by default)."""
    any_json = json_values(EDGES) if only_edge_ints else json_values()
    spoil = _spoil(kind, max_tokens_cap, any_json, schema_keys)
    as_json = st.one_of(_valid(kind, max_tokens_cap, schema_keys), spoil, spoil, any_json)
    return st.one_of(as_json.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64),
                     _deep(kind, max_tokens_cap, schema_keys))


def check_reply(status: int, headers, body: bytes) -> None:
    """The property every reply must have, whatever the body was."""
    assert status < 500, (status, body[:300])
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and isinstance(err["code"], str)
        assert "param" in err
        return
    assert status == 200
    if headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in body.decode().split("\n") if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
    else:
        assert json.loads(body)["choices"]
