"""Which catalogue models are resident on this neuron, and their lifecycles.

Each resident model runs in its own engine process, reached through an
`EngineClient`. This module owns the map model id → `ResidentModel` and every
change to it: preload at start, `Load` / `Unload` at runtime (single-flight
per model), eviction of the least recently used model of equal or lower
priority when device memory would be short, draining, runtime limits
(SIGHUP, profiles) and failure. Nothing here decides admission — that lives
in the engine process; this module only hands each engine its limits.

States follow the proto's ModelState (helexa/neuron/resident_model.py): loading
→ ready ⇄ switching, ready → draining → (gone), and failed from any of them.
A failed model is remembered with its reason: requests for it are refused
`model_failed` at once, and a Load retries it only after a backoff (doubling
per consecutive failure) unless the Load says `retry_failed` (an operator's
`ctl load`). Whom to evict is helexa/neuron/eviction.py's decision; what an
engine is started with, helexa/neuron/engine_launch.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import structlog

from helexa.config.neuron import canonical_device
from helexa.config.schema import ModelEntry, NeuronConfig, resolve_path
from helexa.neuron import activation
from helexa.neuron.engine import messages
from helexa.neuron.engine_launch import build_spec, load_tokenizer, start_engine
from helexa.neuron.eviction import device_memory_mb, evictions_for
from helexa.neuron.limits import (
    ModelLimits,
    diff_limits,
    effective_kv_dtype,
    effective_limits,
    within_ceilings,
)
from helexa.neuron.reconfigure import settle
from helexa.neuron.resident_model import ModelState, ResidentModel, failure_reason
from helexa.refusal import Refusal

# lazy: bound at first use, after setup_logging() configured structlog
log = structlog.get_logger(component="neuron")

# (spec, on_status, on_fatal, on_progress) -> a started client. Tests pass a fake.
ClientFactory = Callable[..., Awaitable[Any]]


class Residency:
    """The resident models and the operations that change them (one asyncio loop)."""

    def __init__(self, cfg: NeuronConfig, config_path: Path, *,
                 client_factory: ClientFactory | None = None,
                 tokenizer_loader: Callable[[Path], Any] | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.config_path = Path(config_path)
        self.models: dict[str, ResidentModel] = {}
        self._client_factory = client_factory or start_engine
        self._tokenizer_loader = tokenizer_loader or load_tokenizer
        self._on_change = on_change
        self._loads: dict[str, asyncio.Future[tuple[ResidentModel, list[str]]]] = {}
        self._room = asyncio.Lock()  # one memory decision at a time
        self._profiles: dict[str, str] = {}  # model id -> profile switched at runtime

    # ----------------------------------------------------------- lookups

    def catalogue(self) -> list[ModelEntry]:
        return list(self.cfg.models)

    def entry(self, model_id: str) -> ModelEntry:
        try:
            return self.cfg.model(model_id)
        except KeyError:
            raise Refusal("model_not_found",
                          f"The model `{model_id}` does not exist on this neuron.") from None

    def profile_of(self, model_id: str) -> str:
        """The profile a model runs (or will run when loaded)."""
        r = self.models.get(model_id)
        if r is not None:
            return r.profile
        own = self.cfg.model(model_id).profile or ""
        runtime = self._profiles.get(model_id, own)  # as load_profile, unsaid
        return runtime if not runtime or runtime in self.cfg.profiles else own

    def load_profile(self, entry: ModelEntry) -> str:
        """The profile a load of ``entry`` runs: its runtime switch while the file still
        has that profile, else the file's own (`models[].profile`, else the base): the
        switch forgotten, logged `model.profile_removed`, as a reload switches a ready one."""
        own = entry.profile or ""
        runtime = self._profiles.get(entry.id, own)
        if not runtime or runtime in self.cfg.profiles:
            return runtime
        log.warning("model.profile_removed", model=entry.id, profile=runtime,
                    to=own or "(base)")
        self.forget_profile(entry.id)
        return own

    def forget_profile(self, model_id: str) -> None:
        """Drop a runtime profile switch: the file's profile applies at the next load."""
        self._profiles.pop(model_id, None)

    def serving(self, model_id: str) -> ResidentModel:
        """The model a request may go to now, or the refusal that says why not. One switching
        profile takes it: its engine holds it queued until the switch ends, switched or
        abandoned (docs/errors.md, "The table"), as the router holds its own."""
        r = self.models.get(model_id)
        if r is None:
            self.entry(model_id)  # model_not_found when not in the catalogue
            raise Refusal("service_unavailable",
                          f"The model `{model_id}` is not loaded on this neuron.", 1000)
        if r.state in (ModelState.READY, ModelState.SWITCHING):
            return r
        if r.state == ModelState.LOADING:
            raise Refusal("model_loading", f"The model `{model_id}` is loading.", 2000)
        if r.state == ModelState.DRAINING:
            raise Refusal("shutting_down", f"The model `{model_id}` is draining.",
                          int(self.cfg.server.drain_secs * 1000))
        raise Refusal("model_failed", f"The model `{model_id}` failed to load: {r.error}",
                      r.retry_after_ms)

    # ----------------------------------------------------------- loading

    async def preload(self) -> None:
        """Load every `preload = true` model, one after another (progress in the log)."""
        for entry in self.cfg.models:
            if entry.preload:
                await self.load(entry.id)

    async def load(self, model_id: str, *, retry_failed: bool = False
                   ) -> tuple[ResidentModel, list[str]]:
        """Load a catalogue model (single-flight); returns it (ready or failed) and the evicted.

        A model that failed is returned as it is, not reloaded, until its backoff has
        passed, unless `retry_failed`."""
        entry = self.entry(model_id)
        r = self.models.get(model_id)
        if r is not None and r.state in (ModelState.READY, ModelState.SWITCHING):
            r.touch()
            return r, []
        if r is not None and r.state == ModelState.FAILED and not retry_failed \
                and time.monotonic() < r.retry_at and model_id not in self._loads:
            return r, []
        if r is not None and r.state == ModelState.DRAINING:
            raise Refusal("shutting_down", f"The model `{model_id}` is being unloaded.",
                          int(self.cfg.server.drain_secs * 1000))
        task = self._loads.get(model_id)
        if task is None:
            task = asyncio.ensure_future(self._load(entry))
            self._loads[model_id] = task
            task.add_done_callback(lambda _t: self._loads.pop(model_id, None))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not task.cancelled() or (me is not None and me.cancelling()):
                raise  # this caller was cancelled, not the load
            raise Refusal("shutting_down", f"The neuron stopped while `{model_id}` loaded.",
                          int(self.cfg.server.drain_secs * 1000)) from None

    async def cancel_loads(self) -> None:
        """Stop the loads under way (SIGTERM's drain), so that none ends after the neuron
        stopped with an engine left running: one still starting is shut down by its start
        (EngineClient.start); their callers are refused `shutting_down`."""
        loads = list(self._loads.values())
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    async def _load(self, entry: ModelEntry) -> tuple[ResidentModel, list[str]]:
        from helexa.plan import plan_model

        r = ResidentModel(entry=entry, devices=self._devices_of(entry))
        before = self.models.get(entry.id)
        if before is not None and before.state == ModelState.FAILED:
            r.failures = before.failures  # the backoff keeps growing while loads keep failing
            if before.client is not None:  # an engine that died: end what is left of it
                try:
                    await before.client.shutdown(5.0)
                except Exception as e:
                    log.warning("model.shutdown_error", model=entry.id, error=str(e))
        r.profile = self.load_profile(entry)  # one the file has, whole
        r.kv_dtype = effective_kv_dtype(self.cfg, r.profile)
        self.models[entry.id] = r  # LOADING is visible in Watch at once
        self._on_change()
        t0 = time.monotonic()
        log.info("model.loading", model=entry.id, devices=r.devices, profile=r.profile)
        evicted: list[str] = []
        try:
            r.activations = await activation.choose(self.cfg, entry, self.config_path, r.devices)
            r.plan = plan_model(self.cfg, r.load_entry, self.config_path, kv_dtype=r.kv_dtype,
                                device_memory_mb=self.device_memory_mb(r.devices))
            r.kv_dtype = r.plan.kv_dtype
            r.limits = ModelLimits.from_plan(r.plan, self.cfg.kv.prefix_cache,
                                              self.cfg.kv.prefix_sharing)
            r.admission = effective_limits(self.cfg, r.profile, entry)
            if entry.path is None:
                raise RuntimeError("no checkpoint folder (`path`) on this neuron; "
                                   "only `config` is given, which plans but cannot load")
            async with self._room:
                evicted = await self._make_room(r)
            model_dir = resolve_path(self.config_path, entry.path)
            if not (model_dir.is_dir() or (model_dir.suffix == ".gguf" and model_dir.is_file())):
                raise RuntimeError(f"path: no checkpoint folder or .gguf file at {model_dir}")
            try:
                r.tokenizer = await asyncio.to_thread(self._tokenizer_loader, model_dir)
            except Exception as e:
                raise RuntimeError(f"the tokenizer in {model_dir} could not be loaded: {e}") from e
            draft_dir = None
            if r.plan.draft_model_id:  # loads with this model, in its engine (docs/speculation.md)
                draft_path = self.cfg.model(r.plan.draft_model_id).path
                assert draft_path is not None  # NeuronConfig checks a draft entry has a path
                draft_dir = resolve_path(self.config_path, draft_path)
            spec = build_spec(self.cfg, r, model_dir, draft_dir)
            r.client = await self._client_factory(
                spec,
                on_status=lambda s, _r=r: self._on_status(_r, s),
                on_fatal=lambda msg, _r=r: self._on_fatal(_r, msg),
                on_progress=lambda *a, _m=entry.id: log.info("model.progress", model=_m,
                                                             progress=[str(x) for x in a]))
            r.engine_status = getattr(r.client, "status", None)
            r.state = ModelState.READY
            r.touch()
            r.ready_unix_ms = r.last_used_unix_ms
            log.info("model.ready", model=entry.id, load_secs=round(time.monotonic() - t0, 3),
                     context=r.limits.context, kv_dtype=r.kv_dtype,
                     pool_tokens=r.plan.pool_tokens, evicted=evicted)
        except Exception as e:  # a load failure leaves the daemon up and says why
            r.fail(e.message if isinstance(e, Refusal) else failure_reason(e))
            log.error("model.failed", model=entry.id, error=r.error, failures=r.failures,
                      retry_after_secs=round(r.retry_after_ms / 1000))
        settle(self, r)  # a reload that came while it loaded applies now
        self._on_change()
        return r, evicted

    def device_memory_mb(self, devices: list[str]) -> int | None:
        return device_memory_mb(self.cfg, devices)

    def _devices_of(self, entry: ModelEntry) -> list[str]:
        """Its cards, one name each ("cuda" is cuda:0), so eviction counts a card once."""
        return [canonical_device(d) for d in self.cfg.devices_of(entry)]

    async def _make_room(self, new: ResidentModel) -> list[str]:
        """Evict LRU idle models of equal or lower priority until `new` fits every device."""
        cap_mb = self.device_memory_mb(new.devices)
        if cap_mb is None:
            return []  # nothing to plan against; the engine reports a real shortage
        chosen = evictions_for(new, self.models.values(), cap_mb)
        for m in chosen:
            log.info("model.evicting", model=m.model_id, for_model=new.model_id,
                     last_used_unix_ms=m.last_used_unix_ms)
            await self.unload(m.model_id)
        return [m.model_id for m in chosen]

    # ----------------------------------------------------------- engine callbacks

    def _on_status(self, r: ResidentModel, status: messages.EngineStatus) -> None:
        r.engine_status = status
        self._on_change()

    def _on_fatal(self, r: ResidentModel, message: str) -> None:
        r.fail(f"engine failed: {message}")
        if r.failures == 1:  # a model that loaded and served: the next Load may restart it now
            r.retry_at = time.monotonic()
        log.error("model.failed", model=r.model_id, error=r.error, failures=r.failures)
        self._on_change()

    # ----------------------------------------------------------- unloading

    async def unload(self, model_id: str, *, drain: bool = False, force: bool = False) -> bool:
        """Stop a model's engine; refuses (model_busy) a busy model unless drain (its queued
        requests refused shutting_down at once, its in-flight work given drain_secs to
        finish) or force (all of it aborted)."""
        r = self.models.get(model_id)
        if r is None:
            self.entry(model_id)
            return False
        if r.state == ModelState.LOADING:
            raise Refusal("model_loading", f"The model `{model_id}` is loading.", 2000)
        if r.busy and not (drain or force):
            raise Refusal("model_busy", f"The model `{model_id}` has work in flight; "
                          "unload with drain (finish it) or force (abort it).")
        if r.client is not None and r.state != ModelState.FAILED:
            # out of service while it stops: a reload's switch (reconfigure) leaves it be
            r.state = ModelState.DRAINING
            self._on_change()
            if drain:  # as a SIGTERM drain (daemon.py): what is queued is refused
                # shutting_down now, so its callers retry elsewhere; admitted work finishes
                r.client.stop_admitting(True, refuse_queued=True)
                await self.wait_idle(r, self.cfg.server.drain_secs)
        if r.client is not None:
            try:
                await r.client.shutdown(5.0)
            except Exception as e:  # the process may be gone already
                log.warning("model.shutdown_error", model=model_id, error=str(e))
        self.models.pop(model_id, None)
        log.info("model.unloaded", model=model_id, drained=drain, forced=force)
        self._on_change()
        return True

    async def wait_idle(self, r: ResidentModel, timeout_secs: float, *,
                        in_flight_only: bool = False) -> bool:
        """Wait until nothing of `r` is in flight (or queued, unless in_flight_only);
        False when the time ran out."""
        def busy() -> bool:
            s = r.engine_status
            return (s is not None and s.in_flight > 0) if in_flight_only else r.busy

        deadline = time.monotonic() + timeout_secs
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # engine figures change without an event here, so poll briefly
            await asyncio.sleep(min(left, 0.05))
        return True

    async def shutdown(self) -> None:
        """Stop every engine (used after draining on SIGTERM), side by side: each process
        takes its own time to exit, and a neuron's stop is the longest of them, not the sum."""
        async def stop(model_id: str, r: ResidentModel) -> None:
            if r.client is not None:
                try:
                    await r.client.shutdown(5.0)
                except Exception as e:
                    log.warning("model.shutdown_error", model=model_id, error=str(e))
            self.models.pop(model_id, None)

        await asyncio.gather(*(stop(model_id, r) for model_id, r in list(self.models.items())))

    # ----------------------------------------------------------- runtime limits

    def apply_limits(self, cfg: NeuronConfig, replans: tuple[str, ...] = (),
                     only: Collection[str] | None = None) -> list[str]:
        """Hand every ready engine (``only`` those models) its limits under `cfg`; returns
        'model: key old -> new'. ``replans``: models whose pool is re-planned next
        (pool_replans). One loading or switching takes them when ready (reconfigure.settle)."""
        self.cfg = cfg
        changes: list[str] = []
        for r in self.models.values():
            if r.client is None or r.state != ModelState.READY or (
                    only is not None and r.model_id not in only):
                continue
            # (reconfigure updates entry) within what the runner was built for
            new, cut = within_ceilings(effective_limits(cfg, r.profile, r.entry), r,
                                       replan=r.model_id in replans)
            changes += [f"{r.model_id}: {c}" for c in diff_limits(r.admission, new) + cut]
            if new != r.admission:
                r.client.set_limits(new)
                r.admission = new
        self._on_change()
        return changes

    def pool_replans(self, cfg: NeuronConfig) -> list[str]:
        """Ready models whose pool under ``cfg`` must be re-planned: asked for more decode
        rows or a larger step than they were built for (step_ceilings), or a hybrid's pool
        holding another count of state slots (its max_in_flight changed): a reload
        re-plans them in place, as a profile switch does (set_profile). A model its pool
        caps below max_in_flight (one full context must fit beside the slots) is not
        switched again for nothing, nor one whose last re-plan for the same ceilings failed
        (its card cannot hold them: each try drains it and empties its prefix cache; a
        profile switch, or a config asking for other ceilings, tries again)."""
        from helexa.neuron.profile_switch import planned, widened

        out = []
        for r in self.models.values():
            if r.client is None or r.state != ModelState.READY:
                continue
            want = widened(r, cfg, r.profile)
            if want != r.step_ceilings and want != r.refused_ceilings:
                out.append(r.model_id)
                continue
            if not r.num_state_slots:
                continue
            try:
                _, slots = planned(self, r, r.profile, cfg)
            except Exception as e:  # noqa: BLE001 - as at a switch: kept, and said
                log.warning("model.profile_failed", model=r.model_id, profile=r.profile,
                            error=str(e))
                continue
            if slots != r.num_state_slots:
                out.append(r.model_id)
        return out

    # ----------------------------------------------------------- profiles

    async def set_profile(self, model_id: str, profile: str) -> tuple[ResidentModel, list[str]]:
        """Switch a resident model's profile (helexa/neuron/profile_switch.py)."""
        from helexa.neuron.profile_switch import set_profile

        return await set_profile(self, model_id, profile)
