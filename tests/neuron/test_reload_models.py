"""A SIGHUP reaches every resident model: one loading or switching takes it once ready, a
profile removed from the file is switched away from whole, and a load applies the same
ceilings a reload does (helexa/neuron/reconfigure.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from support.fake_engine import FakeEngineClient, run_fake_neuron
from support.neuron import NeuronClient, model_of, write_neuron_config

from helexa.config.schema import load_neuron_config
from helexa.neuron.daemon import NeuronDaemon
from helexa.proto import neuron_pb2 as pb


def _config(tmp_path: Path, model_dir: Path, **over: Any) -> dict[str, Any]:
    (tmp_path / "token").write_text("t")
    cfg: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "admission": {"max_in_flight": 16, "max_queue_depth": 256},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    }
    cfg.update(over)
    return cfg


async def _until(cond: Callable[[], bool], secs: float = 5.0) -> None:
    """Wait until ``cond()``, at most ``secs`` (the test's asserts then say what is wrong)."""
    for _ in range(int(secs * 100)):
        if cond():
            return
        await asyncio.sleep(0.01)


def _slow_engine() -> tuple[Any, Any, asyncio.Event, asyncio.Event]:
    """A fake engine factory whose start waits for `go` (the engine loads its weights),
    having set `loading`: (the factory, the one it wraps, whose `made` lists the engines
    started, loading, go)."""
    made = FakeEngineClient.factory(lambda _p, _i: 7)
    loading, go = asyncio.Event(), asyncio.Event()

    async def slow_start(spec: Any, **kw: Any) -> FakeEngineClient:
        loading.set()
        await go.wait()
        return await made(spec, **kw)

    return slow_start, made, loading, go


def test_a_reload_during_a_load_applies_once_the_model_is_ready(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The limits and the profile a reload sets while the engine is still loading are
    the ones it serves with once ready (Watch and the engine say so)."""
    cfg = _config(tmp_path, tiny_model_dir, profiles={"solo": {"max_in_flight": 1}})
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)
    slow_start, made, loading, go = _slow_engine()

    async def run() -> tuple[Any, Any, str]:
        daemon = NeuronDaemon(path, load_neuron_config(path), client_factory=slow_start)
        await daemon.start()
        preload = asyncio.ensure_future(daemon.residency.preload())
        try:
            await loading.wait()
            cfg["admission"].update(max_in_flight=3, max_queue_depth=7)
            cfg["kv"]["default_output_tokens"] = 99
            write_neuron_config(path, cfg)
            daemon.reload()
            cfg["models"][0]["profile"] = "solo"
            write_neuron_config(path, cfg)
            daemon.reload()
            go.set()
            await preload
            r = daemon.residency.models["tiny"]
            await _until(lambda: r.profile == "solo" and r.state.name == "READY")
            async with NeuronClient(daemon.address, "t") as c:
                st = await c.watch_until(lambda st: True)
            return model_of(st).admission, made.made[0].limits, model_of(st).profile
        finally:
            await daemon.drain()

    shown, engine, profile = asyncio.run(run())
    assert profile == "solo"
    assert (shown.max_in_flight, shown.max_queue_depth, shown.default_output_tokens) == (
        1, 7, 99)
    assert (engine.max_in_flight, engine.max_queue_depth, engine.default_output_tokens) == (
        1, 7, 99)


def test_a_second_reload_during_a_re_plan_is_built_for_once_the_first_is_done(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two SIGHUPs raising engine.max_slots, the second while the first's re-plan waits for
    in-flight work: the model ends built for and running the second's figure, and no log
    tells the operator to reload the model for it."""
    cfg = _config(tmp_path, tiny_model_dir, engine={"max_slots": 2})
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        async with NeuronClient(daemon.address, "t") as c:
            running = asyncio.ensure_future(c.generate(pb.GenerateRequest(
                req_id="long", model="tiny", text="hi", max_tokens=150, ignore_eos=True)))
            await _until(lambda: r.active == 1)
            for rows in (4, 8):
                cfg["engine"]["max_slots"] = rows
                write_neuron_config(path, cfg)
                daemon.reload()
                await _until(lambda: r.state.name == "SWITCHING")
            await running
            await _until(lambda: r.state.name == "READY" and r.step_ceilings[0] == 8)
            st = await c.watch_until(lambda st: True)
        return ([c["max_slots"] for c in engine.reset_calls], engine.limits.max_slots,
                model_of(st).state)

    with structlog.testing.capture_logs() as logs:
        resets, rows, state = run_fake_neuron(path, body, script=lambda _p, _i: 7,
                                              step_secs=0.01)
    assert resets == [4, 8] and rows == 8 and state == pb.MODEL_STATE_READY
    notes = [n for e in logs if e["event"] == "model.limits_capped" for n in e["capped"]]
    assert notes and not [n for n in notes if "reload the model" in n], notes


def test_removing_the_running_profile_switches_back_to_the_files_own(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A model switched at runtime to a profile the file then drops runs the file's own
    profile whole (its KV dtype and pool too), as `ctl profile` would switch, and says so;
    not the dropped profile's KV with the base's admission."""
    cfg = _config(tmp_path, tiny_model_dir, admission={"max_in_flight": 5},
                  profiles={"q8": {"kv_dtype": "int8", "max_in_flight": 2},
                            "solo": {"max_in_flight": 1}})
    cfg["models"][0]["profile"] = "solo"
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        async with NeuronClient(daemon.address, "t") as c:
            base = model_of(await c.watch_until(lambda st: True))
            await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="q8"),
                                  metadata=c.md)
            on_q8 = model_of(await c.watch_until(lambda st: True))
            del cfg["profiles"]["q8"]
            write_neuron_config(path, cfg)
            daemon.reload()
            r = daemon.residency.models["tiny"]
            await _until(lambda: r.profile != "q8" and r.state.name == "READY")
            st = await c.watch_until(lambda st: True)
        return base, on_q8, model_of(st), engine.limits.max_in_flight

    with structlog.testing.capture_logs() as logs:
        base, on_q8, after, engine_max = run_fake_neuron(path, body,
                                                         script=lambda _p, _i: 7)
    assert (on_q8.profile, on_q8.kv_dtype, on_q8.admission.max_in_flight) == ("q8", "int8", 2)
    assert (after.profile, after.kv_dtype, after.admission.max_in_flight, engine_max) == (
        "solo", base.kv_dtype, 1, 1)
    assert after.limits.context == base.limits.context
    removed = [e for e in logs if e["event"] == "model.profile_removed"]
    assert [(e["profile"], e["to"]) for e in removed] == [("q8", "solo")]


def test_a_hybrid_loads_with_no_more_in_flight_than_its_state_slots(
        tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    """max_in_flight past the state slots a hybrid's pool holds is capped at load as a
    reload caps it: the engine, Watch and the log say the figure it runs."""
    path = write_neuron_config(tmp_path / "neuron.toml", _config(
        tmp_path, tiny_checkpoint("qwen3_5"), admission={"max_in_flight": 100_000},
        kv={"kv_budget_mb": 64}))

    async def body(stub, daemon, engine):
        async with NeuronClient(daemon.address, "t") as c:
            st = await c.watch_until(lambda st: True)
        return (daemon.residency.models["tiny"].num_state_slots, engine.spec.limits,
                engine.limits, model_of(st).admission.max_in_flight)

    with structlog.testing.capture_logs() as logs:
        slots, at_start, now, shown = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert 0 < slots < 100_000
    assert at_start.max_in_flight == now.max_in_flight == shown == slots
    capped = [n for e in logs if e["event"] == "model.limits_capped" for n in e["capped"]]
    assert any(n.startswith(f"max_in_flight: 100000 is more than the {slots}")
               for n in capped), capped


class _SlowStop(FakeEngineClient):
    """An engine process that takes its time to exit (a drain's unload is under way)."""

    async def shutdown(self, timeout_secs: float = 5.0) -> None:
        await asyncio.sleep(0.3)
        self.alive = False


@pytest.mark.parametrize("case", ["file_names_another", "removed_while_draining",
                                  "removed_while_failed"])
def test_a_reload_while_a_model_is_unloaded_or_failed_reaches_its_next_load(
        tmp_path: Path, tiny_model_dir: Path, case: str) -> None:
    """A model switched at runtime to `fast`, then a reload while it drains out (`ctl unload
    --drain`) or after its engine died: the file naming another profile for it, or dropping
    `fast`. Its next load runs a profile the file has, whole (Watch and the engine agree),
    and a dropped one is said (`model.profile_removed`), not `fast` on the base limits."""
    cfg = _config(tmp_path, tiny_model_dir, admission={"max_in_flight": 16},
                  profiles={"fast": {"max_in_flight": 2}, "solo": {"max_in_flight": 1}})
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)
    made = _SlowStop.factory(lambda _p, _i: 7)

    async def run() -> tuple[str, Any, Any, int]:
        daemon = NeuronDaemon(path, load_neuron_config(path), client_factory=made)
        await daemon.start()
        res = daemon.residency
        try:
            await res.load("tiny")
            await res.set_profile("tiny", "fast")
            if case == "removed_while_failed":
                res._on_fatal(res.models["tiny"], "engine exited (signal 9)")
                gone: asyncio.Future[Any] = asyncio.ensure_future(asyncio.sleep(0))
            else:
                gone = asyncio.ensure_future(res.unload("tiny", drain=True))
                await _until(lambda: res.models["tiny"].state.name == "DRAINING")
            if case == "file_names_another":
                cfg["models"][0]["profile"] = "solo"
            else:
                del cfg["profiles"]["fast"]
            write_neuron_config(path, cfg)
            daemon.reload()
            await gone
            async with NeuronClient(daemon.address, "t") as c:
                listed = await c.stub.Models(pb.ModelsRequest(), metadata=c.md)
                between = listed.catalogue[0].profile  # as `ctl models` shows it
                await res.load("tiny", retry_failed=True)
                st = await c.watch_until(lambda st: model_of(st).state == pb.MODEL_STATE_READY)
            return between, model_of(st), made.made[-1].limits, len(made.made)
        finally:
            await daemon.drain()

    with structlog.testing.capture_logs() as logs:
        between, after, engine, engines = asyncio.run(run())
    want, max_in_flight = ("solo", 1) if case == "file_names_another" else ("", 16)
    assert engines == 2
    assert between == want  # before the next load: the profile that load runs
    assert (after.profile, after.admission.max_in_flight, engine.max_in_flight) == (
        want, max_in_flight, max_in_flight)
    removed = [(e["profile"], e["to"]) for e in logs if e["event"] == "model.profile_removed"]
    assert removed == ([] if case == "file_names_another" else [("fast", "(base)")])


def test_two_reloads_in_one_loop_turn_end_on_the_second_ones_profile(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two SIGHUPs handled back to back (no await between), the first naming `kv8` (a pool
    re-plan), the second `solo`: the model ends running `solo` whole, as the file says,
    and no switch is refused for the first's being under way."""
    cfg = _config(tmp_path, tiny_model_dir,
                  profiles={"kv8": {"kv_dtype": "int8", "max_in_flight": 3},
                            "solo": {"max_in_flight": 1}})
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        base_kv = r.kv_dtype
        engine.busy_resets = 1  # the re-plan yields, as a real engine's answer does
        for profile in ("kv8", "solo"):
            cfg["models"][0]["profile"] = profile
            write_neuron_config(path, cfg)
            daemon.reload()
        await _until(lambda: r.profile == "solo" and r.state.name == "READY"
                     and r.kv_dtype == base_kv)
        async with NeuronClient(daemon.address, "t") as c:
            st = model_of(await c.watch_until(lambda st: True))
        return base_kv, st, engine.limits.max_in_flight

    with structlog.testing.capture_logs() as logs:
        base_kv, st, engine_max = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert (st.profile, st.kv_dtype, st.admission.max_in_flight, engine_max) == (
        "solo", base_kv, 1, 1)
    assert [e for e in logs if e["event"] == "model.profile_failed"] == []


def test_a_load_under_way_at_sigterm_is_stopped_not_left_running(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """`ctl load` still starting its engine when SIGTERM's drain comes: the load is stopped
    with the neuron, its caller told `shutting_down`, and no engine comes up after the
    neuron stopped (not asserted on info logs: a test before may have set the level)."""
    cfg = _config(tmp_path, tiny_model_dir)
    cfg["models"][0]["preload"] = False
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)
    slow_start, made, loading, go = _slow_engine()

    async def run() -> tuple[str, list[bool]]:
        daemon = NeuronDaemon(path, load_neuron_config(path), client_factory=slow_start)
        await daemon.start()
        async with NeuronClient(daemon.address, "t") as c:
            call = asyncio.ensure_future(c.stub.Load(pb.LoadRequest(model="tiny"),
                                                     metadata=c.md))
            await loading.wait()
            drain = asyncio.ensure_future(daemon.drain())  # SIGTERM
            try:  # read while the drain runs: its server.stop's grace is not the point
                await asyncio.wait_for(call, 10)
                code = "loaded"
            except grpc.aio.AioRpcError as e:
                code = dict(e.trailing_metadata() or ()).get("helexa-code", e.code().name)
            except TimeoutError:
                code = "still loading"
            await drain
        go.set()  # an engine start not stopped would end now
        await asyncio.sleep(0.2)
        return code, [e.alive for e in made.made]  # type: ignore[attr-defined]

    code, alive = asyncio.run(run())
    assert code == "shutting_down"
    assert not any(alive), alive  # no engine left running after the neuron stopped


def test_a_plain_unload_racing_a_reload_does_not_re_plan_the_stopping_engine(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A reload that widens an idle model's step (a pool re-plan) and a plain unload (ctl's,
    or an eviction's: Residency.unload either way) in the same loop turn: the engine that is stopping is not re-planned, no
    switch is logged for it, and the model's next load is built for the reload's figure."""
    cfg = _config(tmp_path, tiny_model_dir, engine={"max_slots": 2})
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)
    stopping = _SlowStop.factory(lambda _p, _i: 7)

    async def run() -> tuple[list[Any], Any, str]:
        daemon = NeuronDaemon(path, load_neuron_config(path), client_factory=stopping)
        await daemon.start()
        await daemon.residency.preload()
        try:
            first = stopping.made[0]
            cfg["engine"]["max_slots"] = 4
            write_neuron_config(path, cfg)
            daemon.reload()  # its switch task runs at the unload's first await
            await daemon.residency.unload("tiny")
            await asyncio.sleep(0.1)  # a switch task, if one were left, would run now
            gone = "tiny" not in daemon.residency.models
            await daemon.residency.load("tiny")
            r = daemon.residency.models["tiny"]
            return first.reset_calls, r.step_ceilings[0], f"{gone}:{r.state.name}"
        finally:
            await daemon.drain()

    with structlog.testing.capture_logs() as logs:
        resets, rows, state = asyncio.run(run())
    assert resets == [] and state == "True:READY" and rows == 4
    assert not [e for e in logs if e["event"] in ("model.profile", "model.profile_failed")]
