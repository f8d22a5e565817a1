"""A reloaded config applied to the resident models (SIGHUP: helexa/neuron/daemon.py).

A ready model takes a reload at once: its limits handed to its engine, within what its
runner is built for (helexa/neuron/limits.py within_ceilings); its pool re-planned in
place where the new figures need it (Residency.pool_replans), its profile kept; its
profile switched where the file names another for it (the file's wins over a runtime
switch), or where the profile it runs is no longer in the file: back to the file's own
(`models[].profile`, else the base settings), as `ctl profile` would switch, logged
`model.profile_removed`. A model loading or switching when a reload comes (or with an
earlier reload's switch scheduled, not yet begun) takes it once it is ready (`settle`, called at the end of its load and of its switch), so no reload is
lost to a model that was busy (docs/operating.md, "Reload, drain, restart"). One not
resident, draining or failed takes it at its next load: a runtime switch the file's
profile replaced, or whose profile left the file, forgotten (Residency.load_profile).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from helexa.neuron.resident_model import ModelState, ResidentModel

if TYPE_CHECKING:
    from helexa.config.schema import NeuronConfig
    from helexa.neuron.residency import Residency

log = structlog.get_logger(component="neuron")

_TAKES_IT = (ModelState.LOADING, ModelState.SWITCHING, ModelState.READY)
_switches: set[asyncio.Future[None]] = set()  # held until done (the loop holds them weakly)


def reconfigure(res: Residency, cfg: NeuronConfig, profiles: dict[str, str]) -> None:
    """Apply ``cfg`` (a reload's, merged) to every resident model; ``profiles``: model id ->
    the profile the file now names for it, where that changed ("" for the base)."""
    res.cfg = cfg
    for model_id in list(res._profiles):
        r = res.models.get(model_id)
        if r is not None and r.state in _TAKES_IT:
            continue  # switched below, or by settle()
        # gone, draining or failed: its next load runs a profile the file has
        if model_id in profiles:
            res.forget_profile(model_id)  # the file's wins over a runtime switch
        res.load_profile(cfg.model(model_id))  # a removed one forgotten, and said
    ready = []
    for r in res.models.values():
        r.entry = cfg.model(r.model_id)
        if r.state in (ModelState.LOADING, ModelState.SWITCHING) or r.switch_queued:
            r.reload_pending = True  # settle(), once it is ready
            if r.model_id in profiles:
                r.reload_profile = profiles[r.model_id]
        elif r.state == ModelState.READY and r.client is not None:
            ready.append(r)
        elif r.state == ModelState.FAILED:  # Watch shows the profile its next load runs
            r.profile = res.load_profile(r.entry)
    _apply(res, ready, profiles)


def settle(res: Residency, r: ResidentModel) -> None:
    """``r``'s load or switch has ended: a reload that came meanwhile applies now."""
    if not r.reload_pending or r.state != ModelState.READY or res.models.get(r.model_id) is not r:
        return  # (one a drain stopped meanwhile is switched no more)
    profile, r.reload_pending, r.reload_profile = r.reload_profile, False, None
    _apply(res, [r], {r.model_id: profile} if profile is not None else {})


def _apply(res: Residency, models: list[ResidentModel], profiles: dict[str, str]) -> None:
    switches: dict[str, str] = {}
    by_id = {r.model_id: r for r in models}
    for r in models:
        want = profiles.get(r.model_id, r.profile)
        if want and want not in res.cfg.profiles:  # the profile it runs left the file
            back = r.entry.profile or ""
            log.warning("model.profile_removed", model=r.model_id, profile=want,
                        to=back or "(base)")
            want = back
        if want != r.profile:
            switches[r.model_id] = want  # its limits come with the switch
    rest = {r.model_id for r in models} - set(switches)
    # a hybrid's new max_in_flight (its state slots), more rows or a larger step than a
    # model was built for (its width): re-planned in place, as at a switch
    replans = [m for m in res.pool_replans(res.cfg) if m in rest]
    res.apply_limits(res.cfg, tuple(replans), only=rest)
    switches |= {m: by_id[m].profile for m in replans}
    for model_id, profile in switches.items():
        by_id[model_id].switch_queued = True  # switching, for a reload before it runs
        task = asyncio.ensure_future(_switch(res, model_id, profile))
        _switches.add(task)
        task.add_done_callback(_switches.discard)


async def _switch(res: Residency, model_id: str, profile: str) -> None:
    r = res.models.get(model_id)
    if r is None or r.state == ModelState.DRAINING:
        return  # unloading or draining: its next load takes the file's config
    r.switch_queued = False  # set_profile marks it switching before it yields
    try:
        await res.set_profile(model_id, profile)
    except Exception as e:
        log.error("model.profile_failed", model=model_id, profile=profile, error=str(e))
        settle(res, r)  # a reload that waited for this switch applies now
