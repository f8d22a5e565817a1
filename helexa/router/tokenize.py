"""The small endpoints clients probe: /tokenize, /detokenize, /v1/messages/count_tokens, /version.

The router has no tokenizer: tokenising asks a neuron where the model is
ready (its Tokenize RPC, the model's own tokenizer and chat template), so
counts are exactly those a request would be admitted with. Bodies follow
vLLM (`/tokenize`: `prompt` or `messages`, `add_special_tokens`,
`add_generation_prompt`, `continue_final_message`; `/detokenize`: `tokens`) and Anthropic
(`count_tokens`: a Messages body without max_tokens), decoded by msgspec.
"""

from __future__ import annotations

from typing import Annotated, Any

import grpc
import msgspec
import structlog
from aiohttp import web
from msgspec import Meta

from helexa import __version__
from helexa.proto import neuron_pb2 as pb
from helexa.router import anthropic, anthropic_errors, images
from helexa.router.agent_request import template_kwargs, tool_dicts
from helexa.router.errors import ApiError, bad_request
from helexa.router.forward import chat_proto
from helexa.router.http_edge import read_body
from helexa.router.openai_api import ParsedRequest, Turn, _message, continue_final
from helexa.router.request_caps import RequestCaps, SchemaBudget, check_tool_count
from helexa.router.request_model import (
    INT32_MAX,
    Message,
    ModelName,
    TokenId,
    Tool,
    decode_as,
)
from helexa.router.rpc_errors import map_rpc_error, withheld
from helexa.router.serve import STATE

log = structlog.get_logger(component="router")


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelName
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the final message left open (a prefill)
    return_token_strs: bool | None = None  # accepted; the ids are what we return
    tools: list[Tool] | None = None  # with messages: rendered into the prompt, as chat's
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelName
    tokens: list[TokenId]


async def _call(request: web.Request, treq: pb.TokenizeRequest) -> pb.TokenizeResponse:
    state = request.app[STATE]
    principal = _principal(request)  # 401 when auth is required
    treq.principal = "" if principal == "anonymous" else principal  # the neuron's caps
    asked, treq.model = treq.model, state.aliases.resolve(treq.model)
    candidates = state.registry.candidates(treq.model)
    if not candidates:
        if treq.model in state.registry.known_models():
            raise ApiError(503, f"`{treq.model}` is not ready on any neuron",
                           code="service_unavailable")
        raise state.aliases.named(ApiError(404, f"The model `{treq.model}` does not exist",
                                           code="model_not_found", param="model"), asked)
    link = state.registry.links[candidates[0].neuron]
    try:
        out: pb.TokenizeResponse = await link.stub.Tokenize(treq, metadata=link.metadata,
                                                            timeout=30)
        return out
    except grpc.aio.AioRpcError as e:
        # past the context: `param` names the messages or the prompt (rpc_errors.py)
        err = map_rpc_error(e, "chat" if treq.WhichOneof("input") == "chat" else "text")
        log.info("request.refused", endpoint=request.path, neuron=candidates[0].neuron,
                 model=treq.model, grpc=e.code().name, code=err.code, reason=err.message,
                 detail=withheld(e, err))
        raise err from None


async def _body(request: web.Request) -> bytes:
    """The body, once the caller's key is known good: an unknown key is a 401 whatever the
    body holds, as on the generation endpoints."""
    state = request.app[STATE]
    _principal(request)
    return await read_body(request, state.max_body_bytes, state.read_timeout_secs)


# aiohttp 3.14 warns of a str key in a request (NotAppKeyWarning) and offers RequestKey
_PRINCIPAL: Any = web.RequestKey("principal", str) if hasattr(web, "RequestKey") else "principal"


def _principal(request: web.Request) -> str:
    """The caller's principal (a 401 for an unknown key where keys are required), resolved
    once a request: the body's check and each task on the work pool ask for it."""
    if (principal := request.get(_PRINCIPAL)) is None:
        principal = request[_PRINCIPAL] = \
            request.app[STATE].auth.of(request.headers)
    return str(principal)


async def _decoded(request: web.Request, t: type) -> Any:
    """The body as the struct `t`, decoded on the router's work pool (an 8 MiB body is a
    fifth of a second of decoding and depth checking: not on the loop)."""
    return await _off_loop(request, decode_as, await _body(request), t)


