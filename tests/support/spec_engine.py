"""Driving an EngineCore to idle and checking what speculation must leave behind, shared
by the speculation tests (dense, hybrid, MTP)."""

from __future__ import annotations

from collections.abc import Callable

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore


def drive(core: EngineCore, news: list[m.NewRequest]) -> dict[str, list[int]]:
    """Every request's tokens, stepping until the engine is idle (pool checked each step)."""
    return drive_steps(core, news)[0]


def drive_steps(core: EngineCore, news: list[m.NewRequest]
                ) -> tuple[dict[str, list[int]], int]:
    """Every request's tokens, and the steps it took."""
    tokens: dict[str, list[int]] = {}
    inbound: m.ToEngine | None = m.ToEngine(new=news)
    for steps in range(1, 5000):
        for u in core.step(inbound).updates:
            assert u.refused_code is None and u.error == "", u
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
        inbound = None
        core.pool.check()
        if not core.has_work:
            return tokens, steps
    raise AssertionError("engine did not go idle")


def assert_whole(core: EngineCore) -> None:
    """Every block, byte of reservation and state slot back; no request left behind."""
    core.pool.check()
    led = core.pool.ledger()
    assert led.free_bytes == led.total_bytes and led.reserved_bytes == led.used_bytes == 0
    assert led.state_free_bytes == led.state_total_bytes
    assert core.pool.num_free_state_slots == core.pool.num_state_slots
    assert not core.requests and not core.running and not core.waiting


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
