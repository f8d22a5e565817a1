"""/tokenize and count_tokens' work: a Tokenize call's ids or text.

Tokenizing costs time in proportion to the caller's text (7.8 MB took 7-30 s): on the
event loop it froze every stream and the neuron's reports, and the router dropped the
neuron from rotation. The servicer runs `tokenize_reply` as a task of the caller's
principal on the neuron's work pool (helexa/neuron/work.py), where Generate's prompt work
runs too: bounded, served round robin between principals, a call whose caller left never
run. `check_size` first holds it to server.max_tokenize_bytes.

A text or chat longer than the model's context is refused (context_length_exceeded) as
soon as that is certain, as Generate's prompt is (token_bound.py): counted a piece at a
time up to the context, never tokenised whole. Tokenising 4 MiB whole only to report more
tokens than the context holds took 7 s and 755 MB of the neuron (10 s, 781 MB as a chat);
vLLM's /tokenize counts such a text in full, which is the difference docs/api.md states.
"""

from __future__ import annotations

import threading
from typing import Any

from helexa.budget import prompt_past_context
from helexa.neuron import agent
from helexa.neuron.token_bound import PastLimit
from helexa.neuron.vision.prompt import with_images
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal


def check_size(request: pb.TokenizeRequest, max_bytes: int) -> None:
    """A Refusal naming server.max_tokenize_bytes when the call is larger."""
    size = request.ByteSize()
    if size > max_bytes:
        raise Refusal("invalid_request_error",
                      f"the call holds {size} bytes of text, messages and tools; this "
                      f"neuron tokenizes at most {max_bytes} (server.max_tokenize_bytes)")


def tokenize_reply(r: Any, request: pb.TokenizeRequest, gone: threading.Event | None = None
                   ) -> pb.TokenizeResponse:
    """Ids for text or a chat, or text for ids; a Refusal naming what is wrong; `gone`: set
    when the caller left (its images' work stops: work.run_stoppable)."""
    out = pb.TokenizeResponse(max_model_len=r.limits.context if r.limits else 0)
    which = request.WhichOneof("input")
    # counted no further than one token past the context: a text of the context is shown
    limit = r.limits.context + 1 if r.limits else None
    if which == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((i for i in ids if not 0 <= i < r.tokenizer.vocab_size), None)
        if bad is not None:
            raise Refusal("invalid_request_error",
                          f"tokens: token id {bad} is outside the vocabulary")
        out.text = r.tokenizer.decode(ids)
    elif which == "chat":
        msgs, kwargs = agent.template_inputs(request.chat, request.reasoning_effort)
        try:
            ids = r.tokenizer.encode_chat_within(
                limit, msgs, request.add_generation_prompt,
                request.chat.continue_final_message, **kwargs)
            # images: their pads count as the prompt's tokens do (vision/prompt.py)
            out.token_ids.extend(with_images(r.tokenizer, request, list(ids), gone)[0])
        except PastLimit as e:
            raise _past_context(e, r.limits.context, "chat") from None
        except Refusal:
            raise
        except Exception as e:
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template failed: {e}") from None
    else:
        try:
            out.token_ids.extend(r.tokenizer.encode(request.text, request.add_special_tokens,
                                                    limit=limit))
        except PastLimit as e:
            raise _past_context(e, r.limits.context, "text") from None
    return out


def _past_context(e: PastLimit, context: int, what: str) -> Refusal:
    # a /tokenize text of exactly the context is counted and shown, so no "room for output"
    return prompt_past_context(e.at_least, context, counted_all=False, subject=what,
                               tail=" (counted no further: a text past the context is not "
                                    "tokenised whole)")
