"""/tokenize and count_tokens' work, run off the neuron's event loop.

Tokenizing costs time in proportion to the caller's text (7.8 MB took 7-30 s): on the loop
it froze every stream and the neuron's reports, and the router dropped the neuron from
rotation. Here it runs on a small pool of its own, so generation's threads and the loop
keep going (the tokenizers library releases the GIL for long texts).

A call is first held to generation's caps (TokenizeGate): server.max_tokenize_bytes
per call, and per principal the model's admission.max_per_principal calls queued or
running (anonymous callers together: anon_max_in_flight), so one key cannot fill the
pool's queue for everyone.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from helexa.neuron import agent
from helexa.neuron.vision.prompt import with_images
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

# Two at a time: a burst of large tokenize calls queues here, never on generation's threads.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")


class TokenizeGate:
    """Tokenize calls held per principal, from arrival until their work leaves the pool.

    Owned by the servicer and used only on its loop (no locks). A call's place is given
    back when the pool is done with it, not when its caller goes away: a caller that
    cancels and resends cannot stack work in the queue past its cap.
    """

    def __init__(self) -> None:
        self._held: dict[str, int] = {}  # principal ("" = anonymous) -> calls held

    def held(self, principal: str) -> int:
        return self._held.get(principal, 0)

    async def run(self, r: Any, request: pb.TokenizeRequest,
                  max_bytes: int) -> pb.TokenizeResponse:
        """The TokenizeResponse for `request` on resident model `r`, computed on the pool;
        a Refusal naming the cap when the call is too large or its principal holds enough."""
        size = request.ByteSize()
        if size > max_bytes:
            raise Refusal("invalid_request_error",
                          f"the call holds {size} bytes of text, messages and tools; this "
                          f"neuron tokenizes at most {max_bytes} (server.max_tokenize_bytes)")
        principal = request.principal
        self._check_cap(principal, r.admission)
        self._held[principal] = self.held(principal) + 1
        work = asyncio.get_running_loop().run_in_executor(_POOL, tokenize_reply, r, request)
        work.add_done_callback(lambda _: self._release(principal))
        # shield: the caller leaving cancels this await, never the accounting
        return await asyncio.shield(work)

    def _check_cap(self, principal: str, limits: Any) -> None:
        if limits is None:
            return
        held = self.held(principal)
        if principal == "" and held >= limits.anon_max_in_flight:
            raise Refusal("rate_limit_exceeded",
                          f"anonymous callers have {held} tokenize calls queued or running "
                          f"(anon_max_in_flight {limits.anon_max_in_flight})", 1000)
        if held >= limits.max_per_principal:
            raise Refusal("rate_limit_exceeded",
                          f"principal has {held} tokenize calls queued or running "
                          f"(max_per_principal {limits.max_per_principal})", 1000)

    def _release(self, principal: str) -> None:
        left = self._held[principal] - 1
        if left:
            self._held[principal] = left
        else:
            del self._held[principal]


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
            ids = r.tokenizer.encode_chat(msgs, request.add_generation_prompt,
                                          request.chat.continue_final_message, **kwargs)
            # images: their pads count as the prompt's tokens do (vision/prompt.py)
            out.token_ids.extend(with_images(r.tokenizer, request, list(ids))[0])
        except Refusal:
            raise
        except Exception as e:
            raise Refusal("invalid_request_error",
                          f"messages: the model's chat template failed: {e}") from None
    else:
        out.token_ids.extend(r.tokenizer.encode(request.text, request.add_special_tokens))
    return out
