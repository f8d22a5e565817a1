"""Anthropic's Messages API (`POST /v1/messages`) on the same internal request.

The body decodes into msgspec structs (`MessagesBody`) and translates into
the one `openai_api.ParsedRequest` the OpenAI chat front end makes, so
admission, aliases, limits, the engine's constraints and the template's tool
rendering are shared: `system` (less Claude Code's billing header) becomes the system
turn, and `system` messages in `messages` (Anthropic's mid-conversation system messages,
which Claude Code sends; placed as Anthropic's rules say, else a 400) a system turn where
each stands (anthropic_system.py); `tool_use` blocks an
assistant turn's tool calls; `tool_result` blocks tool turns; `thinking`
blocks the assistant's earlier thought; `tools` (`input_schema`) the
functions; `tool_choice` auto / any / tool / none the OpenAI choices auto /
required / named / none; `thinking: {type: enabled, budget_tokens}` an
explicit thinking budget; a final assistant message the answer begun (a
prefill, `_prefill`), which the reply continues. The reply is built from the same parsed parts
(agent_output.py) as content blocks (`thinking`, `text`, `tool_use`), with
Anthropic's stop reasons and usage; streaming follows Anthropic's event
sequence (message_start, content_block_start / _delta / _stop per block,
message_delta, message_stop). `max_tokens` is a ceiling, as Anthropic's
clients use it: over what the context leaves, the neuron fits it
(`fit_max_tokens`). Errors use Anthropic's envelope (anthropic_errors.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from helexa.router import agent_request, anthropic_system, images, tool_pairing, tool_reference
from helexa.router.errors import bad_request, clip, unsupported
from helexa.router.openai_api import ParsedRequest, Turn, continue_final
from helexa.router.request_caps import DEFAULT_CAPS, RequestCaps
from helexa.router.request_model import (
    INT32_MAX,
    MAX_STOP,
    ChatBody,
    FunctionDef,
    FunctionName,
    ModelName,
    NamedFunction,
    NamedToolChoice,
    StopString,
    Tool,
    decode_as,
)


class Block(msgspec.Struct, kw_only=True):
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    cache_control: Any = None  # accepted: changes nothing here (the prefix cache is automatic)
    citations: Any = None
    source: Any = None  # image: {type: base64, media_type, data} or {type: url, url}
    tool_name: str | None = None  # tool_reference (tool_reference.py)
    tool: Any = None  # tool_addition / tool_removal (anthropic_system.py)


class AMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    output_config: AOutputConfig | None = None  # a system message's: effort from there on
    clear_at: str | None = None  # a system message's: "next_user_message" (anthropic_system.py)


class ATool(msgspec.Struct, kw_only=True):
    name: FunctionName
    input_schema: dict[str, Any] | None = None  # a client tool's; server tools have none
    description: str | None = None
    type: str | None = None  # "custom" or absent; server tools are refused below
    cache_control: Any = None
    defer_loading: bool = False  # out of the prompt's tool list (tool_reference.py)


class AToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinking(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """enabled / between_tools: a budget; adaptive: the model's own (catalogue) budget."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    # ignored (the thought is returned whole), so any value is served: Anthropic's
    # summarized / omitted, and the values Claude Code 2.1.337 asks for (updates; highlights)
    display: str | None = None


class AOutputFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class AOutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AOutputFormat | None = None


class CountTokensBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A Messages body without `max_tokens`: what `/v1/messages/count_tokens` takes (fields
    that cannot change the prompt are accepted and ignored there)."""

    model: ModelName
    messages: Annotated[list[AMessage], Meta(min_length=1)]
    system: str | list[Block] | None = None
    stop_sequences: Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    stream: bool | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    thinking: AThinking | None = None
    output_config: AOutputConfig | None = None
    # Accepted and ignored: they change nothing a single neuron produces.
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    cache_control: Any = None  # the prefix cache is automatic
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


class MessagesBody(CountTokensBody, forbid_unknown_fields=True, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)]


def _text(content: str | list[Block] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, b in enumerate(content):
        if b.type != "text":
            raise unsupported(f"{param}[{j}].type", f"blocks of type `{b.type}` here")
        out.append(b.text or "")
    return "".join(out)


# Claude Code's first system block (or line): billing metadata, not prompt. Its tail is a hash
# of the request, so kept, it starts every session's prompt differently and no session's
# request finds the ~50k-token system prompt and tools another left in the prefix cache.
BILLING_HEADER = "x-anthropic-billing-header:"
# An image block's base64 `media_type`, as Anthropic's API types it (its SDK's
# Base64ImageSourceParam): these four exactly; `image/jpg` is a 400 there and here.
ANTHROPIC_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _system(system: str | list[Block]) -> str:
    """The top-level system prompt's text, without Claude Code's billing header."""
    if isinstance(system, str):
        head, _, rest = system.partition("\n")
        return rest if head.startswith(BILLING_HEADER) else system
    return _text([Block(type="text") if b.type == "text" and (b.text or "").startswith(
        BILLING_HEADER) else b for b in system], "system")  # an error names the block sent


def _turns(body: MessagesBody | CountTokensBody) -> list[Turn]:
    turns: list[Turn] = []
    system = "" if body.system is None else _system(body.system)
    for i, m in enumerate(body.messages):
        p = f"messages[{i}].content"
        anthropic_system.check_clear_at(m, i)
        if m.role == "system":
            anthropic_system.check_placement(body.messages, i)
            said = anthropic_system.text_of(m.content, p, body.tools or [], ATool)
            if said and not anthropic_system.cleared(body.messages, i):  # (else: its turn
                turns.append(Turn(role="system", content=said))  # is over) where it stands
            continue
        if isinstance(m.content, str):
            turns.append(Turn(role=m.role, content=m.content))
            continue
        text, thought, calls = [], [], []
        parts: list[str | images.ImagePart] = []
        for j, b in enumerate(m.content):
            if b.type == "text":
                text.append(b.text or "")
                parts.append(b.text or "")
            elif b.type == "image" and m.role == "user":
                parts.append(_image(b.source, f"{p}[{j}].source"))
            elif b.type in images.VIDEO_PART_TYPES:
                raise unsupported(f"{p}[{j}].type", f"video blocks (`{b.type}`)")
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise bad_request(f"`{p}[{j}].tool_use_id` is required",
                                      f"{p}[{j}].tool_use_id")
                turns.append(_tool_result(b, f"{p}[{j}].content", body.tools or []))
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise bad_request(f"`{p}[{j}]` needs `id` and `name`", f"{p}[{j}]")
                if not isinstance(b.input, dict | None):
                    raise bad_request(f"`{p}[{j}].input` must be an object", f"{p}[{j}].input")
                calls.append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                thought.append(b.thinking or "")
            else:
                raise unsupported(f"{p}[{j}].type", f"`{b.type}` blocks in a {m.role} turn")
        if text or calls or thought or parts or m.role == "assistant":
            turns.append(Turn(role=m.role, content="".join(text),
                              tool_calls_json=json.dumps(calls) if calls else "",
                              reasoning="".join(thought),
                              parts=parts if len(parts) > len(text) else None))
    tool_pairing.check_messages(body.messages)
    if body.system is not None:
        turns.insert(0, Turn(role="system", content=system))
    return turns


def _tool_result(b: Block, param: str, tools: list[ATool]) -> Turn:
    """A tool_result block as a tool turn: its text, with images its parts (tool_reference.py)."""
    assert b.tool_use_id is not None
    head = ["Error: "] if b.is_error else []
    if not isinstance(b.content, list) or all(x.type == "text" for x in b.content):
        return Turn(role="tool", tool_call_id=b.tool_use_id,
                    content="".join(head) + _text(b.content, param))
    parts: list[str | images.ImagePart] = list(head)
    refs: list[tuple[str | None, str]] = []  # consecutive references: one <functions> block
    for j, x in enumerate([*b.content, Block(type="")]):
        if refs and x.type != "tool_reference":
            parts.append(tool_reference.functions_block(refs, tools))
            refs = []
        if x.type == "text":
            parts.append(x.text or "")
        elif x.type == "image":
            parts.append(_image(x.source, f"{param}[{j}].source"))
        elif x.type == "tool_reference":
            refs.append((x.tool_name, f"{param}[{j}]"))
        elif j < len(b.content):  # not the end marker
            raise unsupported(f"{param}[{j}].type", f"blocks of type `{x.type}` here")
    texts = [x for x in parts if isinstance(x, str)]
    return Turn(role="tool", tool_call_id=b.tool_use_id, content="".join(texts),
                parts=parts if len(texts) < len(parts) else None)  # None: text alone


def _image(source: Any, param: str) -> images.ImagePart:
    """An image block's source: base64 (with its media_type) or a url."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type")
        if media not in ANTHROPIC_MEDIA_TYPES:  # Anthropic's enum, exactly: no image/jpg
            raise bad_request(f"`{param}.media_type`: Input should be 'image/jpeg', "
                              "'image/png', 'image/gif' or 'image/webp' (got "
                              f"{clip(repr(media))})", f"{param}.media_type")
        return images.ImagePart(param, b64=source["data"], media_type=media)
    if kind == "url" and isinstance(source.get("url"), str):
        return images.from_url(source["url"], f"{param}.url")
    if kind in ("base64", "url"):
        field = "data" if kind == "base64" else "url"
        what = "must be a string" if field in source else "is required"  # not there at all
        raise bad_request(f"`{param}.{field}` {what}", f"{param}.{field}")
    raise unsupported(f"{param}.type", f"image sources of type `{kind}` (base64 and url are)")


