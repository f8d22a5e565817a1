"""What one request may take of a model: its output budget, the context check, its KV blocks.

This module is the rule's one owner; everyone else calls it:

- the engine (engine_core.py) decides with it whether a request is refused
  or queued, and admission (admission.py) reserves `reservation_blocks`;
- the daemon (helexa/neuron/limits.py) refuses with it before tokens cross the
  pipe, so the message is the engine's own;
- the router (helexa/router/selection.py) estimates with it which neuron's free KV
  fits a request, so the figure it predicts is the one the neuron reserves;
- the plan (helexa/plan.py) splits a hybrid's budget into blocks and state slots with
  `state_slots`, and the engine and the plan size the prefix cache's host tier with
  `host_tier_size`.

The rule (docs/architecture.md, "The KV pool and its ledger"): a request
may use `context` tokens, prompt and output together. Its output budget is
`max_tokens` when the client gave one, else `default_output_tokens`
capped by what the context leaves and by the model's `max_output_tokens`.
It reserves `ceil((prompt + budget) / block_size)` blocks, all at admission.
A budget the client did not name is growable (kv.grow_output): when the output
reaches it, the engine may grow it by `grown_budget` out of free blocks that no
queued request needs (helexa/neuron/engine/growth.py); one the client named
(max_tokens) is its exact ceiling and never grows. The router's estimate is the
admission reservation, never a growth.

Pure functions of plain numbers: no process state, no imports beyond the
standard library and helexa/refusal.py, so the router pays nothing for calling it.
"""

from __future__ import annotations

import re
from typing import Any

from helexa.refusal import Refusal


def output_budget(prompt_tokens: int, max_tokens: int | None, *, context: int,
                  default_output_tokens: int, max_output_tokens: int | None = None) -> int:
    """The most new tokens a request may produce; its reservation covers all of them."""
    if max_tokens is not None:
        return max_tokens
    budget = min(default_output_tokens, context - prompt_tokens)
    if max_output_tokens is not None:
        budget = min(budget, max_output_tokens)
    return budget


def grown_budget(prompt_tokens: int, budget: int, step: int, *, context: int, block_size: int,
                 max_output_tokens: int | None = None) -> int:
    """A growable budget one growth on: `step` more tokens, prompt and output rounded up
    to whole blocks, never past the context nor the output limit (None: context - 1);
    `budget` itself when it is at either already."""
    total = blocks_for_tokens(prompt_tokens + budget + step, block_size) * block_size
    output_limit = context - 1 if max_output_tokens is None else max_output_tokens
    return max(budget, min(total - prompt_tokens, context - prompt_tokens, output_limit))


