"""The limits a model advertises and runs under, and the daemon's context check.

The limits a model advertises (`context`, `input`, `output`) come from its
plan (helexa.plan). Whether a request fits them is the engine's rule
(helexa/budget.py); `check_context` applies that same rule in the
daemon as soon as the prompt is tokenised, so an impossible request is
refused without a trip to the engine, in the engine's words. `effective_limits` folds a
profile's overrides into the config's admission / engine knobs (what the
engine receives as Limits at load, on SIGHUP and on a profile switch).
Refusals are helexa/refusal.py's, turned into a gRPC status only at the edge
(helexa/neuron/grpc_status.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from helexa.budget import check_request
from helexa.config.schema import ModelEntry, NeuronConfig
from helexa.neuron.engine import messages
from helexa.neuron.engine.spec import limits_from_config
from helexa.refusal import Refusal

log = structlog.get_logger(component="neuron")


@dataclass(frozen=True)
class ModelLimits:
    """The limits a model advertises: context = prompt + output tokens of one request."""

    context: int
    input: int
    output: int
    fixed_bytes_per_request: int = 0  # hybrid models' linear-attention state (per card)
    prefix_cache: bool = True  # hybrid models: only with snapshot slots (docs/architecture.md)
    prefix_sharing: str = "principal"  # kv.prefix_sharing: principal | global

    @classmethod
    def from_plan(cls, plan: object, prefix_cache: bool = True,
                  prefix_sharing: str = "principal") -> ModelLimits:
        """From a helexa.plan.ModelPlan (its context, input, output, fixed_bytes and snapshot
        slots) and the prefix cache as configured ([kv] prefix_cache, prefix_sharing)."""
        fixed = int(getattr(plan, "fixed_bytes", 0))
        snapshots = int(getattr(plan, "num_snapshot_slots", 0))
        return cls(context=int(plan.context), input=int(plan.input),  # type: ignore[attr-defined]
                   output=int(plan.output),  # type: ignore[attr-defined]
                   fixed_bytes_per_request=fixed,
                   prefix_cache=prefix_cache and (not fixed or snapshots > 0),
                   prefix_sharing=prefix_sharing)


def check_context(prompt_tokens: int, max_tokens: int | None, limits: ModelLimits) -> None:
    """Refuse a request that cannot fit the model's context (budget.check_request's rule)."""
    refusal: Refusal | None = check_request(prompt_tokens, max_tokens, context=limits.context,
                                            max_output_tokens=limits.output)
    if refusal is not None:
        raise refusal


def effective_limits(cfg: NeuronConfig, profile: str = "",
                     entry: ModelEntry | None = None) -> messages.Limits:
    """Every runtime knob of a model under `cfg`: its own [[models]] entry's speculation
    settings, then its profile's overrides."""
    return limits_from_config(cfg, cfg.profiles.get(profile) if profile else None, entry)


def within_ceilings(limits: messages.Limits, model: Any, replan: bool = False
                    ) -> tuple[messages.Limits, list[str]]:
    """``limits`` with max_slots and max_batched_tokens no larger than what resident
    ``model``'s runner is built for (its ``step_ceilings``: at load NeuronConfig's, the
    most decode rows of any profile and its own profile's step tokens, widened by a
    switch since; (0, 0): unknown, nothing cut), and what was cut, logged: a step past
    them would run rows no graph was captured for, beside activations the pool was not
    measured against. A hybrid's max_in_flight, no more than the state slots its pool
    holds (more would wait for a slot unsaid). ``replan``: the model is about to be
    re-planned for the new figures (profile_switch.py: its pool, its width), said so;
    else raising them takes a switch to a profile asking for them, or a reload of the
    model."""
    slots, tokens = model.step_ceilings
    cut: dict[str, int] = {}
    if slots and limits.max_slots > slots:
        cut["max_slots"] = slots
    if tokens and limits.max_batched_tokens > tokens:  # (a chunk is at most a step's)
        cut["max_batched_tokens"] = tokens
    notes = [f"{k}: {getattr(limits, k)} is more than the {v} this model is built for; "
             f"{v} runs " + ("until it is rebuilt for more (model.switched)" if replan
                             else "(reload the model to raise it)") for k, v in cut.items()]
    states = model.num_state_slots  # a hybrid's: one a request in flight, carved at load
    if states and limits.max_in_flight > states:
        notes.append(f"max_in_flight: {limits.max_in_flight} is more than the {states} "
                     "linear-attention state slots this model holds; "
                     f"{states} run at once " + (
                         "until its pool is re-planned for more (model.switched)" if replan
                         else "(its pool holds no more beside one request of its context)"))
        cut["max_in_flight"] = states
    if notes:
        log.warning("model.limits_capped", model=model.model_id, capped=notes)
    return msgspec.structs.replace(limits, **cut), notes


def effective_kv_dtype(cfg: NeuronConfig, profile: str = "") -> str:
    """The KV dtype a model runs under its profile (may be "auto")."""
    p = cfg.profiles.get(profile) if profile else None
    return (p.kv_dtype if p is not None and p.kv_dtype is not None else cfg.kv.kv_dtype)


def diff_limits(old: messages.Limits | None, new: messages.Limits) -> list[str]:
    """`key: old -> new` for each knob that differs."""
    out = []
    for name in new.__struct_fields__:
        a = getattr(old, name) if old is not None else None
        b = getattr(new, name)
        if a != b:
            out.append(f"{name}: {a} -> {b}")
    return out
