"""Drafters: who proposes the tokens the target model then verifies.

A drafter sees a request (its prompt and output so far) and proposes at most
k next tokens. It may propose fewer, or none (no guess is worth a verification
row). `Draft.probs` is the drafter's distribution q over the vocabulary for
each proposed token; None means deterministic (q is one-hot on the token),
which is what prompt lookup and the test oracles are.

Kinds:
- `MtpDrafter` (mtp.py): the checkpoint's multi-token-prediction head.
- `NgramDrafter`: prompt lookup. The last n tokens (n from max_n down to
  min_n) are searched for earlier in prompt + output; the tokens that
  followed the latest earlier match are the proposal (a match close to the
  end is a loop: the copy runs on through it). Free to run, right when the
  output repeats the input (rewrites, code edits, quoting) or itself.
- `OracleDrafter` / `AdversarialDrafter` (tests): always right / always wrong
  given a function that knows the target's greedy continuation.
- `PerRequestDrafter` (tests): a different drafter per request id, to mix
  drafters in one batch.
- `DraftModelDrafter` (draft_model.py): a smaller model of the same tokenizer.

Every drafter is a `Drafter`, whose defaults a kind overrides where it needs to:
`propose` one request's draft (or `propose_batch` for all of a step's drafting
requests at once: a model batches its forwards), `observe` the step just run (a
drafter that follows the target, `follows_target`, reads its hidden states there),
`release` what it kept for a request that ended. Which drafter a model runs:
setup.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helexa.neuron.engine.request import Request

if TYPE_CHECKING:
    from helexa.neuron.engine.runner import StepOutput

# After a step, per request still running: (the request, its index among the step's
# sequences, the positions it computed and kept in that step).
Kept = tuple[Request, int, int]


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q; None = one-hot on tokens


_NO_DRAFT = Draft([])


class Drafter:
    """Proposes at most k next tokens for a request; the target verifies them."""

    name: str = ""  # what /v1/models and the metrics call it
    # observe() reads the step's hidden states (StepOutput.hidden): the runner keeps them
    follows_target: bool = False

    def propose(self, req: Request, k: int) -> Draft:
        """One request's draft of at most k tokens (none: no guess worth a row)."""
        return self.propose_batch([req], [k])[0]

    def propose_batch(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Drafts for all of a step's drafting requests (ks[i] tokens at most for reqs[i]).
        A kind overrides this or propose."""
        return [self.propose(r, k) for r, k in zip(reqs, ks, strict=True)]

    def observe(self, step: StepOutput, kept: Sequence[Kept]) -> None:
        """After each step: what it computed, and what each request still running kept."""

    def release(self, req: Request) -> None:
        """`req` ended: drop what was kept for it."""


@dataclass
class NgramDrafter(Drafter):
    """Prompt lookup: continue the latest earlier occurrence of the context's last n tokens."""

    min_n: int = 2
    max_n: int = 4
    window: int = 4096  # only the last this-many tokens are searched (cost stays bounded)
    name: str = "ngram"

    def propose(self, req: Request, k: int) -> Draft:
        if k <= 0:
            return _NO_DRAFT
        n_all = req.num_tokens
        start = max(0, n_all - self.window)
        ctx = req.token_slice(start, n_all)
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            tail = ctx[-n:]
            first = tail[0]
            # latest earlier match first: recent text is the likelier continuation
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i] == first and ctx[i:i + n] == tail:
                    return Draft(_copy(ctx, i + n, k))
        return _NO_DRAFT


def _copy(ctx: list[int], src: int, k: int) -> list[int]:
    """k tokens copied from ctx[src:], running on into the copy itself past the end (as
    LZ77 copies overlap): a match d tokens back means a loop of period d, continued."""
    out: list[int] = []
    for j in range(k):
        pos = src + j
        out.append(ctx[pos] if pos < len(ctx) else out[pos - len(ctx)])
    return out


# context -> the target's next `k` greedy tokens
Truth = Callable[[list[int], int], list[int]]


@dataclass
class OracleDrafter(Drafter):
    """Always right (tests): proposes the target's own greedy continuation."""

    truth: Truth
    name: str = "oracle"

    def propose(self, req: Request, k: int) -> Draft:
        return Draft(self.truth(req.all_token_ids(), k)) if k > 0 else _NO_DRAFT


@dataclass
class AdversarialDrafter(Drafter):
    """Always wrong (tests): every proposed token differs from the target's greedy one."""

    truth: Truth
    vocab_size: int
    name: str = "adversarial"

    def propose(self, req: Request, k: int) -> Draft:
        if k <= 0:
            return _NO_DRAFT
        return Draft([(t + 1) % self.vocab_size for t in self.truth(req.all_token_ids(), k)])


@dataclass
class PerRequestDrafter(Drafter):
    """A drafter per request id (tests: mixed drafters in one batch); others get none."""

    by_req: Mapping[str, Drafter]
    name: str = "mixed"

    def propose(self, req: Request, k: int) -> Draft:
        d = self.by_req.get(req.req_id)
        return d.propose(req, k) if d is not None else _NO_DRAFT

    def propose_batch(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Each drafter's requests in one call, batched where it can (a draft model)."""
        out = [_NO_DRAFT] * len(reqs)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.req_id in self.by_req:
                groups.setdefault(id(self.by_req[r.req_id]), []).append(i)
        for idx in groups.values():
            d = self.by_req[reqs[idx[0]].req_id]
            got = d.propose_batch([reqs[i] for i in idx], [ks[i] for i in idx])
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out

    @property
    def follows_target(self) -> bool:  # type: ignore[override]
        return any(d.follows_target for d in self.by_req.values())

    def observe(self, step: StepOutput, kept: Sequence[Kept]) -> None:
        """Each drafter observes the step for its own requests."""
        for d in {id(d): d for d in self.by_req.values()}.values():
            mine = [it for it in kept if self.by_req.get(it[0].req_id) is d]
            if mine:
                d.observe(step, mine)

    def release(self, req: Request) -> None:
        d = self.by_req.get(req.req_id)
        if d is not None:
            d.release(req)
