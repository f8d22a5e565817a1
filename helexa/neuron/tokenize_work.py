"""/tokenize and count_tokens' work, run off the neuron's event loop.

Tokenizing costs time in proportion to the caller's text (7.8 MB took 7-30 s): on the loop
it froze every stream and the neuron's reports, and the router dropped the neuron from
rotation. Here it runs on a small pool of its own, so generation's threads and the loop
keep going (the tokenizers library releases the GIL for long texts).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from helexa.neuron import agent
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

# Two at a time: a burst of large tokenize calls queues here, never on generation's threads.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


async def tokenize_off_loop(r: Any, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    """The TokenizeResponse for `request` on resident model `r`, computed on the pool."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, tokenize_reply, r, request)


def tokenize_reply(r: Any, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    """Ids for text or a chat, or text for ids; a Refusal naming what is wrong."""
    out = pb.TokenizeResponse(max_model_len=r.limits.context if r.limits else 0)
    which = request.WhichOneof("input")
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
            out.token_ids.extend(r.tokenizer.encode_chat(
                msgs, request.add_generation_prompt, **kwargs))
        except Exception as e:
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template failed: {e}") from None
    else:
        out.token_ids.extend(r.tokenizer.encode(request.text, request.add_special_tokens))
    return out
