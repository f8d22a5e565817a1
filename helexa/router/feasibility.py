"""Requests no neuron could ever serve, refused at once with a 400 that says why.

A request that no neuron serving its model could accept however long it
waited is not a 429 or a 503 (which invite a retry) but a 400:

- `n` choices over the sum of what those neurons let one caller hold at once:
  each choice is one request of the same principal (a choice refused on one
  neuron is retried on another), so the last ones would always be refused. A
  neuron holds at most its `max_per_principal` of one caller's requests, and
  at most `max_in_flight + max_queue_depth` of anyone's (past both it answers
  503 overloaded, which no retry of the same request could ever get past). A
  completions batch is `n` choices for each of its prompts, and counts so: a
  batch of 10,000 prompts opened 10,000 neuron calls at once, which held the
  event loop (every other stream) for seconds before the 503 that invited a
  retry.
- A prompt whose tokens are over the largest advertised context, judged from
  a LOWER bound of its tokens (the router has no tokenizer; the neuron makes
  the exact check, docs/architecture.md). Refusing here spares the neuron the
  tokenisation of a multi-megabyte prompt that cannot fit anyway.

Only models READY somewhere are judged (their limits are known); a model
still to be loaded goes on to the neuron, which decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from helexa.router.errors import ApiError, bad_request
from helexa.router.openai_api import ParsedRequest
from helexa.router.selection import Candidate

# The lower bound divides the prompt's UTF-8 bytes by this. It refuses only when the prompt's
# *average* token would have to be longer than this many bytes for it to fit. The longest
# tokens of the byte-level BPE vocabularies of current models (GPT-2, cl100k/o200k, Llama 3,
# Qwen2/3) are runs of whitespace or punctuation of about a hundred bytes or less, and
# sentencepiece caps pieces at 16 characters (64 bytes) by default: 256 leaves a margin of
# two and more, so a prompt that could fit is never refused here.
MAX_TOKEN_BYTES = 256


def prompt_tokens_lower_bound(req: ParsedRequest) -> int:
    """Tokens the prompt has at least: exact for token ids, else bytes / MAX_TOKEN_BYTES (the
    chat template only adds tokens, so it is left out)."""
    if req.prompt_ids is not None:
        return len(req.prompt_ids)
    if req.messages is not None:
        num_bytes = sum(len(t.content.encode()) for t in req.messages)
    else:
        num_bytes = len((req.prompt_text or "").encode())
    return math.ceil(num_bytes / MAX_TOKEN_BYTES)


def refuse_unservable(candidates: Sequence[Candidate], req: ParsedRequest) -> None:
    """Raise the 400 for a request none of `candidates` (the neurons with its model READY)
    could ever serve; return when one might."""
    if not candidates:
        return
    # each neuron's: the smaller of its two caps it reports (0: neither reported)
    caps = [min([v for v in (c.max_per_principal, c.max_held) if v], default=0)
            for c in candidates]
    prompts = max(1, len(req.prompt_batch))
    if all(caps) and req.n * prompts > sum(caps):
        why = (f"max_per_principal {sum(caps)} in all"
               if all(cap == c.max_per_principal for cap, c in zip(caps, candidates, strict=True))
               else f"{sum(caps)} in all: each one's max_per_principal, or its "
                    "max_in_flight + max_queue_depth where smaller")
        if prompts == 1:
            raise bad_request(
                f"`n` = {req.n} asks for more choices than one caller may have at once on "
                f"the neurons serving `{req.model}` ({why}); send at most {sum(caps)}", "n")
        raise bad_request(
            f"{prompts} prompts × `n` = {req.n} asks for {prompts * req.n} choices, more "
            f"than one caller may have at once on the neurons serving `{req.model}` "
            f"({why}); send at most {sum(caps)} per request", "prompt")
    context = max(c.context for c in candidates)
    if context <= 0:
        return
    prompt = prompt_tokens_lower_bound(req)
    exact = req.prompt_ids is not None
    what = f"{prompt} token{'s' if prompt != 1 else ''}"
    what = what if exact else f"at least {what}"
    param = "messages" if req.messages is not None else "prompt"
    if prompt >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                            f"prompt has {what}", code="context_length_exceeded", param=param)
    if req.max_tokens is not None and not req.fit_max_tokens \
            and prompt + req.max_tokens > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                            f"prompt has {what} and max_tokens asks for {req.max_tokens} more",
                       code="context_length_exceeded", param="max_tokens")
