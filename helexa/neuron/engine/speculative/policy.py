"""How many tokens to draft for a request this step: a pure function of load and acceptance.

Speculation turns spare compute into fewer steps per token. A step's cost
grows with the tokens in it, so at a light load a verification row of k + 1
tokens costs little more than one decode token, while a full batch has no
spare compute and every drafted token that is rejected is a row's worth of
work thrown away. Hence, with `occupancy` = running requests / max_slots:

- occupancy <= spec_full_below: spec_k;
- spec_full_below < occupancy < spec_off_above: spec_k scaled down linearly (at least 1);
- occupancy >= spec_off_above: 0 (speculation gives way to batch width), but for a
  one-token probe (every step until a request has an acceptance rate, then
  on every PROBE_EVERY-th step), so that the rate is known.

And per request, from its acceptance rate (an EWMA of accepted / drafted):
below `spec_min_acceptance` it drafts nothing, except on every
PROBE_EVERY-th step, so that a request whose text turns repetitive is found
again; at or above `spec_keep_acceptance` it drafts spec_k whatever the load: when
nearly every draft is right, a verification row is nearly all output, the
cheapest tokens a full batch can get (bench/spec.py shows it on rewrites).
"""

from __future__ import annotations

from helexa.config.speculation import Speculation

# The engine's steps between probes. Every request kept from drafting probes on the same
# step (Speculator's step count), not each on its own: the steps between are then steps
# without a draft, which lookahead decode can chain (helexa/neuron/engine/lookahead.py).
PROBE_EVERY = 8


def probe_due(step: int) -> bool:
    """Whether the engine's step number `step` is one on which kept requests probe."""
    return step % PROBE_EVERY == 0


def choose_k(policy: Speculation, *, occupancy: float, acceptance: float | None,
             probe: bool) -> int:
    """Tokens to draft for one request (0 = plain decode), under `policy`'s spec_k and
    thresholds (the speculation that applies to the model); `probe`: this is a step on
    which requests kept from drafting probe (probe_due)."""
    k_max = policy.spec_k
    if k_max <= 0:
        return 0
    if acceptance is not None and acceptance >= policy.spec_keep_acceptance:
        return k_max
    if occupancy >= policy.spec_off_above:  # a one-token probe: at once while acceptance is unknown
        return 1 if acceptance is None or probe else 0
    k = k_max
    if occupancy > policy.spec_full_below:
        span = policy.spec_off_above - policy.spec_full_below
        k = max(1, round(k * (policy.spec_off_above - occupancy) / span))
    if acceptance is not None and acceptance < policy.spec_min_acceptance and not probe:
        return 0
    return k


_EWMA = 0.1  # weight of the newest verification: one unlucky draft must not turn a request off


def update_acceptance(acceptance: float | None, drafted: int, accepted: int) -> float | None:
    """A request's acceptance rate after one verification of `drafted` tokens."""
    if drafted <= 0:
        return acceptance
    rate = accepted / drafted
    return rate if acceptance is None else acceptance + _EWMA * (rate - acceptance)
