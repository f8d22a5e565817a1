"""Profiles switched at runtime: knobs apply at once; a kv_dtype change re-plans the pool in place."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from support.fake_engine import FakeEngineClient, run_fake_neuron
from support.neuron import write_neuron_config

from helexa.config.schema import load_neuron_config
from helexa.neuron.auth import bearer
from helexa.neuron.daemon import NeuronDaemon
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc

MD = bearer("t")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("profiles")
    (d / "token").write_text("t")
    return write_neuron_config(d / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
        "profiles": {"batch": {"max_in_flight": 32, "max_slots": 8},
                     "long": {"kv_dtype": "int8"},
                     "exact": {"default_output_tokens": 8, "grow_output": False}},
    })


def _gen(req_id: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(req_id=req_id, model="tiny", text="hello", max_tokens=max_tokens,
                              ignore_eos=True)


def test_a_profile_without_kv_changes_applies_at_once(config_path: Path) -> None:
    async def body(stub, daemon, engine):
        res = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="batch"),
                                    metadata=MD)
        watch = stub.Watch(pb.WatchRequest(), metadata=MD)
        st = await watch.read()
        watch.cancel()
        return res, st, engine.limits, engine.reset_calls

    res, st, limits, resets = run_fake_neuron(config_path, body, script=lambda _p, _i: 7)
    assert "max_in_flight: 16 -> 32" in res.changed and "max_slots: 8 -> 8" not in res.changed
    assert limits.max_in_flight == 32 and limits.max_slots == 8 and resets == []
    m = st.models[0]
    assert m.profile == "batch" and m.admission.max_in_flight == 32
    assert m.state == pb.MODEL_STATE_READY


def test_a_profile_sets_grow_output(config_path: Path) -> None:
    """A profile's default_output_tokens is a budget that grows (kv.grow_output, the
    default) unless the profile says grow_output = false: then it is where such a reply
    ends (docs/operating.md, "Tuning admission and profiles")."""
    async def body(stub, daemon, engine):
        res = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="exact"),
                                    metadata=MD)
        exact = engine.limits
        await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile=""), metadata=MD)
        return res, exact, engine.limits

    res, exact, base = run_fake_neuron(config_path, body, script=lambda _p, _i: 7)
    assert "grow_output: True -> False" in res.changed, res.changed
    assert exact.grow_output is False and exact.default_output_tokens == 8
    assert base.grow_output is True


def test_a_kv_dtype_switch_lets_in_flight_work_finish_and_advertises_new_limits(
        config_path: Path) -> None:
    async def body(stub, daemon, engine):
        before = daemon.residency.models["tiny"].limits
        running = asyncio.ensure_future(
            _collect(stub.Generate(_gen("old", 30), metadata=MD)))
        await asyncio.sleep(0.05)
        switch = asyncio.ensure_future(stub.SetProfile(
            pb.SetProfileRequest(model="tiny", profile="long"), metadata=MD))
        await asyncio.sleep(0.05)
        states = []
        watch = stub.Watch(pb.WatchRequest(), metadata=MD)
        states.append((await watch.read()).models[0].state)
        # one that comes while it switches waits for the switch, then is served
        held = asyncio.ensure_future(_collect(stub.Generate(_gen("new", 2), metadata=MD)))
        out = await running
        res = await switch
        st = await watch.read()
        while st.models[0].state != pb.MODEL_STATE_READY:
            st = await watch.read()
        watch.cancel()
        return before, states, await held, out, res, st, engine.reset_calls

    before, states, held, out, res, st, resets = run_fake_neuron(
        config_path, body, script=lambda _p, _i: 7, step_secs=0.01)
    assert states == [pb.MODEL_STATE_SWITCHING]
    assert held[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert held[-1].usage.completion_tokens == 2
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 30
    m = st.models[0]
    assert m.kv_dtype == "int8" and m.profile == "long"
    assert m.limits.context > before.context  # int8 KV: more tokens in the same pool
    assert len(resets) == 1 and resets[0]["kv_dtype"] == "int8"
    assert m.kv.total_bytes == resets[0]["num_blocks"] * 16 * resets[0]["bytes_per_token"]
    assert any(c.startswith("kv_dtype: fp32 -> int8") for c in res.changed)


def test_a_switch_the_engine_answers_busy_waits_and_asks_again(config_path: Path) -> None:
    """A request admitted just before the stop reached the engine makes its first re-plan
    answer busy: the switch waits for in-flight work again and re-plans, it does not fail."""
    async def body(stub, daemon, engine):
        engine.busy_resets = 2
        res = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="long"),
                                    metadata=MD)
        st = (await stub.Watch(pb.WatchRequest(), metadata=MD).read()).models[0]
        await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile=""), metadata=MD)
        return res, st, engine.busy_answers, len(engine.reset_calls)

    res, st, busy, resets = run_fake_neuron(config_path, body, script=lambda _p, _i: 7)
    assert busy == 2 and resets == 2  # two busy answers, then the switch and the switch back
    assert st.kv_dtype == "int8" and st.state == pb.MODEL_STATE_READY
    assert any(c.startswith("kv_dtype: fp32 -> int8") for c in res.changed)


def test_an_unknown_profile_is_refused_naming_the_known_ones(config_path: Path) -> None:
    async def body(stub, daemon, engine):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="turbo"),
                                  metadata=MD)
        return e.value

    e = run_fake_neuron(config_path, body, script=lambda _p, _i: 7)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch" in e.details() and "turbo" in e.details()


class _SlowReplan(FakeEngineClient):
    """An engine whose re-plan answers 0.3 s later, failing if it was stopped meanwhile
    (a real engine's process, shut down under the re-plan, answers no more)."""

    async def reset_kv(self, **plan: object) -> None:
        await asyncio.sleep(0.3)
        if not self.alive:
            raise RuntimeError("the engine is shut down")
        await super().reset_kv(**plan)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["unload_drain", "sigterm"])