def fitted_max_tokens(prompt_tokens: int, max_tokens: int, *, context: int,
                      max_output_tokens: int | None = None) -> int:
    """max_tokens taken as a ceiling: at most what the context leaves after the prompt and
    the advertised output limit (a prompt that fills the context is still refused by
    check_request)."""
    output_limit = context - 1 if max_output_tokens is None else max_output_tokens
    return max(1, min(max_tokens, context - prompt_tokens, output_limit))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the blocks that hold that many tokens."""
    return -(-num_tokens // block_size)


def reservation_blocks(prompt_tokens: int, budget: int, block_size: int) -> int:
    """The blocks a request reserves at admission: its prompt and its whole output budget."""
    return blocks_for_tokens(prompt_tokens + budget, block_size)


def check_request(prompt_tokens: int, max_tokens: int | None, *, context: int,
                  max_output_tokens: int | None = None) -> Refusal | None:
    """None when the request fits the model's context, else why not, stating both numbers.

    A prompt of `context` tokens leaves no room for even one output token, so
    it is refused as well as a prompt whose requested output would overflow.
    `max_output_tokens` is the advertised output limit (None: context - 1).
    """
    if prompt_tokens < 1:
        return Refusal("invalid_request_error", "prompt: expected at least one token")
    if prompt_tokens >= context:
        return prompt_past_context(prompt_tokens, context)
    if max_tokens is None:
        return None
    if max_tokens < 0:  # 0: the prompt alone, nothing generated (its logprobs: echo)
        return Refusal("invalid_request_error", f"max_tokens: expected at least 0, got {max_tokens}")
    if prompt_tokens + max_tokens > context:
        return Refusal(
            "context_length_exceeded",
            f"This model's maximum context length is {context} tokens; "
            f"the request asks for {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the prompt + {max_tokens} max_tokens).")
    output_limit = context - 1 if max_output_tokens is None else max_output_tokens
    if max_tokens > output_limit:
        return Refusal("invalid_request_error",
                       f"max_tokens: this model generates at most {output_limit} tokens "
                       f"per request, got {max_tokens}")
    return None


def prompt_past_context(prompt_tokens: int, context: int, counted_all: bool = True, *,
                        subject: str = "prompt",
                        tail: str = ", which leaves no room for output.") -> Refusal:
    """The refusal of a `subject` ("prompt"; /tokenize's "chat" or "text") of
    `prompt_tokens` >= `context` tokens; not `counted_all`: the neuron stopped counting there
    (helexa/neuron/token_bound.py), and says "at least". The one builder of this message:
    `tokens_past_context` reads its count back (`helexa bench` sizes prompts by it)."""
    has = f"{prompt_tokens} tokens" if counted_all else f"at least {prompt_tokens} tokens"
    return Refusal("context_length_exceeded",
                   f"This model's maximum context length is {context} tokens; "
                   f"the {subject} has {has}{tail}")


_PAST_CONTEXT = re.compile(r"maximum context length is \d+ tokens; the \w+ has "
                           r"(?:at least )?(\d+) tokens")


def tokens_past_context(message: str) -> int | None:
    """The count in a `prompt_past_context` message (a count the text has at least), or None
    when `message` is not one."""
    m = _PAST_CONTEXT.search(message)
    return int(m.group(1)) if m else None


def host_tier_size(host_bytes_per_card: int, num_blocks: int, bytes_per_block: int,
                   num_snapshots: int = 0, snapshot_bytes: int = 0) -> tuple[int, int]:
    """(host blocks, host snapshots) of the prefix cache's host tier (kv.host_cache_mb) in
    `host_bytes_per_card`, in the device pool's own mix of blocks and snapshots: what an
    evicted session needs back is what it held there (helexa/neuron/engine/host_tier.py)."""
    device = num_blocks * bytes_per_block + num_snapshots * snapshot_bytes
    if host_bytes_per_card <= 0 or device <= 0:
        return 0, 0
    if not num_snapshots or not snapshot_bytes:
        return host_bytes_per_card // max(1, bytes_per_block), 0
    snaps = host_bytes_per_card * num_snapshots // device
    return (host_bytes_per_card - snaps * snapshot_bytes) // max(1, bytes_per_block), snaps


def state_slots(plan: Any, max_in_flight: int) -> tuple[int, int]:
    """(KV blocks, state slots) a hybrid model's budget (a helexa.plan.ModelPlan) is split
    into; (num_blocks, 0) for a dense one.

    The engine holds one linear-attention state slot per request in flight, allocated at
    load beside the blocks and out of the same budget: `max_in_flight` slots, fewer if
    that would leave less than one request of `context` tokens, never fewer than one.
    Each slot also sets aside its held_bytes (a speculative verification row it may hold).
    The prefix snapshot slots (num_snapshot_slots × fixed_bytes) come out of it first.
    """
    if not plan.fixed_bytes:
        return plan.num_blocks, 0
    block_bytes = plan.block_size * plan.bytes_per_token
    context_bytes = -(-plan.context // plan.block_size) * block_bytes
    per_slot = plan.fixed_bytes + plan.held_bytes
    budget = plan.kv_budget_bytes - plan.num_snapshot_slots * plan.fixed_bytes
    slots = max(1, min(max_in_flight, (budget - context_bytes) // per_slot))
    return (budget - slots * per_slot) // block_bytes, slots
