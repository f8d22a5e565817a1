"""OpenAI's Responses API (`POST /v1/responses`) on the same internal request, statelessly.

The body decodes into msgspec structs (`ResponsesBody`) and translates into
the one `openai_api.ParsedRequest` the chat front end makes, so admission,
limits, constraints and the template's tool rendering are shared:

- `instructions`, and the `system` / `developer` messages `input` opens with,
  become the one system turn, in order (templates take it only at the start);
  one after any other item, a system turn where it stands, so the prompt
  before it is kept and the prefix cache holds it (responses_input.py turns
  the items into turns);
- `input` is a string (one user turn) or items: `message` (content a string
  or `input_text` / `output_text` parts, and in a user message `input_image`
  parts with an `image_url`, a data: or http(s) URL, as chat's image_url parts:
  router/images.py), `function_call` (an assistant turn's
  calls; consecutive calls share one turn), `function_call_output` (a tool
  turn; its `output` a string or parts, `input_image` ones included: codex's
  view_image answers with the image), `custom_tool_call` /
  `custom_tool_call_output` (the same, for a custom tool: custom_tools.py), `reasoning` (the next assistant turn's earlier thought, from its
  `content` or `summary` text);
- `tools` of type `function` (and the functions inside a `namespace` tool)
  are offered, and `custom` tools as the function custom_tools.py renders;
  hosted tools (`web_search`, `file_search`, ...) run on
  OpenAI's side and are not offered to the model (codex always lists one);
- `tool_choice`, `parallel_tool_calls`, `reasoning.effort`, `text.format`
  and `max_output_tokens` (a ceiling, fitted to the context) map as the
  chat fields do (agent_request.py);
- `include: ["message.output_text.logprobs"]` with `top_logprobs` asks for
  the answer's logprobs (responses_logprobs.py), `prompt_cache_key` picks
  the neuron as a conversation's opening does (serve.py, selection.py), and
  `safety_identifier`, `service_tier` and `max_tool_calls` are checked as
  OpenAI checks them and echoed, changing nothing (docs/api.md says why).

The router keeps no state: `store` is accepted and nothing is stored;
`previous_response_id` and `conversation` are a 400 saying so.
The reply is encoded by responses_encode.py.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from helexa import grammar
from helexa.router import agent_request, custom_tools
from helexa.router.errors import bad_request, unsupported
from helexa.router.openai_api import ParsedRequest
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps
from helexa.router.request_model import (
    INT32_MAX,
    MAX_USER_CHARS,
    CacheKey,
    ChatBody,
    FunctionDef,
    Metadata,
    ModelName,
    NamedFunction,
    NamedToolChoice,
    SafetyIdentifier,
    ServiceTier,
    Tool,
    decode_as,
)
from helexa.router.responses_input import Item, turns_of


class RTool(msgspec.Struct, kw_only=True):
    """A tool; hosted types carry fields of their own, so unknown keys pass here."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[RTool] | None = None  # namespace
    format: Any = None  # custom: text, or a lark / regex grammar (custom_tools.py)


class RToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: Any = None  # accepted: the model's length is its own