def _tools(body: MessagesBody | CountTokensBody, req: ParsedRequest,
           caps: RequestCaps) -> None:
    tools = body.tools or []
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"server tools (`{t.type}`)")
        if t.input_schema is None:
            raise bad_request(f"`tools[{i}].input_schema` is required", f"tools[{i}].input_schema")
    openai_body = ChatBody(
        model=body.model, messages=[], tools=[Tool(
            type="function", function=FunctionDef(
                name=t.name, description=t.description, parameters=t.input_schema))
            for t in tools] or None)
    c = body.tool_choice
    if c is not None:
        openai_body.parallel_tool_calls = not c.disable_parallel_tool_use
        if c.type == "tool":
            if not c.name:
                raise bad_request("`tool_choice.name` is required for type tool",
                                  "tool_choice.name")
            openai_body.tool_choice = NamedToolChoice(
                type="function", function=NamedFunction(name=c.name))
        else:
            if c.type == "any" and not tools:  # chat's own 400 would say `required`
                raise bad_request("`tool_choice` is `any` but no `tools` were given",
                                  "tool_choice")
            openai_body.tool_choice = {"auto": "auto", "any": "required",
                                       "none": "none"}[c.type]  # type: ignore[assignment]
    agent_request.apply_as(openai_body, req, caps, [f"tools[{i}]" for i in range(len(tools))],
                           "input_schema")
    req.deferred_tools = frozenset(t.name for t in tools if t.defer_loading)


def _thinking(body: MessagesBody | CountTokensBody, req: ParsedRequest) -> None:
    t = body.thinking
    if t is None:
        return
    if t.type == "disabled":
        req.reasoning_effort = "none"
        return
    req.template_kwargs["enable_thinking"] = True
    if t.type == "adaptive" or (t.type == "between_tools" and t.budget_tokens is None):
        return  # the model's catalogue budget (the SDK's between_tools has no budget)
    if t.budget_tokens is None:
        raise bad_request("`thinking.budget_tokens` is required when thinking is enabled",
                          "thinking.budget_tokens")
    if isinstance(body, MessagesBody) and t.budget_tokens >= body.max_tokens:
        raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`",
                          "max_tokens")
    req.thinking_budget_tokens = t.budget_tokens


def _output_config(body: MessagesBody | CountTokensBody, req: ParsedRequest,
                   caps: RequestCaps) -> None:
    o = body.output_config
    if o is not None and o.effort is not None:
        req.reasoning_effort = _effort(o.effort)
    for i, m in enumerate(body.messages):  # Claude Code's per-turn effort: the latest holds
        if m.output_config is None:
            continue
        param = f"messages[{i}].output_config"
        if m.role != "system" or m.output_config.format is not None:
            raise unsupported(param if m.role != "system" else param + ".format",
                              "an `output_config` other than a `system` message's `effort`")
        if m.output_config.effort is not None and not anthropic_system.cleared(body.messages, i):
            req.reasoning_effort = _effort(m.output_config.effort)
    if o is not None and o.format is not None:
        if req.constraint is not None:
            raise bad_request("`output_config.format` cannot be combined with a forced "
                              "`tool_choice`", "output_config.format")
        agent_request.constrain_to_schema(req, o.format.schema, "output_config.format.schema",
                                          caps)


def _effort(effort: str) -> str:
    return {"xhigh": "high", "max": "high"}.get(effort, effort)


def _prefill(body: CountTokensBody, req: ParsedRequest) -> None:
    """A final assistant message is the answer begun: the reply continues it and holds only
    the continuation, as Anthropic's does (an empty one is no prefill)."""
    last, param = body.messages[-1], f"messages[{len(body.messages) - 1}]"
    if last.role != "assistant" or not req.messages or req.messages[-1].role != "assistant":
        return
    turn = req.messages[-1]
    if not turn.content and not turn.tool_calls_json:
        req.messages.pop()  # nothing begun: a fresh answer
        return
    if turn.content != turn.content.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace",
                          f"{param}.content")
    if req.template_kwargs.get("enable_thinking"):
        raise bad_request(f"`{param}`: a final assistant message cannot be continued with "
                          "`thinking` enabled", "thinking")
    continue_final(req, param)


def parse_request(raw: bytes, caps: RequestCaps = DEFAULT_CAPS) -> ParsedRequest:
    """A /v1/messages body as the internal request, or ApiError(400) naming the field."""
    b: MessagesBody = decode_as(raw, MessagesBody)
    b.tools = anthropic_system.inline_tools(b.messages, b.tools or [], ATool) or None
    req = ParsedRequest(kind="chat", model=b.model, messages=_turns(b), max_tokens=b.max_tokens,
                        temperature=b.temperature, top_p=b.top_p, top_k=b.top_k or None,
                        stop=list(b.stop_sequences or []), stream=bool(b.stream),
                        include_usage=True, fit_max_tokens=True)
    _tools(b, req, caps)
    _thinking(b, req)
    _output_config(b, req, caps)
    _prefill(b, req)
    return req


def parse_count_request(raw: bytes, caps: RequestCaps = DEFAULT_CAPS) -> ParsedRequest:
    """A count_tokens body, its caps checked; its grammars are left uncompiled (req.compiles):
    they do not change the prompt."""
    b: CountTokensBody = decode_as(raw, CountTokensBody)
    b.tools = anthropic_system.inline_tools(b.messages, b.tools or [], ATool) or None
    req = ParsedRequest(kind="chat", model=b.model, messages=_turns(b))
    _tools(b, req, caps)
    _thinking(b, req)
    _output_config(b, req, caps)  # effort and a format can turn thinking off: the prompt
    _prefill(b, req)
    return req
