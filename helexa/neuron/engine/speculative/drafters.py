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

Optional methods a drafter may have (the Speculator calls them when present):
`propose_batch(reqs, ks) -> list[Draft]` (all of a step's proposals in one
call), `observe(items)` (after each step: (request, its index among the step's
sequences, positions it computed and kept) for the requests still running; the
step's hidden states are the runner's: the MTP drafter follows the target so),
`release(req)` (a request ended: drop what the drafter kept for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from helexa.neuron.engine.request import Request


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q; None = one-hot on tokens


class Drafter(Protocol):
    name: str  # what /v1/models and the metrics call it

    def propose(self, req: Request, k: int) -> Draft: ...


_NO_DRAFT = Draft([])


@dataclass
class NgramDrafter:
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
class OracleDrafter:
    """Always right (tests): proposes the target's own greedy continuation."""

    truth: Truth
    name: str = "oracle"

    def propose(self, req: Request, k: int) -> Draft:
        return Draft(self.truth(req.all_token_ids(), k)) if k > 0 else _NO_DRAFT


@dataclass
class AdversarialDrafter:
    """Always wrong (tests): every proposed token differs from the target's greedy one."""

    truth: Truth
    vocab_size: int
    name: str = "adversarial"

    def propose(self, req: Request, k: int) -> Draft:
        if k <= 0:
            return _NO_DRAFT
        return Draft([(t + 1) % self.vocab_size for t in self.truth(req.all_token_ids(), k)])


@dataclass
class PerRequestDrafter:
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
            got = propose_all(d, [reqs[i] for i in idx], [ks[i] for i in idx])
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out

    def observe(self, items: Sequence[tuple[Request, int, int]]) -> None:
        """Each drafter that follows the target observes its own requests."""
        for d in {id(d): d for d in self.by_req.values()}.values():
            observe = getattr(d, "observe", None)
            mine = [it for it in items if self.by_req.get(it[0].req_id) is d]
            if observe is not None and mine:
                observe(mine)

    def release(self, req: Request) -> None:
        release = getattr(self.by_req.get(req.req_id), "release", None)
        if release is not None:
            release(req)


def propose_all(drafter: Drafter, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
    """`drafter`'s drafts for `reqs`: one propose_batch call where it has one (a model
    batches its forwards), else propose per request."""
    batch = getattr(drafter, "propose_batch", None)
    if batch is not None:
        return list(batch(reqs, ks))
    return [drafter.propose(r, k) for r, k in zip(reqs, ks, strict=True)]


def make_drafter(speculation: str, loaded: Drafter | None = None, *, runner: Any = None,
                 ensure_blocks: Callable[[Request, int], None] | None = None) -> Drafter | None:
    """The drafter a `speculation` setting names; None for "off". Clear error otherwise.
    `loaded` is the draft-model drafter loaded with the model (draft_model.py), if any;
    "mtp" drafts with the MTP head of the model `runner` runs (mtp.py; MtpUnavailable,
    a ValueError, where it has none), drawing blocks with `ensure_blocks`."""
    if speculation == "off":
        return None
    if speculation == "ngram":
        return NgramDrafter()
    if speculation.startswith("draft:"):
        if loaded is not None and loaded.name == speculation:
            return loaded
        raise ValueError(f"speculation = {speculation!r}: that draft model was not loaded with "
                         "this model (a draft model loads with its target, from the target's "
                         "[[models]] speculation at start; docs/speculation.md)")
    if speculation == "mtp":
        from helexa.neuron.engine.speculative.mtp import MtpDrafter  # imports the runner

        assert ensure_blocks is not None, "the MTP drafter draws blocks through the engine"
        return MtpDrafter(runner, ensure_blocks)
    raise ValueError(f"speculation: expected \"ngram\", \"mtp\", \"draft:<model id>\" or"
                     f" \"off\", got {speculation!r}")
