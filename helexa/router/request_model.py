"""The OpenAI request bodies as msgspec Structs: every type and range checked in one decode.

`ChatBody` and `CompletionBody` share `RequestBody` (the fields both
endpoints honour). Bounds are msgspec `Meta` constraints, so a value that
the gRPC contract cannot carry (its integers are int32, the seed int64) is
a 400 naming the field before anything else runs. A field a body may carry
but helexa does not implement is declared here as `Unsupported` and listed
in `UNSUPPORTED`: `decode` refuses it naming the param (an explicit `null`
asks for nothing and passes). Fields that change nothing we produce are
declared `Harmless` and ignored. Any other key is refused as unknown.

To support a new field: declare it on the struct of its endpoint (or on
`RequestBody`), drop it from `UNSUPPORTED`, and map it in `openai_api.py`.
Cross-field rules (`top_logprobs` needs `logprobs`, ...) live there too.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from helexa.router.errors import ApiError, bad_request, clip, unsupported
from helexa.router.json_depth import json_depth_error

# stop strings and ids: the neuron checks them by the same rule (stop_caps.py)
from helexa.stop_caps import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

INT32_MAX = 2**31 - 1  # the proto's int32 fields: max_tokens, top_k, token ids
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the proto's int64 seed
MAX_N = 16
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5
# A model id or alias: Hugging Face repo ids are at most 96 characters a part. A 4 MB name was
# 12 MB of router log (every request line carries it) and came back in every refusal.
MAX_MODEL_CHARS = 256

TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
ModelName = Annotated[str, Meta(min_length=1, max_length=MAX_MODEL_CHARS)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
Unsupported = Any  # refused unless null: see UNSUPPORTED
Harmless = Any  # accepted and ignored: it changes nothing we produce
# OpenAI's bounds on its request hints (chat completions and Responses alike)
CacheKey = Annotated[str, Meta(max_length=64)]
SafetyIdentifier = Annotated[str, Meta(max_length=128)]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
# OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, string values of 512.
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)],
                          Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]
MAX_USER_CHARS = 256  # OpenAI states none; a user id is short (safety_identifier's is 128)

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


# An image's `detail`, chat's and Responses' alike: OpenAI's values (its SDK's ImageDetail:
# auto, low, high, original), checked as OpenAI does (a 400 naming it), then ignored: the
# model has one resolution rule
ImageDetail = Literal["auto", "low", "high", "original"]


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str  # a base64 data: URL, or an http(s) URL the router may fetch (router/images.py)
    detail: ImageDetail | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content: `text` and `image_url` parts are served; other kinds
    carry keys of their own (`input_audio`, ...), so unknown keys pass here and the kind is
    refused."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    """One call in an assistant message (a reply of ours echoed back)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(msgspec.Struct, kw_only=True):
    """One chat message. Unknown keys pass: clients echo back fields of earlier replies
    (`refusal`, `annotations`) that carry nothing for the prompt."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # role "tool": the call it answers
    reasoning_content: str | None = None  # an earlier reply's thought, echoed back
    function_call: Unsupported = None
    audio: Unsupported = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("function_call", "audio")


class FunctionDef(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None  # none: any JSON object
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk


class RequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields both endpoints share. `None` means "not given", as OpenAI treats null."""

    model: ModelName
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    return_token_ids: bool | None = None
    # vLLM extensions the proto carries as they are; top_k -1 means off, as in vLLM.
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=10.0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = None  # vLLM: the stop string ends the text
    # vLLM extras that tools send (guidellm, lm-eval) and that change nothing here:
    # special tokens are always skipped (and so never spaced), the prompt is never
    # truncated (one over the context is refused), min_tokens is not enforced, and vLLM's
    # prompt_logprobs field is not served (a completion's echo with logprobs gives them).
    skip_special_tokens: Harmless = None
    spaces_between_special_tokens: Harmless = None
    truncate_prompt_tokens: Harmless = None
    min_tokens: Harmless = None
    prompt_logprobs: Harmless = None

    # ignored, but typed and bounded as OpenAI types and bounds them
    metadata: Metadata | None = None
    store: bool | None = None
    parallel_tool_calls: Harmless = None
    # bounded as OpenAI bounds them; the cache key picks the neuron (docs/api.md, "Chat and
    # completions: shared fields")
    service_tier: ServiceTier | None = None
    prompt_cache_key: CacheKey | None = None
    safety_identifier: SafetyIdentifier | None = None

    # Known fields refused until implemented (named so the message says "not supported").
    tools: Unsupported = None
    tool_choice: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    logit_bias: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    web_search_options: Unsupported = None
    verbosity: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    structured_outputs: Unsupported = None
    chat_template: Unsupported = None  # vLLM: the checkpoint's own template is used

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "tools", "tool_choice", "functions", "function_call", "logit_bias", "audio",
        "modalities", "prediction", "reasoning_effort", "web_search_options", "verbosity",
        "guided_json", "guided_regex", "guided_choice", "structured_outputs", "chat_template")


