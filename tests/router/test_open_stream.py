"""forward.OpenStream over a scripted call: what it reads ahead for an `n > 1` stream is
handed out in order, and the time its consumer takes with it is the client's, not the
neuron's silence (the idle bound, inflight.Flight.overdue)."""

from __future__ import annotations

import asyncio
import time

from helexa.proto import neuron_pb2 as pb
from helexa.router.forward import OpenStream
from helexa.router.inflight import Flight


class ScriptedCall:
    """A grpc.aio stream call whose reads take pushed messages, waiting for the next."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[pb.GenerateResponse] = asyncio.Queue()

    async def read(self) -> pb.GenerateResponse:
        return await self.items.get()

    def cancel(self) -> bool:
        return True

    def done(self) -> bool:
        return False


def test_a_consumer_slow_with_what_was_read_ahead_is_not_a_silent_neuron():
    idle = 0.3

    async def main() -> tuple[list[int], str | None]:
        call = ScriptedCall()
        flight = Flight("n1", streaming=True)
        flight.call = call
        s = OpenStream("n1", call, pb.GenerateResponse(prompt_tokens=5), flight)  # type: ignore[arg-type]
        s.read_ahead()  # as while a sibling choice waits for admission
        for i in range(50):
            call.items.put_nowait(pb.GenerateResponse(text=f"w{i} ", token_ids=[100 + i]))
        end = time.monotonic() + 5
        while len(s.ahead) < 50:  # every message taken off the call into memory
            assert time.monotonic() < end, (len(s.ahead), call.items.qsize())
            await asyncio.sleep(0.005)
        assert call.items.empty() and len(s.ahead) == 50
        s.stop_reading_ahead()  # every choice admitted: the client's pace from here
        got: list[int] = []
        overdue = None
        async for m in s.messages():
            got.extend(m.token_ids)
            await asyncio.sleep(0.02)  # the client takes 50 messages a second
            overdue = overdue or flight.overdue(time.monotonic(), idle)
            if len(got) == 40:  # 0.8 s of reading what was read ahead: past the bound
                break
        s.cancel()
        return got, overdue

    got, overdue = asyncio.run(main())
    assert got == [100 + i for i in range(40)]  # in order, none lost or repeated
    assert overdue is None, overdue


def test_a_neuron_silent_once_what_was_read_ahead_is_taken_is_overdue():
    """Read ahead, then every choice admitted: the consumer takes what was read and then
    waits on the reader's read still in flight. A neuron that sends nothing more then is
    overdue after the idle bound, as on a stream never read ahead."""
    idle = 0.3

    async def main() -> tuple[list[int], str | None]:
        call = ScriptedCall()
        flight = Flight("n1", streaming=True)
        flight.call = call
        first = pb.GenerateResponse(prompt_tokens=5, prefill_started=True)
        flight.heard(first)
        s = OpenStream("n1", call, first, flight)  # type: ignore[arg-type]
        s.read_ahead()
        for i in range(5):
            call.items.put_nowait(pb.GenerateResponse(token_ids=[100 + i]))
        end = time.monotonic() + 5
        while len(s.ahead) < 5:
            assert time.monotonic() < end
            await asyncio.sleep(0.005)
        s.stop_reading_ahead()  # the neuron hangs from here: nothing more comes
        it = s.messages()
        got: list[int] = []
        for _ in range(6):  # the first message and the 5 read ahead
            got.extend((await anext(it)).token_ids)
        nxt = asyncio.ensure_future(anext(it))  # waits on the reader's read in flight
        overdue = None
        end = time.monotonic() + 2.0  # past six idle bounds
        while overdue is None and time.monotonic() < end:
            await asyncio.sleep(0.05)
            overdue = flight.overdue(time.monotonic(), idle)
        nxt.cancel()
        s.cancel()
        return got, overdue

    got, overdue = asyncio.run(main())
    assert got == [100 + i for i in range(5)]
    assert overdue is not None and overdue.startswith("no message from neuron n1"), overdue
