"""The router's bounded worker pool: results and errors come back, a full pool refuses at once
(503 overloaded), a task counts until its thread finishes it; one principal over its share is
refused 429 while another gets in, waiting tasks are served round robin between principals,
and every count returns to zero after errors and cancellations. Background work (a finished
reply's schema check) never counts toward a principal's share nor the pool's bound, runs after
every waiting request's task and never on every thread, and when its own lane is full the
principal with the most waiting loses its newest."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from helexa.router.errors import ApiError
from helexa.router.work_pool import BACKGROUND_FULL, OVER_SHARE, WorkPool, default_share


def test_run_returns_the_result_and_raises_the_error():
    async def main() -> None:
        pool = WorkPool(1, 0)
        try:
            assert await pool.run("a", sum, [1, 2, 3]) == 6
            with pytest.raises(ApiError) as e:
                await pool.run("a", _refuse)
            assert e.value.status == 400
            assert pool.tasks == 0 and pool.tasks_of("a") == 0 and pool.principals == 0
        finally:
            pool.close()
    asyncio.run(main())


def _refuse() -> None:
    raise ApiError(400, "no", code="invalid_request_error")


def test_a_refused_tasks_arguments_are_freed_without_the_cycle_collector():
    # a refusal's traceback holds the frames that held the task's arguments (the neuron's:
    # a 7.8 MB prompt); in a reference cycle they stayed until the collector's rare full
    # pass, and the neuron's RSS grew ~10 MB a refused prompt
    import gc
    import weakref

    class Prompt:
        pass

    def refuse(prompt: Prompt) -> None:
        raise ApiError(400, "too long", code="context_length_exceeded")

    async def main(prompt: Prompt) -> None:
        pool = WorkPool(1, 0)
        try:
            await pool.run("a", refuse, prompt)
        except ApiError:
            pass
        finally:
            pool.close()

    prompt = Prompt()
    held = weakref.ref(prompt)
    gc.disable()
    try:
        asyncio.run(main(prompt))
        del prompt
        for _ in range(500):  # until the worker thread has left the task's frame
            if held() is None:
                break
            threading.Event().wait(0.01)
        assert held() is None
    finally:
        gc.enable()


def test_a_task_done_before_its_callback_is_added_still_answers(monkeypatch):
    """A worker may finish a task between its queueing and the pool adding its done
    callback (a loaded host): the callback then runs at once and frees the task, and the
    caller still gets its result (it got a 500, AttributeError, once in a CI run)."""
    from concurrent.futures import Future

    from helexa import work_pool

    class DoneFirst(Future):
        def add_done_callback(self, fn):
            self.result(timeout=10)  # the worker has run it: the order a loaded host gives
            super().add_done_callback(fn)

    monkeypatch.setattr(work_pool, "Future", DoneFirst)
    pool = WorkPool(1, 4)

    async def main() -> int:
        return await pool.run("a", sum, [1, 2])
    try:
        assert asyncio.run(main()) == 3
        assert pool.tasks == 0
    finally:
        pool.close()


def test_the_default_share_is_a_quarter_of_the_pool():
    assert default_share(2, 64) == 16
    assert default_share(1, 0) == 1
    pool = WorkPool(2, 64)
    assert pool.per_principal == 16
    pool.close()


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


def test_a_full_pool_refuses_503_and_frees_its_place_when_the_thread_is_done():
    release = threading.Event()

    async def main() -> None:
        pool = WorkPool(1, 1, per_principal=2)  # one running, one waiting
        try:
            held = [asyncio.ensure_future(pool.run("a", release.wait)) for _ in range(2)]
            await _until(lambda: pool.tasks == 2)
            with pytest.raises(ApiError) as e:
                await pool.run("b", sum, [1])
            assert e.value.status == 503 and e.value.code == "overloaded"
            assert "limits.schema_workers" in e.value.message
            # Background work has a lane of its own: taken while requests' are refused.
            ran = threading.Event()
            pool.submit("b", ran.set, on_drop=lambda why: pytest.fail(why))
            assert pool.background == 1 and pool.tasks == 2
            # A caller that leaves while its task runs does not free the place: its thread
            # still works.
            await _until(lambda: len(pool._lane.waiting["a"]) == 1)  # the first one is running
            held[0].cancel()
            await asyncio.sleep(0.05)
            assert pool.tasks == 2
            release.set()
            await asyncio.gather(held[1])
            await _until(lambda: pool.tasks == 0)
            assert await pool.run("b", sum, [2]) == 2
            await _until(lambda: ran.is_set() and pool.background == 0)
        finally:
            release.set()
            pool.close()
    asyncio.run(main())


def test_a_reply_whose_tokens_are_made_is_never_refused_and_goes_first():
    """A whole reply's encoding once the neuron answered (share=False) is taken when the
    pool is full and its principal over its share (a 503 threw the tokens away and its
    retry made them again), and runs before the parses waiting."""
    release = threading.Event()
    order: list[str] = []

    def note(what: str) -> str:
        order.append(what)
        return what

    async def main() -> None:
        pool = WorkPool(1, 1, per_principal=2)  # one running, one waiting: full
        try:
            held = asyncio.ensure_future(pool.run("a", release.wait))
            await _until(lambda: pool.tasks == 1)
            parse = asyncio.ensure_future(pool.run("b", note, "parse"))
            await _until(lambda: pool.tasks == 2)
            with pytest.raises(ApiError):
                await pool.run("a", note, "refused")  # a parse: the pool is full
            reply = asyncio.ensure_future(pool.run("a", note, "reply", share=False))
            await _until(lambda: pool.tasks == 3)
            release.set()
            assert await reply == "reply" and await parse == "parse" and await held
            assert order == ["reply", "parse"]
            await _until(lambda: pool.tasks == 0)
        finally:
            release.set()
            pool.close()
    asyncio.run(main())


def test_a_principal_over_its_share_is_429_while_another_gets_in():
    release = threading.Event()
    refused: list[tuple[str, str]] = []

    async def main() -> None:
        pool = WorkPool(1, 8, per_principal=2)
        pool.on_refuse = lambda reason, principal: refused.append((reason, principal))
        try:
            held = [asyncio.ensure_future(pool.run("a", release.wait)) for _ in range(2)]
            await _until(lambda: pool.tasks_of("a") == 2)
            with pytest.raises(ApiError) as e:
                await pool.run("a", sum, [1])
            assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
            assert "limits.schema_per_principal" in e.value.message
            assert "this API key" in e.value.message
            assert e.value.headers() == {"Retry-After": "1"}
            assert refused == [(OVER_SHARE, "a")]
            anonymous = [asyncio.ensure_future(pool.run("anonymous", release.wait))
                         for _ in range(2)]
            await asyncio.sleep(0.01)
            with pytest.raises(ApiError) as e:  # every caller without a key: one principal
                await pool.run("anonymous", sum, [1])
            assert e.value.status == 429 and "without an API key" in e.value.message
            pool.submit("a", sum, [1])  # background work: taken, not counted toward a's share
            assert pool.background == 1
            other = asyncio.ensure_future(pool.run("b", sum, [5]))  # b still gets in
            # Work after the neuron answered is counted but never refused for the share.
            late = asyncio.ensure_future(pool.run("a", sum, [7], share=False))
            await asyncio.sleep(0.01)
            assert pool.tasks_of("a") == 3 and pool.tasks_of("b") == 1
            release.set()
            assert await other == 5 and await late == 7
            await asyncio.gather(*held, *anonymous)
            await _until(lambda: pool.tasks == 0)
            assert pool.principals == 0 and not pool._lane.waiting and not pool._lane.turns
        finally:
            release.set()
            pool.close()
    asyncio.run(main())


def test_waiting_tasks_are_served_round_robin_between_principals():
    gate = threading.Event()
    order: list[str] = []

    def note(name: str) -> None:
        order.append(name)

    async def main() -> None:
        pool = WorkPool(1, 16, per_principal=8)
        try:
            first = asyncio.ensure_future(pool.run("x", gate.wait))  # holds the one thread
            await _until(lambda: pool.tasks == 1 and not pool._lane.turns)
            runs = [asyncio.ensure_future(pool.run("a", note, f"a{i}")) for i in range(5)]
            await asyncio.sleep(0.01)
            runs += [asyncio.ensure_future(pool.run("b", note, f"b{i}")) for i in range(2)]
            await asyncio.sleep(0.01)
            gate.set()
            await asyncio.gather(first, *runs)
            # b's first task waits for one of a's, not for a's whole backlog.
            assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]
            assert pool.tasks == 0 and pool.principals == 0
        finally:
            gate.set()
            pool.close()
    asyncio.run(main())


def test_counts_return_to_zero_after_errors_and_cancellations():
    gate = threading.Event()

    def boom() -> None:
        raise RuntimeError("a bug of ours")

    async def main() -> None:
        pool = WorkPool(1, 16, per_principal=8)
        try:
            running = asyncio.ensure_future(pool.run("a", gate.wait))
            await _until(lambda: pool.tasks == 1 and not pool._lane.turns)
            waiting = [asyncio.ensure_future(pool.run("a", sum, [i])) for i in range(4)]
            failing = asyncio.ensure_future(pool.run("b", boom))
            await asyncio.sleep(0.01)
            assert pool.tasks_of("a") == 5 and pool.tasks_of("b") == 1
            # Callers that leave while their task waits: it leaves the queue and stops
            # counting at once; the running one counts until its thread is done.
            for w in waiting[:3]:
                w.cancel()
            running.cancel()
            await asyncio.sleep(0.01)
            assert pool.tasks_of("a") == 2 and pool.tasks == 3
            assert len(pool._lane.waiting["a"]) == 1
            gate.set()
            assert await waiting[3] == 3
            with pytest.raises(RuntimeError):
                await failing
            await _until(lambda: pool.tasks == 0)
            assert pool.principals == 0 and not pool._lane.waiting and not pool._lane.turns
            assert pool.tasks_of("a") == pool.tasks_of("b") == 0
        finally:
            gate.set()
            pool.close()
    asyncio.run(main())


def test_close_cancels_waiting_tasks():
    gate = threading.Event()

    async def main() -> None:
        pool = WorkPool(1, 4, per_principal=4)
        running = asyncio.ensure_future(pool.run("a", gate.wait))
        await _until(lambda: pool.tasks == 1 and not pool._lane.turns)
        waiting = asyncio.ensure_future(pool.run("a", sum, [1]))
        await asyncio.sleep(0.01)
        pool.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        await running
        assert pool.tasks == 0
        with pytest.raises(ApiError):
            await pool.run("a", sum, [1])
    asyncio.run(main())


def test_the_share_is_reloadable_and_its_refusals_are_counted(tmp_path):
    import msgspec

    from helexa.config.router import AuthConfig, LimitsConfig, RouterConfig
    from helexa.router.app import RouterState
    from helexa.router.auth import hash_key

    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys]\n"{hash_key("k1")}" = "alice"\n')
    keyless = RouterConfig(limits=LimitsConfig(schema_workers=1, schema_queue_depth=7))
    cfg = msgspec.structs.replace(keyless, auth=AuthConfig(keys_file=str(keys)))
    state = RouterState(keyless, None)
    try:  # no keys: every caller is the one anonymous principal, and the pool is all its
        assert state.work_pool.per_principal == 8
        state.apply(cfg)
        assert state.work_pool.per_principal == 2  # keys: a quarter of 1 + 7
        state.apply(msgspec.structs.replace(cfg, limits=msgspec.structs.replace(
            cfg.limits, schema_per_principal=1)))
        assert state.work_pool.per_principal == 1
        gate = threading.Event()

        async def main() -> None:
            held = asyncio.ensure_future(state.work_pool.run("a", gate.wait))
            await _until(lambda: state.work_pool.tasks == 1)
            with pytest.raises(ApiError):
                await state.work_pool.run("a", sum, [1])
            gate.set()
            await held
        asyncio.run(main())
        text = state.metrics.render().decode()
        assert 'helexa_router_work_refusals_total{reason="principal_share"} 1.0' in text
        assert "helexa_router_work_tasks 0.0" in text
        state.apply(cfg)  # unset again: derived from the pool's size
        assert state.work_pool.per_principal == 2
    finally:
        state.work_pool.close()


def test_the_compile_pools_refusals_and_tasks_have_their_own_metrics():
    """A grammar compile the compile pool refuses is counted as the compile pool's, not the
    parsing pool's, and the compile pool's tasks show while they run."""
    import msgspec

    from helexa.config.router import LimitsConfig, RouterConfig
    from helexa.router.app import RouterState

    state = RouterState(RouterConfig(limits=LimitsConfig(compile_workers=1,
                                                          schema_queue_depth=0)), None)
    state.apply(msgspec.structs.replace(state.cfg, limits=msgspec.structs.replace(
        state.cfg.limits, schema_per_principal=1)))
    gate = threading.Event()
    try:
        async def main() -> str:
            held = asyncio.ensure_future(state.compile_pool.run("a", gate.wait))
            await _until(lambda: state.compile_pool.tasks == 1)
            during = state.metrics.render().decode()
            with pytest.raises(ApiError) as refused:
                await state.compile_pool.run("a", sum, [1])
            assert "having their grammars compiled" in refused.value.message
            gate.set()
            await held
            return during
        during = asyncio.run(main())
        assert "helexa_router_compile_tasks 1.0" in during
        text = state.metrics.render().decode()
        assert 'helexa_router_compile_refusals_total{reason="principal_share"} 1.0' in text
        assert "helexa_router_compile_tasks 0.0" in text
        assert 'helexa_router_work_refusals_total{reason="principal_share"}' not in text
    finally:
        gate.set()
        state.work_pool.close()
        state.compile_pool.close()


def test_with_keys_one_principal_leaves_a_thread_to_the_others(tmp_path):
    """Two threads: a key's slow bodies run on one of them, so another key's parse starts at
    once instead of waiting for one of them to finish; without keys (every caller the one
    principal) both threads are its."""
    import msgspec

    from helexa.config.router import AuthConfig, LimitsConfig, RouterConfig
    from helexa.router.app import RouterState
    from helexa.router.auth import hash_key

    keys = tmp_path / "keys.toml"
    keys.write_text(f'[keys]\n"{hash_key("k1")}" = "alice"\n"{hash_key("k2")}" = "bob"\n')
    keyless = RouterConfig(limits=LimitsConfig(schema_workers=2))
    state = RouterState(msgspec.structs.replace(keyless, auth=AuthConfig(keys_file=str(keys))),
                        None)
    gate = threading.Event()
    running: list[str] = []

    def slow(name: str) -> str:
        running.append(name)
        assert gate.wait(10)
        return name

    async def main() -> None:
        pool = state.work_pool
        slows = [asyncio.ensure_future(pool.run("alice", slow, f"a{i}")) for i in range(3)]
        await _until(lambda: running == ["a0"] and pool.tasks == 3)
        assert await asyncio.wait_for(pool.run("bob", sum, [1, 2]), 5) == 3
        assert running == ["a0"]  # alice's others still wait for her thread
        state.apply(keyless)  # no keys: the pool is all hers, both threads
        gate.set()
        assert await asyncio.gather(*slows) == ["a0", "a1", "a2"]
        assert pool.tasks == 0 and pool.principals == 0
        assert pool.max_running == 2

    try:
        asyncio.run(main())
    finally:
        state.work_pool.close()


def test_a_principals_background_work_never_makes_its_next_request_429():
    """A key's finished requests left schema checks waiting: its next request is taken (its
    share counts only requests' tasks) and runs before those checks."""
    gate = threading.Event()
    order: list[str] = []

    def note(what: str) -> str:
        order.append(what)
        return what

    async def main() -> None:
        pool = WorkPool(1, 8, per_principal=2)
        try:
            held = asyncio.ensure_future(pool.run("a", gate.wait))  # a's request, running
            await _until(lambda: pool.tasks_of("a") == 1 and not pool._lane.turns)
            for i in range(4):  # more checks than a's whole share
                pool.submit("a", note, f"check{i}", on_drop=lambda why: pytest.fail(why))
            assert pool.background == 4 and pool.tasks_of("a") == 1 and pool.tasks == 1
            parse = asyncio.ensure_future(pool.run("a", note, "parse"))
            await _until(lambda: pool.tasks_of("a") == 2)
            with pytest.raises(ApiError) as e:  # its requests' own share still holds
                await pool.run("a", note, "refused")
            assert e.value.status == 429
            gate.set()
            assert await parse == "parse" and await held
            await _until(lambda: pool.background == 0)
            assert order == ["parse", "check0", "check1", "check2", "check3"]
            assert pool.tasks == 0 and pool.principals == 0
        finally:
            gate.set()
            pool.close()
    asyncio.run(main())


