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