class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelName
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    stream: bool | None = None
    tools: list[RTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | RToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None  # refused: no state
    conversation: Any = None  # refused: no state
    background: bool | None = None  # refused when true
    include: list[str] | None = None  # "message.output_text.logprobs" is served
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # Bounded as OpenAI bounds them, and echoed; the cache key also picks the neuron
    # (docs/api.md, "`POST /v1/responses` (OpenAI Responses)").
    prompt_cache_key: CacheKey | None = None
    safety_identifier: SafetyIdentifier | None = None
    service_tier: ServiceTier | None = None  # one tier here: "default" is echoed
    max_tool_calls: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None  # built-in tools'
    # Echoed in every response object a stream sends, so bounded: `metadata` as OpenAI
    # bounds it, `user` by MAX_USER_CHARS (a megabyte of each made a 6 MB stream of 30 tokens).
    metadata: Metadata | None = None
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    # Accepted and ignored: storage, tracking and caching hints.
    store: bool | None = None  # OpenAI's types, though nothing changes with them
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    client_metadata: Any = None  # codex's
    stream_options: Any = None


def parse_request(raw: bytes, caps: RequestCaps = DEFAULT_CAPS) -> ParsedRequest:
    """A /v1/responses body as the internal request, or ApiError(400) naming the field."""
    b: ResponsesBody = decode_as(raw, ResponsesBody)
    if b.previous_response_id is not None or b.conversation is not None:
        param = "previous_response_id" if b.previous_response_id is not None else "conversation"
        raise bad_request(f"`{param}`: this router keeps no state (responses are not stored); "
                          f"send the whole conversation in `input`", param)
    if b.background:
        raise unsupported("background", "responses are answered in the request")
    repaired: list[str] = []
    turns = turns_of(b.instructions, b.input, repaired)
    req = ParsedRequest(kind="responses", model=b.model, messages=turns,
                        repaired_calls=repaired, max_tokens=b.max_output_tokens, fit_max_tokens=True,
                        temperature=b.temperature, top_p=b.top_p, stream=bool(b.stream),
                        include_usage=True)
    _tools(b, req, caps)
    if b.reasoning is not None and b.reasoning.effort is not None:
        effort = b.reasoning.effort
        req.reasoning_effort = {"minimal": "low", "xhigh": "high", "max": "high"}.get(effort,
                                                                                     effort)
    req.reasoning_summary = b.reasoning is not None and \
        (b.reasoning.summary or b.reasoning.generate_summary) is not None
    _text_format(b, req, caps)
    req.logprobs = LOGPROBS in (b.include or [])
    req.top_logprobs = (b.top_logprobs or 0) if req.logprobs else 0
    req.cache_key = b.prompt_cache_key
    req.echoed = echoed(b)
    return req


LOGPROBS = "message.output_text.logprobs"  # the `include` that asks for the answer's logprobs


def echoed(b: ResponsesBody) -> dict[str, Any]:
    """The settings a response object repeats as the client sent them (OpenAI's Response:
    its `instructions`, `metadata`, `user`, `reasoning`, `text.format`, each function
    tool's `strict`, `prompt_cache_key`, `safety_identifier`, `max_tool_calls`,
    `top_logprobs`), not as the router applied them: a json_schema format is enforced
    whatever its `strict` says (docs/api.md, "`POST /v1/responses` (OpenAI Responses)")."""
    fmt = b.text.format if b.text is not None else None
    fmt_out: dict[str, Any] = {"type": fmt.type if fmt is not None else "text"}
    if fmt is not None and fmt.type == "json_schema":  # name and schema as applied if absent
        fmt_out.update(name=fmt.name or "output", schema=fmt.schema if fmt.schema is not None
                       else {"type": "object"}, description=fmt.description, strict=fmt.strict)
    r = b.reasoning or Reasoning()
    return {"instructions": b.instructions,
            "metadata": b.metadata or {}, "user": b.user,
            "reasoning": {"effort": r.effort, "summary": r.summary or r.generate_summary},
            "format": fmt_out,
            "strict": {t.name: t.strict for _, t in _functions(b.tools or [])
                       if t.type == "function"},
            "prompt_cache_key": b.prompt_cache_key, "safety_identifier": b.safety_identifier,
            "max_tool_calls": b.max_tool_calls, "top_logprobs": b.top_logprobs or 0}


def _functions(tools: list[RTool], at: str = "tools") -> list[tuple[str, RTool]]:
    """The function and custom tools offered to the model, each with its path as the client
    listed it (`tools[2]`, a namespace's `tools[3].tools[0]`)."""
    out = []
    for i, t in enumerate(tools):
        if t.type in ("function", "custom"):
            out.append((f"{at}[{i}]", t))
        elif t.type == "namespace":
            out += _functions(t.tools or [], f"{at}[{i}].tools")
    return out


def _tools(b: ResponsesBody, req: ParsedRequest, caps: RequestCaps) -> None:
    listed = _functions(b.tools or [])
    fns = [t for _, t in listed]
    for where, t in listed:
        if not t.name:
            raise bad_request(f"`{where}.name` is required", f"{where}.name")
        if t.type == "custom":
            fmt = custom_tools.format_of(t.format, where, caps)
            req.custom_tools[t.name] = {"type": "custom", "name": t.name,
                                        "description": t.description, "format": fmt}
            req.compiles.append(functools.partial(custom_tools.compile_check, fmt, where))
    body = ChatBody(model=b.model, messages=[], tools=[Tool(type="function", function=FunctionDef(
        name=t.name or "", description=t.description, parameters=t.parameters
        if t.type == "function" else custom_tools.parameters(
            req.custom_tools[t.name or ""]["format"]))) for t in fns] or None,
        parallel_tool_calls=b.parallel_tool_calls)
    c = b.tool_choice
    if isinstance(c, RToolChoice):
        if c.type not in ("function", "custom") or not c.name:
            raise unsupported("tool_choice", f"tool_choice of type `{c.type}`")
        if c.type == "custom" and c.name not in req.custom_tools and any(
                t.name == c.name for t in fns):  # its kind as listed (a missing one: below)
            raise bad_request(f"`tool_choice` names `{c.name}` as a custom tool; it is listed "
                              "as a function (`{\"type\": \"function\"}`)", "tool_choice")
        body.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=c.name))
    elif c is not None:
        body.tool_choice = c
    if body.tool_choice in ("auto", "required") and not fns:
        body.tool_choice = None  # only hosted tools were listed: nothing to call here
    agent_request.apply_as(body, req, caps, [w for w, _ in listed], "parameters")


def _text_format(b: ResponsesBody, req: ParsedRequest, caps: RequestCaps) -> None:
    fmt = b.text.format if b.text is not None else None
    if fmt is None or fmt.type == "text":
        return
    if req.tool_choice in ("required", "function"):
        return  # the output is the forced call; the format is for text (openai-agents sends both)
    if fmt.type == "json_object":
        req.constraint = grammar.Constraint(kind="json_object")
        return
    agent_request.constrain_to_schema(req, fmt.schema if fmt.schema is not None
                                      else {"type": "object"}, "text.format.schema", caps)
    req.response_schema_name = fmt.name
