"""Which neuron serves a request: a pure function of plain data, so it is unit-tested exactly.

The policy, in order:

1. Candidates are the healthy, non-draining neurons with the model READY
   (the registry builds them; this module only ranks).
2. Those whose free KV fits the request's estimated reservation come first
   (the engine's rule, helexa/budget.py, over estimated prompt tokens), less what
   the router itself has sent there and the neuron has not reported yet.
   When none fits, all candidates stay in play (the neuron queues the
   request or refuses it with a retry-after; the router has no better
   knowledge).
3. Among those, the least loaded: in flight + queued + the router's own
   unreported sends (so a burst spreads instead of herding onto the neuron
   that looked idle a moment ago).
4. Neurons within `TIE_MARGIN` requests of the least loaded are near-ties,
   ordered by rendezvous hashing of the conversation's first turns (or of the
   client's own key for what shares a cache, Responses' `prompt_cache_key`;
   serve.py builds the key): every router replica computes the same order with
   no shared state, and turns of one conversation land where their prefix is
   already cached.

The result is a preference order; the caller tries the first and, on a
refusal before the first byte, the second.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from helexa.budget import output_budget, reservation_blocks
from helexa.config.neuron import KvConfig

CHARS_PER_TOKEN = 4  # a rough average for English text with BPE vocabularies
TOKENS_PER_MESSAGE = 8  # chat-template framing per turn
# kv.default_output_tokens's default, for a neuron that reports none
DEFAULT_OUTPUT_TOKENS = KvConfig().default_output_tokens
TIE_MARGIN = 1  # requests of extra load a neuron may carry and still count as a near-tie


@dataclass(frozen=True)
class Candidate:
    """One neuron's view of one model, as the registry last heard it (plus unreported sends)."""

    neuron: str
    kv_free_bytes: int
    bytes_per_token: int
    block_size: int
    context: int
    in_flight: int = 0
    queued: int = 0
    pending_sends: int = 0
    pending_bytes: int = 0
    default_output_tokens: int = DEFAULT_OUTPUT_TOKENS  # as the neuron reports it in Watch
    max_per_principal: int = 0  # queued + in flight of one principal; 0 = not reported
    max_held: int = 0  # max_in_flight + max_queue_depth: all it holds at once; 0 = unknown
    fixed_bytes: int = 0  # hybrid models: state each request reserves beside its KV

    @property
    def load(self) -> int:
        return self.in_flight + self.queued + self.pending_sends


@dataclass(frozen=True)
class Estimate:
    """What the router knows about a request's size before any tokenizer sees it."""

    prompt_tokens: int
    max_tokens: int | None  # as the client asked; None = the neuron's default budget


def estimate_prompt_tokens(prompt_chars: int, num_messages: int = 0,
                           num_token_ids: int | None = None) -> int:
    """Prompt tokens from text length (~4 chars a token), exact for token-id prompts."""
    if num_token_ids is not None:
        return num_token_ids
    return math.ceil(prompt_chars / CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * num_messages


def reservation_bytes(c: Candidate, est: Estimate) -> int:
    """The KV the neuron will reserve for this request, in bytes: the engine's own rule
    (helexa/budget.py) over the estimated prompt, plus a hybrid model's fixed state."""
    prompt = min(est.prompt_tokens, c.context - 1)  # an estimate past the context: the most
    budget = output_budget(prompt, est.max_tokens, context=c.context,
                           default_output_tokens=c.default_output_tokens)
    block_size = max(1, c.block_size)
    return (reservation_blocks(prompt, budget, block_size) * block_size * c.bytes_per_token
            + c.fixed_bytes)


def fits(c: Candidate, est: Estimate) -> bool:
    return reservation_bytes(c, est) <= c.kv_free_bytes - c.pending_bytes


def rendezvous_score(affinity_key: bytes, neuron: str) -> int:
    """Highest-random-weight hashing: each (key, neuron) pair gets a stable pseudo-random weight."""
    digest = hashlib.blake2b(affinity_key + b"\0" + neuron.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_key(model: str, first_turns: Sequence[str]) -> bytes:
    """A key from the model and the conversation's opening (system prompt + first user turn)."""
    h = hashlib.blake2b(model.encode(), digest_size=16)
    for turn in first_turns:
        h.update(b"\0" + turn.encode())
    return h.digest()


def rank(candidates: Sequence[Candidate], est: Estimate, key: bytes) -> list[str]:
    """Neuron names best first (empty when there are no candidates)."""
    fitting = [c for c in candidates if fits(c, est)]
    pool = fitting or list(candidates)
    if not pool:
        return []
    least = min(c.load for c in pool)

    def order(c: Candidate) -> tuple[int, int]:
        near_tie = c.load <= least + TIE_MARGIN
        # Near-ties are ordered by hash alone; the rest by load, then hash.
        return (0 if near_tie else c.load, -rendezvous_score(key, c.neuron))

    ranked = sorted(pool, key=order)
    if fitting:
        rest = [c for c in candidates if c not in fitting]
        ranked += sorted(rest, key=lambda c: (c.load, -rendezvous_score(key, c.neuron)))
    return [c.neuron for c in ranked]