async def _off_loop(request: web.Request, fn: Any, *args: Any, share: bool = True) -> Any:
    """fn(*args) on the router's work pool: the messages' protos and the reply's JSON grow
    with the request (200,000 turns, or 1.6 million ids back, held every stream's loop for
    a second and more). Counted against the caller's share of the pool: 429 beyond it,
    unless `share` is False (the reply, once the neuron has answered; work_pool.py)."""
    return await request.app[STATE].work_pool.run(_principal(request), fn, *args, share=share)


async def _images(request: web.Request, req: ParsedRequest) -> None:
    """The request's images decoded (their tokens count too), on the work pool as the
    caller's (images.py)."""
    state = request.app[STATE]
    await images.resolve(req, state.cfg.images, state.work_pool, _principal(request))


def _json(data: dict[str, Any]) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


def _chat(turns: list[Turn], kwargs: dict[str, Any] | None, tools: list[Tool] | None,
          caps: RequestCaps) -> pb.Chat:
    req = ParsedRequest(kind="chat", model="", messages=turns, template_kwargs=kwargs or {})
    chat = chat_proto(req)
    if tools:  # within chat's caps on tools (docs/http.md, "Generation requests")
        check_tool_count(len(tools), caps)
        budget = SchemaBudget(caps)
        for i, t in enumerate(tools):
            budget.take(t.function.parameters, f"tools[{i}].function.parameters")
        chat.tools_json = msgspec.json.encode(tool_dicts(tools)).decode()
    return chat


def _turns(messages: list[Message]) -> list[Turn]:
    return [_message(m, i, []) for i, m in enumerate(messages)]  # as a chat renders them


def _tokens_reply(out: pb.TokenizeResponse) -> web.Response:
    return _json({"count": len(out.token_ids), "max_model_len": out.max_model_len,
                  "tokens": list(out.token_ids)})


def _detokenize_request(b: DetokenizeBody) -> pb.TokenizeRequest:
    if any(t > INT32_MAX for t in b.tokens):
        raise bad_request("`tokens` holds an id beyond int32", "tokens")
    return pb.TokenizeRequest(model=b.model, token_ids=pb.TokenIds(ids=b.tokens))


async def tokenize(request: web.Request) -> web.Response:
    b: TokenizeBody = await _decoded(request, TokenizeBody)
    if (b.prompt is None) == (b.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
    kwargs, add_prompt, continue_final_message = template_kwargs(
        b.chat_template_kwargs, b.add_generation_prompt, b.continue_final_message)
    treq = pb.TokenizeRequest(model=b.model, add_special_tokens=b.add_special_tokens,
                              add_generation_prompt=add_prompt is not False)
    if b.messages is not None:
        turns = await _off_loop(request, _turns, b.messages)
        await _images(request, ParsedRequest(kind="chat", model=b.model, messages=turns))
        treq.chat.CopyFrom(await _off_loop(request, _chat, turns, kwargs, b.tools,
                                           request.app[STATE].caps))
        if continue_final_message:
            continue_final(ParsedRequest(kind="chat", model=b.model, messages=turns),
                           f"messages[{len(turns) - 1}]")
            treq.chat.continue_final_message = True
    else:
        treq.text = b.prompt or ""
    out = await _call(request, treq)
    reply: web.Response = await _off_loop(request, _tokens_reply, out, share=False)
    return reply


async def detokenize(request: web.Request) -> web.Response:
    b: DetokenizeBody = await _decoded(request, DetokenizeBody)
    out = await _call(request, await _off_loop(request, _detokenize_request, b))
    return _json({"prompt": out.text})


def _count_chat(req: ParsedRequest) -> pb.Chat:
    chat = chat_proto(req)
    if req.tools:  # tool_choice none hides tools from a reply, but they are still sent
        chat.tools_json = msgspec.json.encode(req.prompt_tools()).decode()
    return chat


async def count_tokens(request: web.Request) -> web.Response:
    try:
        state = request.app[STATE]
        req = await _off_loop(request, anthropic.parse_count_request, await _body(request),
                              state.caps)
        await _images(request, req)
        chat = await _off_loop(request, _count_chat, req)
        out = await _call(request, pb.TokenizeRequest(
            model=req.model, chat=chat, add_generation_prompt=True,
            reasoning_effort=req.reasoning_effort))
    except ApiError as e:
        return anthropic_errors.error_response(e)
    return web.json_response({"input_tokens": len(out.token_ids)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
