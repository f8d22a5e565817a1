"""A streamed request of several choices (`n`) reads its neuron calls only as fast as its
client takes the events: a client that stops reading stops every call's reads, so gRPC's
flow control reaches the neuron, which pauses the requests (docs/http.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from helexa.router import serve


class Call:
    """An OpenStream stand-in: `n` messages, counting how many were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, 0

    async def messages(self) -> Any:
        for k in range(self.n):
            self.read += 1
            yield k


def test_a_client_that_stops_reading_stops_every_choices_reads():
    calls = [Call(500), Call(500), Call(3)]

    async def main() -> None:
        merged = serve._merge(calls)  # type: ignore[arg-type]
        got = [await anext(merged)]
        await asyncio.sleep(0.1)  # the client reads nothing meanwhile
        assert all(c.read <= 2 for c in calls), [c.read for c in calls]  # one ahead at most
        got += [x async for x in merged]  # it reads again: everything, each call in order
        for i, call in enumerate(calls):
            assert [k for j, k in got if j == i] == list(range(call.n))

    asyncio.run(main())