def test_background_work_leaves_a_thread_for_requests():
    """With two workers, checks that take long hold one thread at most: a request's task
    runs on the other at once."""
    gate = threading.Event()

    async def main() -> None:
        pool = WorkPool(2, 8, per_principal=4)
        try:
            for _ in range(3):
                pool.submit("a", gate.wait)
            await _until(lambda: pool._bg_running == 1)
            assert await asyncio.wait_for(pool.run("b", sum, [4]), 5) == 4
            assert pool._bg_running == 1 and pool.background == 3
            gate.set()
            await _until(lambda: pool.background == 0)
        finally:
            gate.set()
            pool.close()
    asyncio.run(main())


def test_a_full_background_lane_drops_the_newest_of_the_principal_with_most_waiting():
    gate = threading.Event()
    order: list[str] = []
    dropped: list[tuple[str, str]] = []

    def note(what: str) -> None:
        order.append(what)

    def submit(pool: WorkPool, principal: str, name: str) -> None:
        pool.submit(principal, note, name,
                    on_drop=lambda why: dropped.append((name, why)))

    async def main() -> None:
        pool = WorkPool(1, 8, background_depth=4)
        try:
            held = asyncio.ensure_future(pool.run("x", gate.wait))  # the one thread
            await _until(lambda: pool.tasks == 1 and not pool._lane.turns)
            for name in ("a0", "a1", "a2", "b0"):
                submit(pool, name[0], name)
            assert pool.background == 4 and not dropped
            submit(pool, "b", "b1")  # full: a has the most waiting, its newest goes
            assert dropped == [("a2", BACKGROUND_FULL)]
            submit(pool, "a", "a3")  # a and b have two each: a's new one goes
            assert dropped[-1] == ("a3", BACKGROUND_FULL) and pool.background == 4
            gate.set()
            await held
            await _until(lambda: pool.background == 0)
            assert order == ["a0", "b0", "a1", "b1"]  # round robin between principals
            assert not pool._bg_lane.waiting and not pool._bg_lane.turns
        finally:
            gate.set()
            pool.close()
    asyncio.run(main())