def test_a_switch_cut_by_a_drain_is_refused_shutting_down_and_stays_closed(
        config_path: Path, how: str) -> None:
    """`ctl profile` re-planning the pool when `ctl unload --drain` (or SIGTERM's drain)
    takes the model: the caller is told 503-class `shutting_down`, as a request to a
    draining model is, not that its profile was invalid; and the switch does not reopen
    admission on the draining engine."""
    made = _SlowReplan.factory(lambda _p, _i: 7)

    async def run() -> tuple[grpc.aio.AioRpcError, bool, bool]:
        daemon = NeuronDaemon(config_path, load_neuron_config(config_path),
                              client_factory=made)
        await daemon.start()
        await daemon.residency.preload()
        r = daemon.residency.models["tiny"]
        unloaded = True
        try:
            async with grpc.aio.insecure_channel(daemon.address) as ch:
                stub = neuron_pb2_grpc.NeuronStub(ch)
                switch = asyncio.ensure_future(stub.SetProfile(
                    pb.SetProfileRequest(model="tiny", profile="long"), metadata=MD))
                while r.state.name != "SWITCHING":
                    await asyncio.sleep(0.01)
                if how == "unload_drain":
                    unloaded = (await stub.Unload(pb.UnloadRequest(model="tiny", drain=True),
                                                  metadata=MD)).unloaded
                else:
                    await daemon.drain()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await switch
        finally:
            if how != "sigterm":
                await daemon.drain()
        return e.value, made.made[0].admitting, unloaded

    err, admitting, unloaded = asyncio.run(run())
    assert (err.code(), dict(err.trailing_metadata() or ())["helexa-code"]) == (
        grpc.StatusCode.UNAVAILABLE, "shutting_down"), err.details()
    assert "being unloaded" in (err.details() or "")
    assert not admitting and unloaded


async def _collect(call) -> list[pb.GenerateResponse]:
    return [r async for r in call]


def test_the_files_profile_changed_on_sighup_replaces_a_runtime_switch(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "token").write_text("t")
    cfg = {
        "server": {"listen": "127.0.0.1:0", "token_file": "token"},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
        "profiles": {"batch": {"max_in_flight": 32}, "solo": {"max_in_flight": 1}},
    }
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="batch"), metadata=MD)
        daemon.reload()  # the file did not change: the runtime switch stays
        kept = daemon.residency.models["tiny"].profile
        cfg["models"][0]["profile"] = "solo"
        write_neuron_config(path, cfg)
        daemon.reload()
        for _ in range(100):
            if daemon.residency.models["tiny"].profile == "solo":
                break
            await asyncio.sleep(0.01)
        return kept, daemon.residency.models["tiny"].profile, engine.limits.max_in_flight

    kept, now, engine_max = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert kept == "batch" and now == "solo" and engine_max == 1


