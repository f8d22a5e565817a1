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
  uniforms from its own generator, all k at once; the k tests reach the host in
  one read, the token after them in one more (a GPU waits twice a request, not
  twice a draft).

Requests with penalties or logprobs are not speculated (policy in the
engine core): their next distribution depends on the tokens accepted before.
"""

from __future__ import annotations

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.sampler import SamplingState, truncate


def verify(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None,
           state: SamplingState, target: list[int] | None = None) -> list[int]:
    """logits [k + 1, vocab] of one request's verification row -> its new tokens (greedy:
    ``target``, the rows' argmax, where the caller read it already)."""
    k = len(draft)
    assert logits.shape[0] == k + 1, f"{logits.shape[0]} logit rows for {k} drafted tokens"
    if state.greedy:
        if target is None:
            target = logits.argmax(dim=-1).tolist()
        a = 0
        while a < k and draft[a] == target[a]:
            a += 1
        return draft[:a] + [target[a]]
    p = target_probs(logits.float(), state)
    gen = state.seeded_generator(logits.device)
    # every draft's test in one read from the device: a uniform u_i each (drawn at once;
    # those past the first rejection go unused), p_i(d_i) and q_i(d_i)
    rows = torch.arange(k, device=logits.device)
    at = to_device(draft, torch.long, logits.device)
    u = torch.rand(k, dtype=torch.float64, device=logits.device, generator=gen)
    q_d = q[rows, at].double() if q is not None else torch.ones_like(u)
    tests = torch.stack([u, p[rows, at].double(), q_d]).tolist()
    out: list[int] = []
    for i, d in enumerate(draft):
        u_i, p_d, q_i = tests[0][i], tests[1][i], tests[2][i]
        if q_i > 0 and u_i * q_i < p_d:  # u < p/q, without the division
            out.append(d)
            continue
        residual = p[i].double().clone()
        if q is not None:
            residual = (residual - q[i].double()).clamp_(min=0)
        else:
            residual[d] = 0.0
        # an empty residual (p <= q everywhere): draw from p (chosen on the device: no read)
        out.append(_draw(torch.where(residual.sum() > 0, residual, p[i].double()), gen))
        return out
    out.append(_draw(p[k].double(), gen))
    return out


def target_probs(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """[n, vocab] the distribution the sampler draws from, for every row of one request."""
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
                             torch.full((n,), top_p, device=x.device))
        x = torch.full_like(x, float("-inf")).scatter_(1, idx, cand)
    if floor is not None:
        x = x.masked_fill(x < floor, float("-inf"))
    return torch.softmax(x, dim=-1)


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    cdf = weights.cumsum(dim=0)
    u = torch.rand(1, dtype=torch.float64, device=weights.device, generator=gen) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=weights.numel() - 1)[0])
