"""The router's bounded worker pool: results and errors come back, a full pool refuses at once
(503 overloaded), and a task counts until its thread finishes it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from helexa.router.errors import ApiError
from helexa.router.work_pool import WorkPool


def test_run_returns_the_result_and_raises_the_error():
    async def main() -> None:
        pool = WorkPool(1, 0)
        try:
            assert await pool.run(sum, [1, 2, 3]) == 6
            with pytest.raises(ApiError) as e:
                await pool.run(_refuse)
            assert e.value.status == 400
            assert pool.tasks == 0
        finally:
            pool.close()
    asyncio.run(main())


def _refuse() -> None:
    raise ApiError(400, "no", code="invalid_request_error")


def test_a_full_pool_refuses_503_and_frees_its_place_when_the_thread_is_done():
    release = threading.Event()

    async def main() -> None:
        pool = WorkPool(1, 1)  # one running, one waiting
        try:
            held = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(ApiError) as e:
                await pool.run(sum, [1])
            assert e.value.status == 503 and e.value.code == "overloaded"
            assert "limits.schema_workers" in e.value.message
            assert not pool.submit(sum, [1])  # background work is dropped, and says so
            # A caller that leaves does not free the place: its thread still works.
            held[0].cancel()
            await asyncio.sleep(0)
            assert pool.tasks == 2
            release.set()
            await asyncio.gather(held[1])
            while pool.tasks:
                await asyncio.sleep(0.01)
            assert await pool.run(sum, [2]) == 2
        finally:
            release.set()
            pool.close()
    asyncio.run(main())
