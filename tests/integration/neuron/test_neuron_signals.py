"""SIGHUP applies reload-safe changes without reloading; a broken config is refused; SIGTERM drains."""

from __future__ import annotations

import asyncio
import copy
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from support.neuron import (
    NeuronClient,
    NeuronProcess,
    chat_request,
    ledger_whole,
    model_of,
    write_neuron_config,
)

from helexa.proto import neuron_pb2 as pb


def test_sighup_raising_max_in_flight_takes_effect_without_a_reload(
        neuron_main: NeuronProcess, neuron_main_config: dict[str, Any],
        neuron_token: str) -> None:
    raised = copy.deepcopy(neuron_main_config)
    raised["admission"]["max_in_flight"] = 3
    raised["kv"]["default_output_tokens"] = 77  # reload-safe, and reported so routers estimate with it
    raised["admission"]["max_in_flight_per_principal"] = 2  # reported too (0: no cap)
    raised["kv"]["block_size"] = 32  # load-time: reported as needing a restart, not applied
    loads_before = len(neuron_main.logs("model.loading"))

    async def run() -> tuple[int, int]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            write_neuron_config(neuron_main.config_path, raised)
            neuron_main.signal(signal.SIGHUP)
            await c.watch_until(lambda st: model_of(st).admission.max_in_flight == 3
                                and model_of(st).admission.default_output_tokens == 77
                                and model_of(st).admission.max_in_flight_per_principal == 2)
            runs = [asyncio.ensure_future(c.generate(chat_request(
                f"hup-{i}", principal=f"h{i}", max_tokens=400, ignore_eos=True)))
                for i in range(5)]
            st = await c.watch_until(lambda st: model_of(st).in_flight == 3)
            peak = model_of(st).in_flight
            await asyncio.gather(*runs)
            write_neuron_config(neuron_main.config_path, neuron_main_config)
            neuron_main.signal(signal.SIGHUP)
            st = await c.watch_until(lambda st: model_of(st).admission.max_in_flight == 2
                                     and not model_of(st).admission.max_in_flight_per_principal)
            await c.watch_until(ledger_whole)
            return peak, model_of(st).admission.max_in_flight

    try:
        peak, restored = asyncio.run(run())
    finally:
        write_neuron_config(neuron_main.config_path, neuron_main_config)
    assert peak == 3 and restored == 2
    assert len(neuron_main.logs("model.loading")) == loads_before  # weights untouched
    change = neuron_main.wait_for_log(
        "config.changed", where=lambda r: r.get("key") == "admission.max_in_flight")
    assert (change["old"], change["new"]) in ((2, 3), (3, 2))
    restart = neuron_main.wait_for_log("config.needs_restart",
                                       where=lambda r: r.get("key") == "kv.block_size")
    assert (restart["old"], restart["new"]) in ((16, 32), (32, 16))


def test_a_broken_config_on_sighup_is_refused_and_the_running_one_kept(
        neuron_main: NeuronProcess, neuron_main_config: dict[str, Any],
        neuron_token: str) -> None:
    path = neuron_main.config_path
    try:
        path.write_text("[admission]\nmax_in_flight = \"many\"\n")
        neuron_main.signal(signal.SIGHUP)
        refused = neuron_main.wait_for_log("config.reload_refused")

        async def run() -> tuple[pb.NeuronStatus, list[pb.GenerateResponse]]:
            async with NeuronClient(neuron_main.address, neuron_token) as c:
                out = await c.generate(chat_request("after-broken", max_tokens=4))
                return await c.status(), out

        st, out = asyncio.run(run())
    finally:
        write_neuron_config(path, neuron_main_config)
    assert "admission.max_in_flight" in refused["error"]
    assert model_of(st).admission.max_in_flight == 2 and out[-1].usage.completion_tokens > 0


