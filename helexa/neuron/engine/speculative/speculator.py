"""The engine's speculation: per step, drafts for the decoding requests; after it, the count.

EngineCore owns one Speculator per model. Before scheduling, `draft` asks the
policy how many tokens each decoding request may draft (policy.py) and the
drafter for them, and leaves them on the request (`Request.draft`); the
scheduler then gives that request a row of 1 + len(draft) tokens (when the
step's token budget has room) and the engine scores it with logits at every
position. `accept` verifies the row (verify.py) and keeps the figures, per model and per
request. A drafter may have optional methods, used when present:
`propose_batch(reqs, ks)` (one call for the step's drafting requests: a
draft model batches its forwards), `observe(items)` after each step (the
positions each running request kept: the MTP head follows the target) and
`release(req)` (the request ended).

The KV of drafted tokens is written past the request's computed length; the
engine advances `num_computed_tokens` by the accepted ones only, so rejected
positions are simply overwritten by later steps and attention never reads
them (it reads positions below the query's own). Drafts are capped at the
request's remaining output budget less one, so every position written lies
inside its reservation: speculation never draws a block the reservation
does not cover, and the ledger is unchanged by it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helexa.neuron.engine.request import Request
from helexa.neuron.engine.speculative.drafters import Draft, Drafter, propose_all
from helexa.neuron.engine.speculative.policy import SpecPolicy, choose_k, update_acceptance
from helexa.neuron.engine.speculative.verify import verify


class Speculator:
    def __init__(self, drafter: Drafter | None, policy: SpecPolicy) -> None:
        self.drafter = drafter
        self.policy = policy
        self.drafted_tokens = 0  # cumulative: tokens verified, and of those accepted
        self.accepted_tokens = 0

    @property
    def name(self) -> str:
        return self.drafter.name if self.drafter is not None else "off"

    def draft(self, running: Sequence[Request], max_slots: int) -> None:
        """Leave this step's draft (possibly none) on every decoding request."""
        occupancy = len(running) / max(1, max_slots)
        asks: list[tuple[Request, int]] = []  # (request, most tokens it may draft)
        for req in running:
            req.draft = None
            if self.drafter is None or req.is_prefilling or req.num_uncomputed_tokens != 1:
                continue
            st = req.sampling_state
            if st is not None and (getattr(st, "has_penalties", False)
                                   or getattr(st, "wants_logprobs", False)):
                continue  # their next distribution depends on which drafts are accepted
            if req.matcher is not None:
                continue  # a grammar mask acts on the one row sampled per step
            if req.images is not None:
                continue  # drafters place tokens at 1-D positions; its are M-RoPE's
            room = req.output_budget - req.num_output_tokens - 1  # the bonus token needs one
            if req.thought is not None:  # no draft may reach a token the budget forces
                unforced = req.thought.unforced_tokens()
                if unforced is not None:
                    room = min(room, unforced - 1)
            k = min(room, choose_k(self.policy, occupancy=occupancy,
                                   acceptance=req.spec_acceptance,
                                   steps_since_draft=req.steps_since_draft))
            req.steps_since_draft += 1
            if k > 0:
                asks.append((req, k))
        if not asks or self.drafter is None:
            return
        drafts = propose_all(self.drafter, [r for r, _ in asks], [k for _, k in asks])
        for (req, k), d in zip(asks, drafts, strict=True):
            if d.tokens:
                probs = d.probs[:k] if d.probs is not None else None
                req.draft = Draft(d.tokens[:k], probs)
                req.steps_since_draft = 0

    def observe(self, items: Sequence[tuple[Request, int, int]]) -> None:
        """After a step: (request, index among the step's sequences, positions computed
        and kept) for each request still running; for drafters that follow the target."""
        observe = getattr(self.drafter, "observe", None)
        if observe is not None and items:
            observe(items)

    def release(self, req: Request) -> None:
        """`req` ended: the drafter drops what it kept for it (a drafter with state has
        `release`)."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(req)

    def accept(self, req: Request, logits: torch.Tensor, num_draft: int) -> list[int]:
        """Verify `req`'s row (logits [num_draft + 1, vocab]): the tokens it produces."""
        assert req.draft is not None and req.sampling_state is not None
        draft = req.draft.tokens[:num_draft]
        q = req.draft.probs[:num_draft] if req.draft.probs is not None else None
        out = verify(logits, draft, q, req.sampling_state)
        accepted = len(out) - 1
        self.drafted_tokens += num_draft
        self.accepted_tokens += accepted
        req.spec_drafted_tokens += num_draft  # the request's own usage (docs/api.md)
        req.spec_accepted_tokens += accepted
        req.spec_acceptance = update_acceptance(req.spec_acceptance, num_draft, accepted)
        req.draft = None
        return out
