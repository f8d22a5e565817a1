"""How many tokens to draft for a request this step: a pure function of load and acceptance.

Speculation turns spare compute into fewer steps per token. A step's cost
grows with the tokens in it, so at a light load a verification row of k + 1
tokens costs little more than one decode token, while a full batch has no
spare compute and every drafted token that is rejected is a row's worth of
work thrown away. Hence, with `occupancy` = running requests / max_slots:

- occupancy <= full_below: k_max;
- full_below < occupancy < off_above: k_max scaled down linearly (at least 1);
- occupancy >= off_above: 0 (speculation gives way to batch width), but for a
  one-token probe (every step until a request has an acceptance rate, then
  every `probe_every` steps), so that the rate is known.

And per request, from its acceptance rate (an EWMA of accepted / drafted):
below `min_acceptance` it drafts nothing, except one probe every
`probe_every` steps so that a request whose text turns repetitive is found
again; at or above `keep_acceptance` it drafts k_max whatever the load: when
nearly every draft is right, a verification row is nearly all output, the
cheapest tokens a full batch can get (bench/spec.py shows it on rewrites).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecPolicy:
    k_max: int = 4
    full_below: float = 0.25
    off_above: float = 0.75
    min_acceptance: float = 0.3
    keep_acceptance: float = 0.8
    probe_every: int = 8


def choose_k(policy: SpecPolicy, *, occupancy: float, acceptance: float | None,
             steps_since_draft: int) -> int:
    """Tokens to draft for one request (0 = plain decode)."""
    if policy.k_max <= 0:
        return 0
    if acceptance is not None and acceptance >= policy.keep_acceptance:
        return policy.k_max
    if occupancy >= policy.off_above:  # a one-token probe: at once while acceptance is unknown
        probe = acceptance is None or steps_since_draft >= policy.probe_every
        return 1 if probe else 0
    k = policy.k_max
    if occupancy > policy.full_below:
        span = policy.off_above - policy.full_below
        k = max(1, round(k * (policy.off_above - occupancy) / span))
    if (acceptance is not None and acceptance < policy.min_acceptance
            and steps_since_draft < policy.probe_every):
        return 0
    return k


_EWMA = 0.1  # weight of the newest verification: one unlucky draft must not turn a request off


def update_acceptance(acceptance: float | None, drafted: int, accepted: int) -> float | None:
    """A request's acceptance rate after one verification of `drafted` tokens."""
    if drafted <= 0:
        return acceptance
    rate = accepted / drafted
    return rate if acceptance is None else acceptance + _EWMA * (rate - acceptance)
