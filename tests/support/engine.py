"""Driving an EngineCore in-process and checking what it leaves behind: the one driver and
the one ledger check of every engine test (dense, hybrid, speculation, MTP) and bench.

`drive(core, first)` steps until the engine is idle, checking the pool after every step
(and waiting for grammars that compile where nothing else runs: `grammars_compiled`),
and returns what each request got; `assert_whole(core)` says every block, reservation and
state slot came back. `with_drafter` pins a test's drafter; `truth_from` reads the
target's greedy continuation off a run without speculation (the oracle drafters' truth).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import NamedTuple

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.speculative.drafters import Drafter


class Run(NamedTuple):
    """What a drive saw, per request id."""

    tokens: dict[str, list[int]]  # every new token, in order
    final: dict[str, m.RequestUpdate]  # the update that finished or refused it
    admitted: dict[str, m.RequestUpdate]  # the update that admitted it
    steps: int  # steps until idle


def drive(core: EngineCore, first: m.ToEngine | Sequence[m.NewRequest] | None = None, *,
          served: bool = False, max_steps: int = 10_000,
          on_update: Callable[[m.RequestUpdate], None] | None = None) -> Run:
    """Step `core` until it is idle, `first` the first step's inbound (requests alone:
    they are the message), checking the pool after each step. `served`: assert that no
    request is refused or fails; `on_update` sees every update."""
    inbound = m.ToEngine(new=list(first)) if isinstance(first, Sequence) else first
    run = Run({}, {}, {}, 0)
    for steps in range(1, max_steps + 1):
        for u in core.step(inbound).updates:
            if served:
                assert u.refused_code is None and u.error == "", u
            if on_update is not None:
                on_update(u)
            run.tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.admitted:
                run.admitted[u.req_id] = u
            if u.finished is not None or u.refused_code is not None:
                run.final[u.req_id] = u
        inbound = None
        core.pool.check()
        if not core.has_work:
            return run._replace(steps=steps)
        if not (core.running or core.waiting or core.paused):
            grammars_compiled(core, FIRST_COMPLETED, 0.01)  # as the engine process polls
    raise AssertionError("engine did not go idle")


def grammars_compiled(core: EngineCore, return_when: str = "ALL_COMPLETED",
                      timeout: float = 60.0) -> None:
    """Wait (at most `timeout`) until the grammars the engine compiles (engine/grammar.py)
    have compiled: a step then gives their requests their matchers. A loop of steps with
    nothing else to do would otherwise spin through its bound while a compile runs."""
    futures = [r.compiling for r in core.grammars.compiling.values()]
    if futures:
        wait(futures, timeout, return_when)


def assert_whole(core: EngineCore, *, hybrid: bool = False) -> None:
    """Every block, byte of reservation and state slot back; no request left behind.
    `hybrid`: the pool holds linear-attention state slots, too."""
    core.pool.check()
    led = core.pool.ledger()
    assert led.free_bytes == led.total_bytes and led.reserved_bytes == led.used_bytes == 0
    assert led.state_free_bytes == led.state_total_bytes
    assert core.pool.num_free_state_slots == core.pool.num_state_slots
    if hybrid:
        assert led.state_total_bytes > 0
    st = core.status()
    assert (st.in_flight, st.queued, st.running) == (0, 0, 0)
    assert not core.requests and not core.running and not core.waiting


def with_drafter(core: EngineCore, drafter: Drafter | None) -> EngineCore:
    """`core` drafting with `drafter` whatever its limits' speculation names."""
    core.speculator.pin(drafter)
    return core


def truth_from(reference: dict[str, list[int]], prompts: dict[str, list[int]]
               ) -> Callable[[list[int], int], list[int]]:
    """The target's greedy continuation of a context, read off a run without speculation."""
    def truth(context: list[int], k: int) -> list[int]:
        for rid, prompt in prompts.items():
            if context[:len(prompt)] == prompt:
                done = len(context) - len(prompt)
                if reference[rid][:done] == context[len(prompt):]:
                    return reference[rid][done:done + k]
        return []
    return truth


def storm(core: EngineCore, news: Sequence[m.NewRequest], abandon: set[str]) -> int:
    """Every request of `news` at once, those in `abandon` aborted once they stream,
    stepping until idle; asserts after every step that nothing else is refused or fails,
    the pool's invariants hold and its ledger adds up. Returns the prefix-cache hits."""
    inbound: m.ToEngine | None = m.ToEngine(new=list(news))
    hits = 0
    for _ in range(20_000):
        out = core.step(inbound)
        inbound = m.ToEngine()
        for u in out.updates:
            assert u.refused_code is None and (u.error == "" or u.req_id in abandon), u
            hits += bool(u.admitted and u.cached_tokens)
            if u.req_id in abandon and u.new_token_ids and u.finished is None:
                inbound.aborts.append(m.Abort(req_id=u.req_id))
        core.pool.check()
        led = core.pool.ledger()
        assert led.free_bytes + led.reserved_bytes + led.used_bytes == led.total_bytes
        if not core.has_work and not inbound.aborts:
            return hits
    raise AssertionError("engine did not go idle")
