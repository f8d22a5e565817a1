"""A Generate call's prompt work: what it costs the neuron before the engine sees it.

Rendering the chat template (the agent inputs of helexa/neuron/agent.py, a request's tools
among them), tokenising, decoding and resizing its images, checking the context and
building its constraint grammar: CPU time that grows with the request (a 2 MB prompt,
seconds; 128 tools' schemas, one). `prepare` does all of it in one call, which the
servicer runs as one task of its caller's on the neuron's work pool (helexa/neuron/work.py),
never on the event loop that carries every stream and Watch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from helexa.budget import fitted_max_tokens, prompt_past_context
from helexa.neuron import agent
from helexa.neuron.detokenizer import decode_with_offsets
from helexa.neuron.engine import messages
from helexa.neuron.limits import check_context
from helexa.neuron.token_bound import PastLimit
from helexa.neuron.vision.prompt import with_images
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal
from helexa.stop_caps import stop_problem

MAX_PROMPT_LOGPROBS = 20  # alternatives a prompt token may ask for, as top_logprobs' most


def tokenise(tokenizer: Any, request: pb.GenerateRequest, limit: int | None = None) -> list[int]:
    """The prompt's token ids: chat via the chat template, text as is, or ids given;
    token_bound.PastLimit, without tokenising all of it, for a text of `limit` tokens or
    more."""
    which = request.WhichOneof("prompt")
    if which == "chat":
        msgs, kwargs = agent.template_inputs(request.chat, request.reasoning_effort,
                                             request.HasField("constraint"))
        if not msgs:
            raise Refusal("invalid_request_error", "messages: expected at least one message")
        try:
            return list(tokenizer.encode_chat_within(
                limit, msgs, continue_final_message=request.chat.continue_final_message,
                **kwargs))
        except PastLimit:
            raise
        except Exception as e:  # the checkpoint's template refused these messages
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template failed: {e}") from None
    if which == "text":
        ids = list(tokenizer.encode(request.text, limit=limit))
        if not ids:
            raise Refusal("invalid_request_error", "prompt: expected at least one token")
        return ids
    if which == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise Refusal("invalid_request_error", "prompt: expected at least one token id")
        bad = next((i for i in ids if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise Refusal("invalid_request_error",
                          f"prompt: token id {bad} is outside the vocabulary (0..{tokenizer.vocab_size - 1})")
        return ids
    raise Refusal("invalid_request_error", "prompt: expected chat messages, text or token ids")


def prompt_of(tokenizer: Any, request: pb.GenerateRequest, max_tokens: int | None,
              limits: Any, gone: threading.Event | None = None
              ) -> tuple[list[int], int | None, list[messages.ImageInput]]:
    """Tokenise (images decoded, their tokens placed) and check the context (the tokenizer
    releases the GIL for long texts, Pillow while it decodes). Returns the ids, the
    max_tokens in force (`fit_max_tokens` lowers it to what the context leaves) and the
    images; work.CallerGone between images once `gone` is set."""
    try:  # a prompt the context cannot hold is refused as soon as that is certain
        ids = tokenise(tokenizer, request, limits.context if limits is not None else None)
    except PastLimit as e:
        raise prompt_past_context(e.at_least, limits.context, counted_all=False) from None
    ids, images = with_images(tokenizer, request, ids, gone)
    if request.fit_max_tokens and max_tokens is not None and limits is not None:
        max_tokens = fitted_max_tokens(len(ids), max_tokens, context=limits.context,
                                       max_output_tokens=limits.output)
    check_context(len(ids), max_tokens, limits)
    return ids, max_tokens, images


@dataclass
class Prepared:
    """What the engine's NewRequest needs of the request's prompt work, and the prompt as
    text with where each token begins in it, where the caller wants either (return_prompt_text,
    sampling.prompt_logprobs: their entries' text_offset)."""

    prompt_ids: list[int]
    max_tokens: int | None
    images: list[messages.ImageInput]
    grammar: str | None
    thinking: messages.Thinking | None
    prompt_text: str = ""
    text_offsets: list[int] = field(default_factory=list)


def prepare(tokenizer: Any, entry: Any, limits: Any, request: pb.GenerateRequest,
            gone: threading.Event | None = None) -> Prepared:
    """The request's prompt, output bound, images, grammar and thinking bounds; a Refusal
    naming what is wrong. The model's tokenizer, catalogue entry and limits as the call
    found them; `gone`: set when the caller left (work.run_stoppable)."""
    problem = stop_problem(request.stop, request.stop_token_ids)
    if problem is not None:  # the router's caps, checked for every caller
        raise Refusal("invalid_request_error", problem)
    max_tokens = request.max_tokens if request.HasField("max_tokens") else None
    scored = request.sampling.HasField("prompt_logprobs")
    if scored and not 0 <= request.sampling.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
        raise Refusal("invalid_request_error", f"sampling.prompt_logprobs: expected 0.."
                      f"{MAX_PROMPT_LOGPROBS}, got {request.sampling.prompt_logprobs}")
    ids, max_tokens, images = prompt_of(tokenizer, request, max_tokens, limits, gone)
    grammar = agent.constraint_grammar(request,
                                       agent.tool_parser(entry, tokenizer.chat_template))
    thinking = agent.thinking(tokenizer, entry, request, ids, _enable_thinking(request))
    out = Prepared(ids, max_tokens, images, grammar, thinking)
    if scored or request.return_prompt_text:  # a decode a token: grows with the prompt
        out.prompt_text, out.text_offsets = decode_with_offsets(tokenizer, ids)
    return out


def _enable_thinking(request: pb.GenerateRequest) -> Any:
    """chat_template_kwargs.enable_thinking as the client set it (None when not)."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.template_kwargs_json:
        return None
    _, kwargs = agent.template_inputs(pb.Chat(template_kwargs_json=request.chat.template_kwargs_json), "")
    return kwargs.get("enable_thinking")