class ChatBody(RequestBody, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS_CHAT)] | None = None
    response_format: ResponseFormat | None = None
    # The agent fields (helexa/router/agent_request.py maps them).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra template variables
    # vLLM's prefill: the reply continues the final (assistant) message (openai_api.py)
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = tuple(
        f for f in RequestBody.UNSUPPORTED if f not in ("tools", "tool_choice", "reasoning_effort"))


class CompletionBody(RequestBody, kw_only=True):
    # A string, a batch of strings, token ids, or a batch of token-id lists; the batch forms
    # are served when they hold one prompt (openai_api.py), a mixed list is refused there.
    prompt: str | list[str | TokenId | list[TokenId]]
    # 0: with echo, the prompt alone (and its logprobs) and nothing generated (openai_api.py)
    max_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS_COMPLETION)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    suffix: Unsupported = None


BODIES: dict[str, type[RequestBody]] = {"chat": ChatBody, "completion": CompletionBody}
_decoders = {kind: msgspec.json.Decoder(t) for kind, t in BODIES.items()}


def decode(body: bytes | Any, kind: str) -> RequestBody:
    """Raw JSON bytes (or already-decoded JSON data) as the body struct of `kind`, or an
    ApiError(400) naming the offending field."""
    try:
        if isinstance(body, (bytes, bytearray, memoryview)):
            _refuse_deep(body)
            out = _decoders[kind].decode(body)
        else:
            out = msgspec.convert(body, BODIES[kind], strict=True)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"The body is not valid JSON: {e}") from None
    _refuse_unsupported(out, "")
    if isinstance(out, ChatBody):
        for i, m in enumerate(out.messages):
            _refuse_unsupported(m, f"messages[{i}].")
    return out


def _refuse_deep(raw: bytes | bytearray | memoryview) -> None:
    if (why := json_depth_error(raw)) is not None:
        raise bad_request(why)


def _refuse_unsupported(obj: msgspec.Struct, prefix: str) -> None:
    for name in obj.UNSUPPORTED:  # type: ignore[attr-defined]
        if getattr(obj, name) is not None:
            raise unsupported(prefix + name)


_AT = re.compile(r"^(.*) - at `\$(.*)`$", re.DOTALL)  # a key may hold a line break
_KEY_AT = re.compile(r"^(.*) - at `key` in `\$(.*)`$", re.DOTALL)  # a map's key is wrong


def decode_as(raw: bytes, t: type) -> Any:
    """Raw JSON bytes as the struct `t`, or an ApiError(400) naming the offending field: the
    one decode the other front ends (Anthropic Messages, /tokenize) share with decode()."""
    _refuse_deep(raw)
    try:
        return msgspec.json.decode(raw, type=t)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"The body is not valid JSON: {e}") from None


def _validation_error(text: str) -> ApiError:
    """msgspec's `Expected `int` <= 2147483647 - at `$.max_tokens`` as a 400 naming the
    field (`max_tokens`, `messages[0].role`, `stream_options.include_usage`)."""
    key_at = _KEY_AT.match(text)
    if key_at:  # `metadata`'s keys: "a key of `metadata`: expected str of length <= 64"
        where = key_at.group(2).lstrip(".")
        detail = clip(key_at.group(1)).replace("`", "")
        return bad_request(f"a key of `{where}`: {detail[0].lower()}{detail[1:]}", where)
    m = _AT.match(text)
    msg, where = (m.group(1), m.group(2).lstrip(".")) if m else (text, "")
    for prefix, what in (("Object contains unknown field ", "unknown"),
                         ("Object missing required field ", "missing")):
        if msg.startswith(prefix):
            key = clip(msg.removeprefix(prefix).strip("`"))  # the client's, any length
            param = f"{where}.{key}" if where else key
            if what == "unknown":
                return bad_request(f"Unrecognized request argument supplied: {param}", param)
            return bad_request(f"`{param}` is required", param)
    if not where:
        return bad_request("The request body must be a JSON object" if "`object`" in msg
                           else f"Invalid request body: {clip(msg)}")
    detail = clip(msg).replace("`", "").replace(" | null", "").replace("Invalid enum value",
                                                                         "invalid value")
    detail = detail[0].lower() + detail[1:] if detail else detail
    return bad_request(f"`{where}`: {detail}", where)
