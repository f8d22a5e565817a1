"""Verification: which drafted tokens the target accepts, and the token after them.

For one request the target scored [last token, d_1 .. d_k] in one step, so
row i of its logits is the target's distribution for the token after d_i
(row 0: after the last token). Output is d_1 .. d_a plus one more token
drawn from row a, so every verification yields between 1 and k + 1 tokens.

- Greedy: a is the longest prefix where d_i equals row i-1's argmax; the
  extra token is row a's argmax. Output is exactly what plain decoding gives.
- Sampled: the standard rejection rule (Leviathan et al. 2023, Chen et al.
  2023). With p the target's distribution (after temperature, top_k, top_p,
  min_p, as the sampler draws) and q the drafter's, d_i is accepted with
  probability min(1, p(d_i) / q(d_i)); on rejection the token is drawn from
  norm(max(0, p - q)) and verification stops; when all k are accepted the
  extra token is drawn from p. Each output token is then distributed
  exactly as p, whatever the drafter proposed. A seeded request draws its
  uniforms from its own generator, all k at once. The tests of every sampled row
  of a step reach the host in one read, the tokens after them in one more (a GPU
  waits twice a step, where it once waited twice a draft of every request); every
  greedy row's argmax in one read too.

Requests with penalties or logprobs are not speculated (policy in the
engine core): their next distribution depends on the tokens accepted before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.sampler import SamplingState, reads_back, truncate


@dataclass
class Row:
    """One request's verification row: logits [k + 1, vocab] over [last token, d_1 .. d_k],
    its drafts, the drafter's distributions q [k, vocab] (None: a deterministic drafter),
    and its sampling state."""

    logits: torch.Tensor
    draft: list[int]
    q: torch.Tensor | None
    state: SamplingState


def verify(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None,
           state: SamplingState) -> list[int]:
    """One request's verification row -> its new tokens (see verify_rows)."""
    return verify_rows([Row(logits, draft, q, state)])[0]


def verify_rows(rows: list[Row]) -> list[list[int]]:
    """A step's verification rows -> each request's new tokens. Rows are verified together:
    every greedy row's argmax reaches the host in one read; every sampled row's draft tests
    in one more, and the token after each one's accepted drafts in a third (three waits a
    step on a GPU at most, however many requests it verifies)."""
    for row in rows:
        k = len(row.draft)
        assert row.logits.shape[0] == k + 1, f"{row.logits.shape[0]} logit rows for {k} drafts"
    out: list[list[int]] = [[] for _ in rows]
    greedy = [i for i, row in enumerate(rows) if row.state.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.state.greedy]
    if greedy:
        for i, tokens in zip(greedy, _greedy([rows[i] for i in greedy]), strict=True):
            out[i] = tokens
    if sampled:
        for i, tokens in zip(sampled, _sampled([rows[i] for i in sampled]), strict=True):
            out[i] = tokens
    return out


def _greedy(rows: list[Row]) -> list[list[int]]:
    """The longest prefix of each row's drafts its argmax agrees with, and the argmax after."""
    picked, at, out = _read(torch.cat([row.logits for row in rows]).argmax(dim=-1)), 0, []
    for row in rows:
        draft, target, a = row.draft, picked[at:at + len(row.draft) + 1], 0
        while a < len(draft) and draft[a] == target[a]:
            a += 1
        out.append(draft[:a] + [target[a]])
        at += len(draft) + 1
    return out


def _sampled(rows: list[Row]) -> list[list[int]]:
    device = rows[0].logits.device
    drafts = to_device([d for row in rows for d in row.draft], torch.long, device)
    probs, gens, tests, at = [], [], [], 0
    for row in rows:
        k = len(row.draft)
        p = target_probs(row.logits.float(), row.state)
        gen = row.state.seeded_generator(device)
        # a uniform u_i for each draft, all k at once (those past the first rejection go
        # unused), beside p_i(d_i) and q_i(d_i): a [k, 3] of tests
        pos, d = torch.arange(k, device=device), drafts[at:at + k]
        u = torch.rand(k, dtype=torch.float64, device=device, generator=gen)
        q_d = row.q[pos, d].double() if row.q is not None else torch.ones_like(u)
        tests.append(torch.stack([u, p[pos, d].double(), q_d], dim=1))
        probs.append(p)
        gens.append(gen)
        at += k
    read, at = _read(torch.cat(tests)), 0  # every row's tests: the step's first wait
    accepted, draws = [], []
    for row, p, gen in zip(rows, probs, gens, strict=True):
        k, a = len(row.draft), 0
        for u, p_d, q_d in read[at:at + k]:
            if not (q_d > 0 and u * q_d < p_d):  # u < p/q, without the division
                break
            a += 1
        at += k
        if a < k:  # rejected: drawn from norm(max(0, p - q)) at the rejected position
            residual = p[a].double().clone()
            if row.q is not None:
                residual = (residual - row.q[a].double()).clamp_(min=0)
            else:
                residual[row.draft[a]] = 0.0
            # an empty residual (p <= q everywhere): draw from p (chosen on the device)
            weights = torch.where(residual.sum() > 0, residual, p[a].double())
        else:
            weights = p[k].double()
        accepted.append(a)
        draws.append(_draw(weights, gen))
    picked = _read(torch.cat(draws))  # every row's token after its drafts: the second wait
    return [row.draft[:a] + [t] for row, a, t in zip(rows, accepted, picked, strict=True)]


def _read(t: torch.Tensor) -> list[Any]:
    """A device tensor on the host: the one place verification waits for the device."""
    return t.tolist()


def target_probs(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """[n, vocab] the distribution the sampler draws from, for every row of one request;
    nothing read back from a GPU (top_k is known on the host: sampler.py truncate)."""
    sp = state.params
    n, vocab = logits.shape
    x = logits / sp.temperature
    # the sampler's order: min_p's floor from the untruncated logits, top_k/top_p, then the floor
    floor = (x.amax(dim=-1, keepdim=True) + torch.tensor(min(sp.min_p, 1.0)).log()
             if sp.min_p > 0 else None)
    top_k = sp.top_k if 0 < sp.top_k < vocab else vocab
    if top_k < vocab or sp.top_p < 1:
        top_p = max(sp.top_p, 1e-9) if sp.top_p < 1 else 2.0
        cand, idx = truncate(x, torch.full((n,), top_k, device=x.device),
                             torch.full((n,), top_p, device=x.device),
                             host_top_k=None if reads_back(x.device) else [top_k] * n)
        x = torch.full_like(x, float("-inf")).scatter_(1, idx, cand)
    if floor is not None:
        x = x.masked_fill(x < floor, float("-inf"))
    return torch.softmax(x, dim=-1)


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One index drawn from unnormalised weights [vocab], left on the device: [1] int64."""
    cdf = weights.cumsum(dim=0)
    u = torch.rand(1, dtype=torch.float64, device=weights.device, generator=gen) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=weights.numel() - 1)