def test_sigterm_refuses_new_work_finishes_in_flight_and_exits_0(
        start_daemon: Callable[..., NeuronProcess], tiny_model_dir: Path,
        neuron_main_config: dict[str, Any], neuron_token: str) -> None:
    cfg = copy.deepcopy(neuron_main_config)
    cfg["server"].update(name="drain", address_file="drain.addr")
    cfg["server"].pop("metrics_listen")
    daemon = start_daemon("drain", cfg)

    async def run() -> tuple[list[list[pb.GenerateResponse]], tuple, tuple, bool]:
        async with NeuronClient(daemon.address, neuron_token) as c:
            # max_in_flight 2: two run, a third waits in the queue. 900 tokens each (the pool
            # holds two): long enough to outlast the Watch round trips below
            running = [asyncio.ensure_future(c.generate(chat_request(
                f"long-{i}", principal=f"l{i}", max_tokens=900, ignore_eos=True)))
                for i in range(2)]
            await c.watch_until(lambda st: model_of(st).in_flight == 2)
            queued = asyncio.ensure_future(c.refusal(chat_request("queued", max_tokens=4)))
            await c.watch_until(lambda st: model_of(st).queued == 1)
            daemon.signal(signal.SIGTERM)
            queued_refusal = await queued
            # refused while admitted work still runs: it did not wait out the drain
            still_running = not any(f.done() for f in running)
            refused = await c.refusal(chat_request("late", max_tokens=4))
            return await asyncio.gather(*running), refused, queued_refusal, still_running

    outs, (code, md), (qcode, qmd), still_running = asyncio.run(run())
    assert code == grpc.StatusCode.UNAVAILABLE and md["helexa-code"] == "shutting_down"
    assert int(md["helexa-retry-after-ms"]) > 0
    # the queued request is sent elsewhere at once rather than waiting out the drain
    assert qcode == grpc.StatusCode.UNAVAILABLE and qmd["helexa-code"] == "shutting_down"
    assert still_running
    for out in outs:
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert out[-1].usage.completion_tokens == 900
    assert daemon.proc.wait(timeout=30) == 0


def test_sighup_to_a_wider_profile_rebuilds_the_batch_in_place_without_a_reload(
        neuron_main: NeuronProcess, neuron_main_config: dict[str, Any],
        neuron_token: str) -> None:
    """A profile with more decode rows than the model was built for at load (6, where every
    profile then had at most 4), named by the file on SIGHUP: the model re-plans in place
    and six streams then decode in one batch; no weights reloaded, the ledger whole."""
    wide = copy.deepcopy(neuron_main_config)
    wide["profiles"]["six"] = {"max_slots": 6, "max_in_flight": 6}
    wide["models"][0]["profile"] = "six"
    loads_before = len(neuron_main.logs("model.loading"))

    async def run() -> tuple[int, int]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            write_neuron_config(neuron_main.config_path, wide)
            neuron_main.signal(signal.SIGHUP)
            await c.watch_until(lambda st: model_of(st).profile == "six"
                                and model_of(st).state == pb.MODEL_STATE_READY, timeout_secs=30)
            calls = [c.stub.Generate(chat_request(f"six-{i}", principal=f"w{i}", max_tokens=250,
                                                  ignore_eos=True), metadata=c.md)
                     for i in range(6)]
            try:  # (4 at most without the rebuild: the rest wait in flight for a row)
                st = await c.watch_until(lambda st: model_of(st).running == 6, timeout_secs=30)
            finally:
                for call in calls:
                    call.cancel()
            write_neuron_config(neuron_main.config_path, neuron_main_config)
            neuron_main.signal(signal.SIGHUP)
            after = await c.watch_until(lambda st: model_of(st).profile == ""
                                        and ledger_whole(st), timeout_secs=30)
            return model_of(st).running, model_of(after).admission.max_slots

    try:
        running, back = asyncio.run(run())
    finally:
        write_neuron_config(neuron_main.config_path, neuron_main_config)
    assert running == 6 and back == 4
    assert len(neuron_main.logs("model.loading")) == loads_before  # weights untouched
    switched = neuron_main.wait_for_log("model.profile", where=lambda r: r.get("profile") == "six")
    assert "built for max_slots: 4 -> 6" in switched["changed"]
    assert neuron_main.wait_for_log("model.switched")["max_slots"] == 6
    assert not [r for r in neuron_main.logs("model.limits_capped") if "six" in str(r)]