def test_a_models_own_speculation_reloads_and_a_profile_overrides_it(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """[engine] < the model's [[models]] entry < its profile, at load, on SIGHUP and on a
    runtime switch; the other model keeps [engine]'s."""
    (tmp_path / "token").write_text("t")
    cfg = {
        "server": {"listen": "127.0.0.1:0", "token_file": "token"},
        "kv": {"kv_budget_mb": 1},
        "engine": {"speculation": "off", "spec_k": 2},
        "models": [{"id": "tiny", "path": str(tiny_model_dir), "speculation": "ngram",
                    "spec_k": 6, "spec_min_acceptance": 0.5}],
        "profiles": {"quiet": {"speculation": "off"}},
    }
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        seen = [(engine.limits.speculation, engine.limits.spec_k,
                 engine.limits.spec_min_acceptance)]
        cfg["models"][0].update(speculation="off", spec_k=3)
        write_neuron_config(path, cfg)
        changes = daemon.reload()
        seen.append((engine.limits.speculation, engine.limits.spec_k,
                     engine.limits.spec_min_acceptance))
        cfg["models"][0].update(speculation="ngram")
        write_neuron_config(path, cfg)
        daemon.reload()
        seen.append((engine.limits.speculation, engine.limits.spec_k, None))
        res = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="quiet"),
                                    metadata=MD)
        seen.append((engine.limits.speculation, engine.limits.spec_k, None))
        return seen, changes, list(res.changed)

    seen, changes, switched = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert seen == [("ngram", 6, 0.5), ("off", 3, 0.5), ("ngram", 3, None), ("off", 3, None)]
    assert any("speculation: ngram -> off" in c for c in changes), changes
    assert "speculation: ngram -> off" in switched


def test_a_model_is_built_for_every_profile_and_rebuilt_in_place_for_a_wider_one(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """The runner is built at load for the most decode rows of any profile (graphs) and its
    own profile's step tokens (the measured pool): switching to the widest batch needs no
    re-plan; a profile's larger steps re-plan the pool beside them in place, and so does a
    reload asking for more rows than any profile had (no model reload, nothing capped
    once done), each said in the changes and sent to the engine."""
    (tmp_path / "token").write_text("t")
    cfg = {"server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
           "engine": {"max_slots": 4, "max_batched_tokens": 256},
           "kv": {"kv_budget_mb": 1},
           "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
           "profiles": {"wide": {"max_slots": 12, "max_batched_tokens": 1024,
                                 "speculation": "ngram", "spec_k": 5},
                        "rows": {"max_slots": 12}}}
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        spec = engine.spec
        rows = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="rows"),
                                     metadata=MD)
        at_rows = len(engine.reset_calls)
        res = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="wide"),
                                    metadata=MD)
        switched = engine.limits
        cfg["models"][0]["profile"] = "wide"
        cfg["profiles"]["wide"]["max_slots"] = 20  # raised in the file, then a reload
        write_neuron_config(path, cfg)
        daemon.reload()
        for _ in range(500):
            if len(engine.reset_calls) == 2 and r.state.name == "READY":
                break
            await asyncio.sleep(0.01)
        return (spec, list(rows.changed), at_rows, list(res.changed), switched,
                engine.reset_calls, engine.limits, r.step_ceilings, r.plan.graph_rows)

    (spec, rows, at_rows, changed, switched, resets, after, ceilings,
     graph_rows) = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert spec.limits.max_slots == 4 and spec.limits.max_batched_tokens == 256  # base runs
    assert (spec.max_slots_ceiling, spec.max_batched_tokens_ceiling) == (12, 256)
    assert spec.spec_k_ceiling == 5  # the probe verifies the profile's drafts, off at load
    assert "max_slots: 4 -> 12" in rows and at_rows == 0  # built for it: nothing re-planned
    assert "max_slots: 4 -> 12" not in changed and switched.max_slots == 12
    assert "built for max_batched_tokens: 256 -> 1024" in changed
    assert switched.max_batched_tokens == 1024 and not [c for c in changed if "runs" in c]
    assert [(c["max_slots"], c["max_batched_tokens"]) for c in resets] == [(12, 1024),
                                                                           (20, 1024)]
    assert after.max_slots == 20 and ceilings == (20, 1024)
    assert graph_rows == 0  # on CPU: no graphs (the plan counts none), at any width


