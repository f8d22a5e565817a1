"""OpenAI's Responses API (`POST /v1/responses`) on the same internal request, statelessly.

The body decodes into msgspec structs (`ResponsesBody`) and translates into
the one `openai_api.ParsedRequest` the chat front end makes, so admission,
limits, constraints and the template's tool rendering are shared:

- `instructions`, and `system` / `developer` messages anywhere in `input`,
  become the one system turn, in order (templates take it only at the start);
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
import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from helexa import grammar
from helexa.router import agent_request, custom_tools, images, tool_pairing
from helexa.router.errors import bad_request, unsupported
from helexa.router.openai_api import ParsedRequest, Turn
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps
from helexa.router.request_model import (
    INT32_MAX,
    MAX_USER_CHARS,
    CacheKey,
    ChatBody,
    FunctionDef,
    ImageDetail,
    Metadata,
    ModelName,
    NamedFunction,
    NamedToolChoice,
    SafetyIdentifier,
    ServiceTier,
    Tool,
    decode_as,
)

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class Part(msgspec.Struct, kw_only=True):
    """One content part of an input item: text, or (user messages, tool outputs) an
    input_image."""

    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data: URL or an http(s) URL
    file_id: str | None = None  # input_image from OpenAI's Files API: refused by name
    detail: ImageDetail | None = None  # input_image: checked as chat's, then ignored


class Item(msgspec.Struct, kw_only=True):
    """One input item; which fields matter depends on `type` (a message may omit it)."""

    type: str = "message"
    role: str | None = None  # message
    content: str | list[Part] | None = None  # message, reasoning
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    input: str | None = None  # custom_tool_call
    output: str | list[Part] | None = None  # function_call_output, custom_tool_call_output
    summary: list[Part] | None = None  # reasoning
    id: Any = None  # accepted: ids of earlier output items
    status: Any = None
    phase: Any = None
    namespace: Any = None
    encrypted_content: Any = None


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
    req = ParsedRequest(kind="responses", model=b.model, messages=_turns(b, repaired),
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


def _text(content: str | list[Part] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS and p.type != "refusal":
            raise unsupported(f"{param}[{j}].type", f"content parts of type `{p.type}`")
        out.append(p.text or "")
    return "".join(out)


def _parts_turn(role: str, content: str | list[Part] | None, param: str,
                call_id: str = "") -> Turn:
    """A user message or a tool's output (a screenshot codex's view_image took): its text,
    and its parts in order where it holds input_image parts."""
    if content is None or isinstance(content, str):
        return Turn(role=role, content=content or "", tool_call_id=call_id)
    parts: list[str | images.ImagePart] = []
    for j, part in enumerate(content):
        q = f"{param}[{j}]"
        if part.type == "input_image":
            if part.image_url is None:
                if part.file_id is not None:
                    raise unsupported(f"{q}.file_id", "images by file_id (this router has no "
                                      "Files API); send image_url")
                raise bad_request(f"`{q}.image_url` is required", f"{q}.image_url")
            parts.append(images.from_url(part.image_url, f"{q}.image_url"))
        elif part.type in images.VIDEO_PART_TYPES:
            raise unsupported(f"{q}.type", f"video content parts (`{part.type}`)")
        elif part.type in _TEXT_PARTS or part.type == "refusal":
            parts.append(part.text or "")
        else:
            raise unsupported(f"{q}.type", f"content parts of type `{part.type}`")
    text = "".join(x for x in parts if isinstance(x, str))
    has_images = any(isinstance(x, images.ImagePart) for x in parts)
    return Turn(role=role, content=text, tool_call_id=call_id,
                parts=parts if has_images else None)


def _turns(b: ResponsesBody, repaired: list[str]) -> list[Turn]:
    system = [b.instructions] if b.instructions else []
    items = [Item(role="user", content=b.input)] if isinstance(b.input, str) else b.input
    turns: list[Turn] = []
    calls: list[dict[str, Any]] = []  # the open assistant turn's calls
    thought: list[str] = []  # reasoning for the next assistant turn
    for i, it in enumerate(items):
        p = f"input[{i}]"
        if it.type not in _CALLS and calls:
            _close_calls(turns, calls, thought)
        if it.type == "message":
            role = it.role or "user"
            if role in ("system", "developer"):
                system.append(_text(it.content, f"{p}.content"))
            elif role == "user":
                turns.append(_parts_turn("user", it.content, f"{p}.content"))
            elif role == "assistant":
                turns.append(Turn(role=role, content=_text(it.content, f"{p}.content"),
                                  reasoning="".join(thought)))
                thought.clear()
            else:
                raise bad_request(f"`{p}.role`: invalid value `{role}`", f"{p}.role")
        elif it.type == "function_call":
            if not it.call_id or not it.name:
                raise bad_request(f"`{p}` needs `call_id` and `name`", p)
            args = agent_request.call_arguments(it.arguments or "", f"{p}.arguments", repaired)
            calls.append({"id": it.call_id, "type": "function", "function": {
                "name": it.name, "arguments": args or "{}"}})
        elif it.type == "custom_tool_call":
            if not it.call_id or not it.name:
                raise bad_request(f"`{p}` needs `call_id` and `name`", p)
            calls.append({"id": it.call_id, "type": "function", "function": {
                "name": it.name, "arguments": custom_tools.arguments_of(it.input or "")}})
        elif it.type in ("function_call_output", "custom_tool_call_output"):
            if not it.call_id:
                raise bad_request(f"`{p}.call_id` is required", f"{p}.call_id")
            turns.append(_parts_turn("tool", it.output, f"{p}.output", it.call_id))
        elif it.type == "reasoning":
            text = _text(it.content, f"{p}.content") or _text(it.summary, f"{p}.summary")
            thought.append(text)
        elif it.type == "item_reference":
            raise bad_request(f"`{p}`: this router keeps no state, so no item can be "
                              f"referenced; send the item itself", p)
        else:
            raise unsupported(f"{p}.type", f"input items of type `{it.type}`")
    if calls:
        _close_calls(turns, calls, thought)
    tool_pairing.check_input(items)
    if system:
        turns.insert(0, Turn(role="system", content="\n\n".join(system)))
    if not any(t.role != "system" for t in turns):
        raise bad_request("`input` holds no user, assistant or tool item", "input")
    return turns


_CALLS = ("function_call", "custom_tool_call")


def _close_calls(turns: list[Turn], calls: list[dict[str, Any]], thought: list[str]) -> None:
    """The calls since the last item as one assistant turn (merged into an assistant message
    right before them: a reply's text and calls are one turn)."""
    if turns and turns[-1].role == "assistant" and not turns[-1].tool_calls_json:
        turns[-1].tool_calls_json = json.dumps(calls)
    else:
        turns.append(Turn(role="assistant", content="", tool_calls_json=json.dumps(calls),
                          reasoning="".join(thought)))
        thought.clear()
    calls.clear()


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
