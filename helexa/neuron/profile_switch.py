"""A resident model's profile switch (helexa/neuron/residency.py Residency.set_profile):
its limits handed to the engine, and where the profile changes the pool (a kv_dtype, a
hybrid's state slots, one a request in flight) or asks for more decode rows or a larger
step than the runner was built for (`step_ceilings`) the pool re-planned in place, the
runner rebuilt for the new width: the model goes `switching`, stops admitting, lets its
in-flight work finish, re-plans and resumes (docs/operating.md, "Tuning admission and
profiles")."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog

from helexa.neuron.engine.client import EngineBusy
from helexa.neuron.limits import (
    ModelLimits,
    diff_limits,
    effective_kv_dtype,
    effective_limits,
    within_ceilings,
)
from helexa.neuron.reconfigure import settle
from helexa.neuron.resident_model import ModelState, ResidentModel
from helexa.plan import plan_model, state_slots
from helexa.refusal import Refusal

if TYPE_CHECKING:
    from helexa.config.schema import NeuronConfig
    from helexa.neuron.residency import Residency

log = structlog.get_logger(component="neuron")


async def set_profile(res: Residency, model_id: str, profile: str
                      ) -> tuple[ResidentModel, list[str]]:
    """Switch a resident model's profile; a kv_dtype change, or a hybrid's state slots
    (one a request in flight: the profile's max_in_flight), re-plans the pool in place."""
    r = res.models.get(model_id)
    if r is None:
        res.entry(model_id)
        raise Refusal("service_unavailable", f"The model `{model_id}` is not loaded.")
    if profile and profile not in res.cfg.profiles:
        names = ", ".join(sorted(res.cfg.profiles)) or "none defined"
        raise Refusal("invalid_request_error",
                      f"profile: expected one of the [profiles.*] ({names}), got `{profile}`")
    if r.state != ModelState.READY:
        raise Refusal("service_unavailable",
                      f"The model `{model_id}` is {r.state.name.lower()}.", 1000)
    ceilings = widened(r, res.cfg, profile)
    new_plan, slots = planned(res, r, profile, res.cfg, ceilings)
    changed = [f"profile: {r.profile or '(base)'} -> {profile or '(base)'}"] * (
        profile != r.profile)
    pool = [f"{k}: {a} -> {b}" for k, a, b in (("kv_dtype", r.kv_dtype, new_plan.kv_dtype),
            ("context", r.limits.context, new_plan.context),
            ("state slots", r.num_state_slots, slots),
            ("built for max_slots", r.step_ceilings[0], ceilings[0]),
            ("built for max_batched_tokens", r.step_ceilings[1], ceilings[1])) if a != b]
    try:
        if pool:  # the pool re-planned (a kv_dtype, a hybrid's state slots, a wider step)
            await switch_pool(res, r, new_plan, slots, ceilings)
        if not r.reload_pending:  # else settle() below hands it the reload's, once
            # the config as it is now: a reload may have come while the pool re-planned
            new_limits, cut = within_ceilings(effective_limits(res.cfg, profile, r.entry), r)
            changed += diff_limits(r.admission, new_limits) + cut
            if new_limits != r.admission:
                r.client.set_limits(new_limits)
                r.admission = new_limits
        changed += pool
        r.profile = profile
        res._profiles[model_id] = profile
        log.info("model.profile", model=model_id, profile=profile, changed=changed)
    finally:  # switched or not: a reload that came while it switched applies now
        settle(res, r)
    res._on_change()
    return r, changed


def widened(r: ResidentModel, cfg: NeuronConfig, profile: str) -> tuple[int, int]:
    """The decode rows and step tokens ``r``'s runner must be built for to run ``profile``
    under ``cfg``: its ``step_ceilings`` as they are where the profile asks no more (a
    narrower profile keeps them: no re-plan for nothing), else NeuronConfig.step_ceilings'
    figures where larger (as at load: every profile's rows, this profile's step)."""
    rows, tokens = r.step_ceilings
    asked = effective_limits(cfg, profile, r.entry)
    if not (rows or tokens) or (asked.max_slots <= rows and asked.max_batched_tokens <= tokens):
        return r.step_ceilings  # (0, 0): unknown (nothing is cut either: within_ceilings)
    most = cfg.step_ceilings(profile)
    return max(rows, most[0]), max(tokens, most[1])


def planned(res: Residency, r: ResidentModel, profile: str, cfg: NeuronConfig,
            ceilings: tuple[int, int] | None = None) -> tuple[Any, int]:
    """The pool ``r`` would be planned with under ``cfg`` running ``profile`` (its runner
    built for ``ceilings``, else its own step_ceilings), and its state slots (a hybrid's:
    its max_in_flight, fewer where one full context would not fit beside them; 0 for a
    dense model). Raises PlanError where it cannot be planned."""
    ceilings = ceilings or r.step_ceilings
    plan = plan_model(cfg, r.load_entry, res.config_path,
                      kv_dtype=effective_kv_dtype(cfg, profile),
                      device_memory_mb=res.device_memory_mb(r.devices),
                      step_ceilings=ceilings if any(ceilings) else None)
    asked = effective_limits(cfg, profile, r.entry)
    return plan, state_slots(plan, asked.max_in_flight)[1] if r.num_state_slots else 0


async def switch_pool(res: Residency, r: ResidentModel, plan: Any, slots: int = 0,
                      ceilings: tuple[int, int] | None = None) -> None:
    """SWITCHING: stop admitting, let in-flight work finish, re-plan the pool (its runner
    rebuilt for ``ceilings``' decode rows and step tokens where larger), resume; a pool
    the engine cannot make (its card's memory) is refused, saying why, the old one kept."""
    ceilings = ceilings or r.step_ceilings
    what = ", ".join(k for k, a, b in (
        ("kv_dtype", r.kv_dtype, plan.kv_dtype), ("max_in_flight", r.num_state_slots, slots),
        ("max_slots", r.step_ceilings[0], ceilings[0]),
        ("max_batched_tokens", r.step_ceilings[1], ceilings[1])) if b and a != b) or "kv_dtype"
    reset = getattr(r.client, "reset_kv", None)
    if reset is None:
        raise Refusal("invalid_request_error",
                      f"{what}: this engine cannot re-plan its pool at runtime yet")
    r.state = ModelState.SWITCHING
    res._on_change()
    t0 = time.monotonic()
    try:
        r.client.stop_admitting(True)
        deadline = t0 + res.cfg.server.drain_secs
        while True:
            # queued requests stay queued; in-flight ones hold blocks. The engine may
            # admit one more before the stop reaches it: busy, and the switch waits again
            left = deadline - time.monotonic()
            idle = left > 0 and await res.wait_idle(r, left, in_flight_only=True)
            if cut := taken(res, r):
                raise cut
            if not idle:
                raise Refusal("model_busy", f"in-flight work on `{r.model_id}` did not "
                              f"finish within drain_secs ({res.cfg.server.drain_secs:g} s);"
                              " the switch was abandoned", 1000)
            try:
                await reset(num_blocks=state_slots(plan, slots or r.num_state_slots)[0],
                            num_state_slots=slots, kv_dtype=plan.kv_dtype,
                            bytes_per_token=plan.bytes_per_token, context=plan.context,
                            max_output_tokens=plan.output, max_slots=ceilings[0],
                            max_batched_tokens=ceilings[1])
                break
            except EngineBusy:
                await asyncio.sleep(0.05)  # its status says in flight once it reports
            except Exception as e:  # the engine kept its pool; say why it would not switch
                if cut := taken(res, r):  # (its engine stopped under the re-plan)
                    raise cut from e
                if ceilings != r.step_ceilings:
                    r.refused_ceilings = ceilings
                raise Refusal("invalid_request_error",
                              f"{what}: the engine could not re-plan its pool: {e}") from e
        r.plan, r.kv_dtype, r.num_state_slots, r.step_ceilings, r.limits = (
            plan, plan.kv_dtype, slots or r.num_state_slots, ceilings,
            ModelLimits.from_plan(plan, res.cfg.kv.prefix_cache, res.cfg.kv.prefix_sharing))
        r.refused_ceilings = (0, 0)
    finally:
        if taken(res, r) is None:  # a drain's engine stays closed (it refuses shutting_down)
            r.client.stop_admitting(False)
            r.state = ModelState.READY
        res._on_change()
    log.info("model.switched", model=r.model_id, kv_dtype=plan.kv_dtype,
             context=plan.context, max_slots=ceilings[0], max_batched_tokens=ceilings[1],
             switch_secs=round(time.monotonic() - t0, 3))


def taken(res: Residency, r: ResidentModel) -> Refusal | None:
    """Why a switch under way was cut, if it was: a drain took the model (`ctl unload
    --drain`, SIGTERM: `shutting_down`, UNAVAILABLE to the switch's caller as to a
    request; docs/errors.md, "The table"), an unload stopped it, or its engine died."""
    if r.state == ModelState.FAILED:
        return Refusal("model_failed", f"The model `{r.model_id}` failed while it switched "
                       f"profile: {r.error}", r.retry_after_ms)
    if r.state == ModelState.DRAINING or res.models.get(r.model_id) is not r:
        return Refusal("shutting_down", f"The model `{r.model_id}` is being unloaded (a drain, or "
                       "the neuron stopping); its "
                       "profile switch was abandoned", int(res.cfg.server.drain_secs * 1000))
    return None
