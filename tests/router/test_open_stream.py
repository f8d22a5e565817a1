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