def test_a_wider_profile_the_card_cannot_hold_is_refused_and_the_old_width_kept(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A switch to a profile wider than the model was built for whose pool the engine
    cannot make (the card's memory) is refused with the engine's reason: the model keeps
    its width and limits, ready, and serves on."""
    (tmp_path / "token").write_text("t")
    path = write_neuron_config(tmp_path / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "engine": {"max_slots": 2},
        "kv": {"kv_budget_mb": 1},
        "models": [{"id": "tiny", "path": str(tiny_model_dir)}],
        "profiles": {"huge": {"max_batched_tokens": 65536}}})
    why = ("re-planning the pool failed: KvPlanError: KV pool does not fit: 900 MiB free "
           "after loading - 880 MiB peak of a worst-case step")

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        engine.fail_resets = why
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="huge"),
                                  metadata=MD)
        out = await _collect(stub.Generate(_gen("after", 3), metadata=MD))
        return refused.value, r.state.name, r.profile, r.step_ceilings, engine.limits, out

    refused, state, profile, ceilings, limits, out = run_fake_neuron(
        path, body, script=lambda _p, _i: 7)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == ("max_batched_tokens: the engine could not re-plan its pool: "
                                 + why)
    assert (state, profile, ceilings) == ("READY", "", (2, 2048))
    assert (limits.max_slots, limits.max_batched_tokens) == (2, 2048)
    assert out[-1].usage.completion_tokens == 3


def test_a_hybrids_profile_with_more_in_flight_re_plans_its_state_slots(
        tmp_path: Path, tiny_checkpoint) -> None:
    """A hybrid holds a state slot a request in flight, carved out of its pool at load: a
    switch to a profile allowing more in flight re-plans the pool with that many (the
    kv dtype unchanged), and back again, each said in the changes."""
    (tmp_path / "token").write_text("t")
    path = write_neuron_config(tmp_path / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "admission": {"max_in_flight": 2},
        "kv": {"kv_budget_mb": 64},
        "models": [{"id": "tiny", "path": str(tiny_checkpoint("qwen3_5"))}],
        "profiles": {"many": {"max_in_flight": 6}}})

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        loaded = r.num_state_slots
        wide = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="many"),
                                     metadata=MD)
        widened = (r.num_state_slots, engine.limits.max_in_flight)
        back = await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile=""),
                                     metadata=MD)
        return loaded, list(wide.changed), widened, list(back.changed), engine.reset_calls

    loaded, wide, widened, back, resets = run_fake_neuron(path, body,
                                                          script=lambda _p, _i: 7)
    assert loaded == 2 and widened == (6, 6)
    assert "state slots: 2 -> 6" in wide and "max_in_flight: 2 -> 6" in wide
    assert "state slots: 6 -> 2" in back and "max_in_flight: 6 -> 2" in back
    assert [c["num_state_slots"] for c in resets] == [6, 2]
    assert resets[0]["num_blocks"] < resets[1]["num_blocks"]  # the slots' bytes from blocks


def test_a_reload_changing_a_hybrids_max_in_flight_re_plans_its_state_slots(
        tmp_path: Path, tiny_checkpoint) -> None:
    """max_in_flight needs no model reload: a SIGHUP raising a hybrid's re-plans its pool
    with that many state slots in place (as a profile switch does), and lowering it gives
    the slots back to the blocks; a reload changing nothing of it switches nothing."""
    (tmp_path / "token").write_text("t")
    cfg = {"server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
           "admission": {"max_in_flight": 2},
           "kv": {"kv_budget_mb": 64},
           "models": [{"id": "tiny", "path": str(tiny_checkpoint("qwen3_5"))}]}
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def until(cond) -> None:
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no re-plan")

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        seen = [(r.num_state_slots, engine.limits.max_in_flight)]
        for n in (5, 3):
            cfg["admission"]["max_in_flight"] = n
            write_neuron_config(path, cfg)
            daemon.reload()
            await until(lambda n=n: r.num_state_slots == n and engine.limits.max_in_flight == n)
            seen.append((r.num_state_slots, engine.limits.max_in_flight))
        cfg["admission"]["max_in_flight"] = 100_000  # more than the pool holds
        write_neuron_config(path, cfg)
        daemon.reload()
        await until(lambda: len(engine.reset_calls) == 3 and r.state.name == "READY")
        capped = r.num_state_slots
        from helexa.config.schema import load_neuron_config
        assert daemon.residency.pool_replans(load_neuron_config(path)) == []  # none again
        cfg["engine"] = {"spec_k": 3}  # a reload leaving max_in_flight as it is
        write_neuron_config(path, cfg)
        daemon.reload()
        await asyncio.sleep(0.2)
        return seen, capped, [(c["num_state_slots"], c["num_blocks"])
                              for c in engine.reset_calls]

    seen, capped, resets = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert seen == [(2, 2), (5, 5), (3, 3)]
    assert 5 < capped < 100_000  # as many as fit beside one full context
    # one re-plan a change, none for a reload that changes none (the capped model's
    # included); the slots' bytes come from the blocks
    assert [slots for slots, _ in resets] == [5, 3, capped] and resets[0][1] < resets[1][1]


def test_a_widen_the_card_cannot_hold_is_tried_once_not_at_every_reload(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A reload asking for more rows than the card holds fails once; later reloads asking
    for the same (a SIGHUP for another key) do not drain the model and fail again, while a
    config asking for other rows tries again."""
    (tmp_path / "token").write_text("t")
    cfg = {"server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
           "engine": {"max_slots": 2}, "kv": {"kv_budget_mb": 1},
           "models": [{"id": "tiny", "path": str(tiny_model_dir)}]}
    path = write_neuron_config(tmp_path / "neuron.toml", cfg)

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        engine.fail_resets = "KvPlanError: KV pool does not fit"
        real, calls = engine.reset_kv, []

        async def counted(**kw):
            calls.append(kw.get("max_slots"))
            return await real(**kw)
        engine.reset_kv = counted
        write_neuron_config(path, {**cfg, "engine": {"max_slots": 4}})
        listed = []
        for _ in range(3):  # the first reload widens; the next two change nothing
            daemon.reload()
            await asyncio.sleep(0.3)
            listed.append(daemon.residency.pool_replans(daemon.cfg))
        write_neuron_config(path, {**cfg, "engine": {"max_slots": 3}})  # other figures
        daemon.reload()
        await asyncio.sleep(0.3)
        return r.step_ceilings, r.state.name, listed, calls

    ceilings, state, listed, calls = run_fake_neuron(path, body, script=lambda _p, _i: 7)
    assert ceilings == (2, 2048) and state == "READY"  # serving at the width it had
    assert listed == [[], [], []]  # not listed again after its failed try
    assert calls == [4, 3]  # one try for 4 rows, then one for 3


def test_a_profile_whose_pool_cannot_hold_the_context_is_refused_saying_why(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """`ctl profile` to a profile whose kv_dtype cannot hold the model's context (3,000
    tokens: 1 MiB holds 4,096 at fp16, 2,048 at fp32) answers INVALID_ARGUMENT with the
    plan's arithmetic, not UNKNOWN; the model keeps its profile, dtype and limits."""
    (tmp_path / "token").write_text("t")
    path = write_neuron_config(tmp_path / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token", "drain_secs": 5.0},
        "kv": {"kv_budget_mb": 1, "kv_dtype": "fp16"},
        "models": [{"id": "tiny", "path": str(tiny_model_dir), "context": 3000}],
        "profiles": {"full": {"kv_dtype": "fp32"}}})

    async def body(stub, daemon, engine):
        r = daemon.residency.models["tiny"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetProfile(pb.SetProfileRequest(model="tiny", profile="full"),
                                  metadata=MD)
        out = await _collect(stub.Generate(_gen("after", 3), metadata=MD))
        return (refused.value, r.state.name, r.profile, r.kv_dtype, r.limits.context,
                engine.reset_calls, out)

    refused, state, profile, kv_dtype, context, resets, out = run_fake_neuron(
        path, body, script=lambda _p, _i: 7)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert dict(refused.trailing_metadata())["helexa-code"] == "invalid_request_error"
    assert refused.details().startswith("profile `full` cannot run `tiny`: ")
    assert "context: expected at most 2,048 tokens" in refused.details()
    assert (state, profile, kv_dtype, context, resets) == ("READY", "", "fp16", 3000, [])
    assert out[-1].usage.completion_tokens == 3