def test_close_cancels_waiting_background_work_without_a_drop():
    gate = threading.Event()
    dropped: list[str] = []

    async def main() -> None:
        pool = WorkPool(1, 1)
        running = asyncio.ensure_future(pool.run("a", gate.wait))
        await _until(lambda: pool.tasks == 1 and not pool._lane.turns)
        pool.submit("a", sum, [1], on_drop=dropped.append)
        assert pool.background == 1
        pool.close()
        assert pool.background == 0  # the waiting one is gone, not counted as waiting
        gate.set()
        await running
        pool.submit("a", sum, [1], on_drop=dropped.append)  # after close: dropped at once
        assert dropped == [BACKGROUND_FULL]
    asyncio.run(main())


def test_background_work_that_raises_is_reported_once_and_its_thread_goes_on():
    """Nobody awaits background work: its exception goes to on_background_error, once,
    never onto a future nobody reads; the lane's count returns to zero and the same
    thread takes the next task."""
    reported: list[tuple[str, str, str]] = []
    ran: list[str] = []

    def boom() -> None:
        raise RecursionError("maximum recursion depth exceeded")

    async def main() -> None:
        pool = WorkPool(1, 1)
        pool.on_background_error = lambda p, task, e: reported.append((p, task, repr(e)))
        try:
            pool.submit("a", boom, on_drop=lambda why: pytest.fail(why))
            pool.submit("b", lambda: ran.append(threading.current_thread().name))
            await _until(lambda: pool.background == 0 and ran)
            assert await pool.run("c", sum, [3]) == 3
        finally:
            pool.close()
    asyncio.run(main())
    assert reported == [
        ("a", "test_background_work_that_raises_is_reported_once_and_its_thread_goes_on."
              "<locals>.boom", "RecursionError('maximum recursion depth exceeded')")]
    assert ran == ["router-work-0"]


def test_the_router_counts_and_logs_background_work_that_raised():
    import structlog

    from helexa.config.router import LimitsConfig, RouterConfig
    from helexa.router.app import RouterState

    state = RouterState(RouterConfig(limits=LimitsConfig(schema_workers=1)), None)

    async def main() -> None:
        state.work_pool.submit("alice", _refuse)
        await _until(lambda: state.work_pool.background == 0)
    try:
        with structlog.testing.capture_logs() as logs:
            asyncio.run(main())
    finally:
        state.work_pool.close()
    (line,) = [x for x in logs if x["event"] == "router.background_work_failed"]
    assert line["principal"] == "alice" and line["task"] == "_refuse"
    assert line["error"].startswith("ApiError(") and isinstance(line["exc_info"], ApiError)
    assert "helexa_router_work_background_failures_total 1.0" in state.metrics.render().decode()
