"""Watch fan-out: one message at once, changes rate-limited, heartbeats when quiet."""

from __future__ import annotations

import asyncio
import time

from helexa.neuron.status import StatusHub
from helexa.proto import neuron_pb2 as pb


def _hub(heartbeat_secs: float = 5.0) -> tuple[StatusHub, list[int]]:
    taken: list[int] = []

    def take() -> pb.NeuronStatus:
        taken.append(1)
        return pb.NeuronStatus(neuron="n", unix_ms=int(time.time() * 1000))

    return StatusHub(take, heartbeat_secs=heartbeat_secs), taken


async def _collect(hub: StatusHub, secs: float, poke: float | None = None,
                   heartbeat_ms: int = 0) -> list[tuple[float, pb.NeuronStatus]]:
    got: list[tuple[float, pb.NeuronStatus]] = []
    t0 = time.monotonic()

    async def read() -> None:
        async for st in hub.watch(heartbeat_ms):
            got.append((time.monotonic() - t0, st))

    task = asyncio.ensure_future(read())
    end = t0 + secs
    while time.monotonic() < end:
        await asyncio.sleep(poke or secs)
        if poke:
            hub.changed()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return got


def test_first_message_at_once_then_heartbeat_when_quiet() -> None:
    hub, _ = _hub(heartbeat_secs=0.1)
    got = asyncio.run(_collect(hub, 0.35))
    assert got[0][0] < 0.05
    assert 3 <= len(got) <= 5  # 0, ~0.1, ~0.2, ~0.3
    assert [st.seq for _, st in got] == list(range(1, len(got) + 1))


def test_a_burst_of_changes_is_rate_limited_to_20_per_second() -> None:
    hub, _ = _hub()
    got = asyncio.run(_collect(hub, 0.5, poke=0.002))  # ~250 changes
    assert 5 <= len(got) <= 12
    gaps = [b[0] - a[0] for a, b in zip(got[1:], got[2:], strict=False)]
    assert min(gaps) >= 0.045


def test_a_change_after_a_quiet_spell_is_seen_within_100_ms() -> None:
    async def run() -> float:
        hub, _ = _hub(heartbeat_secs=10)
        stamps: list[float] = []

        async def read() -> None:
            async for _ in hub.watch():
                stamps.append(time.monotonic())

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)
        t_change = time.monotonic()
        hub.changed()
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return stamps[1] - t_change

    assert asyncio.run(run()) < 0.1


def test_metrics_show_the_host_tier_only_where_a_model_has_one():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from helexa.neuron.engine import messages as em
    from helexa.neuron.metrics import NeuronMetrics

    def model(mid: str, host: int) -> SimpleNamespace:
        kv = em.KvLedger(total_bytes=100, free_bytes=100, cached_bytes=0, reserved_bytes=0,
                         used_bytes=0, block_size=16, bytes_per_token=4,
                         host_total_bytes=host, host_cached_bytes=host // 4)
        return SimpleNamespace(model_id=mid, state=2, engine_status=em.EngineStatus(
            kv=kv, in_flight=0, queued=0, running=0, prefix_host_hit_tokens=48,
            host_offloaded_blocks=5, host_restored_blocks=3))

    residency = SimpleNamespace(models={"a": model("a", 4096), "b": model("b", 0)})
    text = generate_latest(NeuronMetrics(residency).registry).decode()  # type: ignore[arg-type]
    assert 'helexa_kv_host_total_bytes{model="a"} 4096.0' in text
    assert 'helexa_kv_host_cached_bytes{model="a"} 1024.0' in text
    assert 'helexa_kv_host_offloaded_blocks_total{model="a"} 5.0' in text
    assert 'helexa_kv_host_restored_blocks_total{model="a"} 3.0' in text
    assert 'helexa_prefix_host_hit_tokens_total{model="a"} 48.0' in text
    assert 'helexa_kv_host_total_bytes{model="b"}' not in text


def test_metrics_count_growths_and_refusals_by_reason():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from helexa.neuron.engine import messages as em
    from helexa.neuron.metrics import NeuronMetrics

    kv = em.KvLedger(total_bytes=100, free_bytes=100, cached_bytes=0, reserved_bytes=0,
                     used_bytes=0, block_size=16, bytes_per_token=4)
    status = em.EngineStatus(kv=kv, in_flight=0, queued=0, running=0, kv_growths=7,
                             kv_growths_refused_no_room=2, kv_growths_refused_queued=1,
                             kv_growths_refused_waiting=3,
                             kv_growths_refused_not_admitting=4)
    residency = SimpleNamespace(models={"a": SimpleNamespace(model_id="a", state=2,
                                                             engine_status=status)})
    text = generate_latest(NeuronMetrics(residency).registry).decode()  # type: ignore[arg-type]
    assert 'helexa_kv_growths_total{model="a"} 7.0' in text
    assert 'helexa_kv_growths_refused_total{model="a",reason="no_room"} 2.0' in text
    assert 'helexa_kv_growths_refused_total{model="a",reason="queued"} 1.0' in text
    assert 'helexa_kv_growths_refused_total{model="a",reason="waiting"} 3.0' in text
    assert 'helexa_kv_growths_refused_total{model="a",reason="not_admitting"} 4.0' in text
