"""`helexa ctl` against a running neuron: load and unload on demand, switch profiles."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import grpc
from support.neuron import NeuronClient, NeuronProcess, chat_request, ledger_whole, model_of

from helexa.proto import neuron_pb2 as pb


def ctl(neuron: NeuronProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "helexa.cli", "ctl", "--config",
                           str(neuron.config_path), *args],
                          capture_output=True, text=True, timeout=120)


def test_ctl_loads_and_unloads_a_catalogue_model(neuron_main: NeuronProcess,
                                                 neuron_token: str) -> None:
    loaded = ctl(neuron_main, "load", "tiny-b")
    assert loaded.returncode == 0, loaded.stderr
    assert "tiny-b: ready" in loaded.stdout

    async def run() -> tuple[pb.NeuronStatus, list[pb.GenerateResponse]]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            out = await c.generate(chat_request("on-b", model="tiny-b", max_tokens=3))
            return await c.status(), out

    st, out = asyncio.run(run())
    assert {m.model for m in st.models} == {"tiny", "tiny-b"}
    assert out[-1].usage.completion_tokens == 3
    # Watch names each engine's attention backend: the cpu one on this CPU-only neuron
    assert all(m.attention_backend.startswith("cpu (") for m in st.models), st.models
    unloaded = ctl(neuron_main, "unload", "tiny-b")
    assert unloaded.returncode == 0 and "unloaded" in unloaded.stdout
    status = ctl(neuron_main, "status")
    assert "tiny-b" in status.stdout and "ready" not in status.stdout.split("tiny-b")[1]
    assert " cpu " in status.stdout.split("tiny-b")[0]  # the ready model's attention backend
    # and the dtype its activations run in: the tiny checkpoint's, not measured (not a GGUF)
    assert "    activations: fp32 (the checkpoint's dtype)" in status.stdout.split("tiny-b")[0]


def test_ctl_unload_drain_refuses_the_queue_at_once_and_finishes_in_flight(
        neuron_main: NeuronProcess, neuron_token: str) -> None:
    """docs/errors.md: a model draining (unload with drain) refuses 503 shutting_down; what
    waits in its queue is refused at once, as on SIGTERM, and admitted work runs to its end."""
    loaded = ctl(neuron_main, "load", "tiny-b")
    assert loaded.returncode == 0, loaded.stderr

    async def run() -> tuple[list[list[pb.GenerateResponse]], tuple, bool, Any]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            # max_in_flight 2: two run (900 tokens each, long enough to be seen in flight),
            # a third waits in the queue
            running = [asyncio.ensure_future(c.generate(chat_request(
                f"ud-{i}", model="tiny-b", principal=f"ud{i}", max_tokens=900,
                ignore_eos=True))) for i in range(2)]
            await c.watch_until(lambda st: model_of(st, "tiny-b").in_flight == 2)
            queued = asyncio.ensure_future(c.refusal_message(chat_request(
                "ud-queued", model="tiny-b", principal="udq", max_tokens=4)))
            await c.watch_until(lambda st: model_of(st, "tiny-b").queued == 1)
            unload = asyncio.ensure_future(
                asyncio.to_thread(ctl, neuron_main, "unload", "tiny-b", "--drain"))
            refused = await queued
            # refused while admitted work still runs: it did not wait out the drain
            still_running = not any(f.done() for f in running)
            return await asyncio.gather(*running), refused, still_running, await unload

    outs, (qcode, qmd, qmsg), still_running, unloaded = asyncio.run(run())
    assert qcode == grpc.StatusCode.UNAVAILABLE and qmd["helexa-code"] == "shutting_down", qmsg
    assert still_running
    for out in outs:
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert out[-1].usage.completion_tokens == 900
    assert unloaded.returncode == 0 and "unloaded" in unloaded.stdout, unloaded.stderr


def test_a_forced_unload_ends_in_flight_work_saying_shutdown(neuron_main: NeuronProcess,
                                                             neuron_token: str) -> None:
    """A request whose engine is stopped under it (unload --force; a drain that outlasts
    drain_secs ends the same way) finishes ABORT with stop_reason `shutdown`, which the
    router reports as such, not as a failure (docs/grpc.md)."""
    loaded = ctl(neuron_main, "load", "tiny-b")
    assert loaded.returncode == 0, loaded.stderr

    async def run() -> tuple[list[pb.GenerateResponse], Any]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            running = asyncio.ensure_future(c.generate(chat_request(
                "uf", model="tiny-b", principal="uf", max_tokens=900, ignore_eos=True)))
            await c.watch_until(lambda st: model_of(st, "tiny-b").in_flight == 1)
            # the call ctl makes, sent at once: ctl's own start-up outlasts the 900 tokens
            unloaded = await c.stub.Unload(pb.UnloadRequest(model="tiny-b", force=True),
                                           metadata=c.md)
            return await running, unloaded

    out, unloaded = asyncio.run(run())
    assert unloaded.unloaded
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert out[-1].stop_reason == "shutdown"
    assert 0 < out[-1].usage.completion_tokens < 900


def test_ctl_profile_switches_admission_knobs_at_runtime(neuron_main: NeuronProcess,
                                                         neuron_token: str) -> None:
    res = ctl(neuron_main, "profile", "tiny", "wide")
    assert res.returncode == 0, res.stderr
    assert "max_in_flight: 2 -> 3" in res.stdout

    async def watch(pred) -> pb.NeuronStatus:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            return await c.watch_until(pred)

    try:
        st = asyncio.run(watch(lambda st: model_of(st).admission.max_in_flight == 3))
        assert model_of(st).profile == "wide"
    finally:
        back = ctl(neuron_main, "profile", "tiny", "")
    assert back.returncode == 0 and "max_in_flight: 3 -> 2" in back.stdout
    bad = ctl(neuron_main, "profile", "tiny", "nope")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr


def test_a_kv_dtype_switch_under_load_keeps_every_request(neuron_main: NeuronProcess,
                                                          neuron_token: str) -> None:
    async def run() -> tuple[list, pb.NeuronStatus, pb.NeuronStatus]:
        async with NeuronClient(neuron_main.address, neuron_token) as c:
            before = await c.status()
            # 900 tokens each (both fit the 2,048-token pool): long enough to be seen in flight
            # together on a fast CPU, where 300 could end between two Watch updates
            runs = [asyncio.ensure_future(c.generate(chat_request(
                f"sw-{i}", principal=f"s{i}", max_tokens=900, ignore_eos=True))) for i in range(2)]
            await c.watch_until(lambda st: model_of(st).in_flight == 2)
            res = await asyncio.to_thread(ctl, neuron_main, "profile", "tiny", "long")
            assert res.returncode == 0, res.stderr
            outs = await asyncio.gather(*runs)
            after = await c.watch_until(lambda st: model_of(st).kv_dtype == "fp16"
                                        and ledger_whole(st))
            back = await asyncio.to_thread(ctl, neuron_main, "profile", "tiny", "")
            assert back.returncode == 0, back.stderr
            await c.watch_until(lambda st: model_of(st).kv_dtype == "fp32" and ledger_whole(st))
        return outs, before, after

    outs, before, after = asyncio.run(run())
    assert all(o[-1].usage.completion_tokens == 900 for o in outs)
    assert model_of(after).limits.context > model_of(before).limits.context
