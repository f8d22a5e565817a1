"""Pause and resume on real tiny hybrid models (Gated DeltaNet state slots, MTP's held
verification rows, lookahead on and off, tp = 2 over gloo): overlapping pauses give the
tokens of a run with none, and the ledger and state slots come back whole; so do rows
lent by a pause and taken back on resume (max_slots below the requests). One case (MTP
with lookahead, one overlapping schedule, about a second) is in the default run; the rest
is marked slow (~2 minutes on 2 cores), and test_pause.py covers the same engine paths on
the fake runner."""

from __future__ import annotations

import pytest
from support.engine import assert_whole, drive
from support.mtp import SPEC, requests, spec_for

from helexa.neuron.engine import lookahead
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_with_pauses(core, news, schedule, max_steps=3000, before_step=None, waits=None):
    """schedule: step index -> ToEngine paused dict; before_step(i) sees the core first;
    `waits` gets the ids of the updates that say their request waits for a row again."""
    tokens: dict[str, list[int]] = {}
    inbound = m.ToEngine(new=list(news))
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        words = schedule.get(i)
        if words:
            inbound = m.ToEngine(new=inbound.new if inbound else [], paused=words)
        out = core.step(inbound)
        inbound = None
        for u in out.updates:
            assert u.refused_code is None and u.error == "", u
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.waiting_for_row and waits is not None:
                waits.append(u.req_id)
        core.pool.check()
        if not core.has_work and i > max(schedule, default=0):
            return tokens
    raise AssertionError("not idle")


def _unpaused(tiny_checkpoint, monkeypatch, ahead: str, spec: str, max_tokens: int):
    """The tiny hybrid with an MTP head, three requests, the drafter's settings for `spec`,
    and the tokens a run with no pause gives."""
    monkeypatch.setenv(lookahead.ENV, ahead)
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = [m.NewRequest(req_id=n.req_id, prompt_token_ids=n.prompt_token_ids,
                         max_tokens=max_tokens, sampling=n.sampling) for n in requests(3, 4)]
    extra = {} if spec == "none" else dict(speculation="mtp", **SPEC)
    return model_dir, news, extra, drive(EngineCore(spec_for(model_dir)), news,
                                         served=True).tokens


def test_a_paused_hybrid_keeps_its_held_verification_rows(tiny_checkpoint, monkeypatch):
    # r0 and r2 pause (r1 a step later) with MTP's verification rows held in their state
    # slots; resumed, each settles its own rows and goes on as if it never paused
    model_dir, news, extra, plain = _unpaused(tiny_checkpoint, monkeypatch, "1", "mtp", 20)
    core = EngineCore(spec_for(model_dir, **extra))
    held = core.runner.linear_states.layers[0]._held
    sched = {6: {"r0": True, "r2": True}, 7: {"r1": True},
             12: {"r0": False}, 14: {"r2": False, "r1": False}}
    seen: list[set[str]] = []

    def paused_holding(i: int) -> None:
        if i in (7, 12):  # paused, before a step: which still hold their rows
            seen.append({r for r in core.paused
                         if core.pool.state_slot(r) in held})
    got = run_with_pauses(core, news, sched, before_step=paused_holding)
    assert got == plain
    assert seen == [{"r0", "r2"}, {"r0", "r1", "r2"}]
    assert core.status().spec_drafted_tokens > 0
    assert_whole(core, hybrid=True)
    core.close()


@pytest.mark.slow
@pytest.mark.parametrize("ahead", ["0", "1"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_hybrid_pause_resume_identical(tiny_checkpoint, monkeypatch, ahead, spec):
    model_dir, news, extra, plain = _unpaused(tiny_checkpoint, monkeypatch, ahead, spec, 40)
    for at in (4, 5, 6, 7, 9):
        core = EngineCore(spec_for(model_dir, **extra))
        sched = {at: {"r0": True, "r2": True}, at + 1: {"r1": True},
                 at + 6: {"r0": False}, at + 8: {"r2": False, "r1": False}}
        got = run_with_pauses(core, news, sched)
        assert got == plain, at
        assert_whole(core, hybrid=True)
        core.close()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_tp2_hybrid_pause_resume_identical(tiny_checkpoint, monkeypatch, spec):
    import msgspec
    model_dir, news, extra, plain = _unpaused(tiny_checkpoint, monkeypatch, "1", spec, 30)
    core = EngineCore(msgspec.structs.replace(spec_for(model_dir, **extra), tp=2))
    try:
        for at in (5, 8):
            sched = {at: {"r0": True, "r2": True}, at + 1: {"r1": True},
                     at + 6: {"r0": False}, at + 8: {"r2": False, "r1": False}}
            got = run_with_pauses(core, news, sched)
            assert got == plain, at
            assert_whole(core, hybrid=True)
    finally:
        core.close()


@pytest.mark.slow
@pytest.mark.parametrize("ahead", ["0", "1"])
def test_hybrid_pause_with_held_verification_row(tiny_checkpoint, monkeypatch, ahead):
    monkeypatch.setenv(lookahead.ENV, ahead)
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = requests(3, 4)
    news = [m.NewRequest(req_id=n.req_id, prompt_token_ids=n.prompt_token_ids, max_tokens=30,
                         sampling=n.sampling) for n in news]
    plain = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    held_hits = 0
    for at in range(2, 22):
        core = EngineCore(spec_for(model_dir, speculation="mtp", **SPEC))
        tokens: dict[str, list[int]] = {}
        inbound = m.ToEngine(new=news)
        for i in range(2000):
            if i == at:
                inbound = m.ToEngine(paused={"r0": True})
            if i == at + 1:
                slot = core.pool.state_slot("r0")
                if slot >= 0 and slot in core.runner.linear_states.layers[0]._held:
                    held_hits += 1
            if i == at + 5:
                inbound = m.ToEngine(paused={"r0": False})
            for u in core.step(inbound).updates:
                tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            inbound = None
            if not core.has_work:
                break
        assert tokens == plain, at
        assert_whole(core, hybrid=True)
    assert held_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize("ahead", ["0", "1"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_hybrid_rows_lent_and_taken_back_identical(tiny_checkpoint, monkeypatch, ahead, spec):
    """Two rows, three requests: r0's pause lends its row to r2, which had none; r0 resumed
    takes it back (r2, mid-decode, perhaps with a held step or verification row, waits for
    a row again), and every request's tokens are those of a run with no pause."""
    monkeypatch.setenv(lookahead.ENV, ahead)
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = [m.NewRequest(req_id=n.req_id, prompt_token_ids=n.prompt_token_ids,
                         max_tokens=30, sampling=n.sampling) for n in requests(3, 3)]
    extra = {"max_slots": 2, **({} if spec == "none" else dict(speculation="mtp", **SPEC))}
    plain = drive(EngineCore(spec_for(model_dir, max_slots=2)), news, served=True).tokens
    for at in (3, 4, 6):
        core = EngineCore(spec_for(model_dir, **extra))
        waits: list[str] = []
        got = run_with_pauses(core, news, {at: {"r0": True}, at + 10: {"r0": False}},
                              waits=waits)
        assert got == plain, at
        assert waits == ["r2"], at  # r2 had r0's row until r0 took it back
        assert_whole(core, hybrid=True)
        core.close()
