"""A reservation that grows (helexa/neuron/engine/growth.py): a request whose client named no
max_tokens goes on past kv.default_output_tokens while free blocks no queued request needs
are there; one that named max_tokens stops there; every block comes back however it ends."""

from __future__ import annotations

import msgspec
import pytest
import torch
from support.engine import assert_whole, drive
from support.fake_runner import FakeRunner, fake_continuation

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec

VOCAB = 100
GREEDY = m.SamplingParams(temperature=0.0)
PROMPT = [5, 6, 7, 8, 9]


def make_core(*, num_blocks: int = 64, context: int = 64, runner=None, model_dir: str = "",
              **limits) -> EngineCore:
    spec = EngineSpec(model_id="g", model_dir=model_dir, num_blocks=num_blocks, block_size=4,
                      context=context, bytes_per_token=0 if model_dir else 2,
                      prefix_cache=False,
                      limits=m.Limits(**{"anon_max_in_flight": 64, "default_output_tokens": 8,
                                         **limits}))
    if not model_dir and runner is None:
        runner = FakeRunner(VOCAB, num_blocks, 4)
    return EngineCore(spec, runner)


def new(rid: str, prompt: list[int], max_tokens: int | None = None, **kw) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY, **kw)


def expected(prompt: list[int], n: int) -> list[int]:
    return fake_continuation(prompt, n, VOCAB)


def test_without_max_tokens_it_grows_to_the_context_on_an_idle_pool() -> None:
    core = make_core()
    run = drive(core, [new("a", PROMPT)], served=True)
    # 59 tokens: the whole context, past 8 (kv.default_output_tokens) in growths of 8;
    # the fake model reads its KV through the block table, so grown blocks hold it right
    assert run.tokens["a"] == expected(PROMPT, 64 - len(PROMPT))
    assert run.final["a"].finished == m.FinishReason.LENGTH
    assert core.status().kv_growths >= 6
    assert_whole(core)


def test_max_tokens_is_the_clients_exact_ceiling_and_the_knob_restores_the_old_end() -> None:
    core = make_core()
    run = drive(core, [new("a", PROMPT, 8)], served=True)
    assert run.tokens["a"] == expected(PROMPT, 8) and core.status().kv_growths == 0
    assert_whole(core)
    core.step(m.ToEngine(limits=msgspec.structs.replace(core.limits, grow_output=False)))
    run = drive(core, [new("b", PROMPT)], served=True)
    assert run.tokens["b"] == expected(PROMPT, 8)
    assert run.final["b"].finished == m.FinishReason.LENGTH
    assert core.status().kv_growths == 0
    assert_whole(core)


def test_growth_stops_at_the_models_output_limit() -> None:
    spec = EngineSpec(model_id="g", num_blocks=64, block_size=4, context=64, bytes_per_token=2,
                      prefix_cache=False, max_output_tokens=21,
                      limits=m.Limits(default_output_tokens=8))
    core = EngineCore(spec, FakeRunner(VOCAB, 64, 4))
    run = drive(core, [new("a", PROMPT)], served=True)
    assert run.tokens["a"] == expected(PROMPT, 21)
    assert_whole(core)


def test_a_request_queued_for_kv_comes_first_and_the_grower_ends_at_its_budget() -> None:
    # a: 5 + 8 tokens reserve 4 of the 9 blocks; b: 4 + 20 tokens need 6, more than the 5
    # left: b is queued for KV, and a's growth (2 blocks) would leave it 3: a may not grow
    core = make_core(num_blocks=9)
    run = drive(core, [new("a", PROMPT), new("b", [1, 2, 3, 4], 20, principal="q")],
                served=True)
    assert run.tokens["a"] == expected(PROMPT, 8)
    assert run.final["a"].finished == m.FinishReason.LENGTH  # the client sees "length"
    assert run.tokens["b"] == expected([1, 2, 3, 4], 20)
    st = core.status()
    assert (st.kv_growths, st.kv_growths_refused_queued, st.kv_growths_refused_no_room) == \
        (0, 1, 0)
    assert_whole(core)


def test_without_room_in_the_pool_the_grower_ends_at_its_budget() -> None:
    # a (4 blocks) and b (5 + 11 tokens: 4 blocks) fill the pool; nobody is queued
    core = make_core(num_blocks=8)
    run = drive(core, [new("a", PROMPT), new("b", PROMPT, 11, principal="q")], served=True)
    assert len(run.tokens["a"]) == 8 and run.final["a"].finished == m.FinishReason.LENGTH
    st = core.status()
    assert (st.kv_growths, st.kv_growths_refused_no_room) == (0, 1)
    assert_whole(core)


def test_growth_takes_what_is_left_once_the_queue_is_covered() -> None:
    # b (4 + 4 tokens: 2 blocks) waits for an in-flight place, not for KV: a grows to the
    # context (16 blocks), leaving b's 2 (on 17 blocks a would stop one growth short)
    core = make_core(num_blocks=18, max_in_flight=1)
    run = drive(core, [new("a", PROMPT), new("b", [1, 2, 3, 4], 4, principal="q")],
                served=True)
    assert run.tokens["a"] == expected(PROMPT, 59) and run.tokens["b"] == expected([1, 2, 3, 4], 4)
    assert core.status().kv_growths_refused_queued == 0
    assert_whole(core)


def test_a_request_waiting_for_a_row_gets_it_when_the_growers_budget_ends() -> None:
    """max_slots 1, both admitted: b waits for the row a holds. a does not grow while b
    waits: it ends at its budget with "length" and b gets the row then, as without growth,
    rather than at a's context (or, with a deadline, never)."""
    now = [1000.0]
    core = make_core(num_blocks=64, context=128, max_slots=1, max_in_flight=2)
    core.admission.wall_clock = core.admission.clock = lambda: now[0]
    tokens: dict[str, list[int]] = {}
    first_b = None
    inbound = m.ToEngine(new=[new("a", PROMPT), new("b", [1, 2, 3, 4], 8, principal="q",
                                                      deadline_unix=1050.0)])
    finals: dict[str, m.RequestUpdate] = {}
    for i in range(200):
        for u in core.step(inbound).updates:
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finished is not None:
                finals[u.req_id] = u
        inbound, now[0] = None, now[0] + 1.0
        if first_b is None and tokens.get("b"):
            first_b = i
        if not core.has_work:
            break
    assert tokens["a"] == expected(PROMPT, 8) and first_b == 8
    assert finals["a"].finished == m.FinishReason.LENGTH
    assert tokens["b"] == expected([1, 2, 3, 4], 8)
    assert finals["b"].finished == m.FinishReason.LENGTH
    st = core.status()
    assert (st.kv_growths, st.kv_growths_refused_waiting) == (0, 1)
    assert_whole(core)
    run = drive(core, [new("c", PROMPT)], served=True)  # nobody waits: it grows again
    assert len(run.tokens["c"]) == 128 - len(PROMPT) and core.status().kv_growths > 0
    assert_whole(core)


def test_a_request_that_lent_its_row_takes_it_back_and_the_borrower_is_not_starved() -> None:
    """max_slots 1: a paused lends its row to b; a resumed takes it back (b waits for a row
    again, mid-reply); a then ends at its budget rather than growing, and b finishes its
    whole reply before its deadline."""
    now = [1000.0]
    core = make_core(num_blocks=64, context=128, max_slots=1, max_in_flight=2)
    core.admission.wall_clock = core.admission.clock = lambda: now[0]
    tokens: dict[str, list[int]] = {}
    finals: dict[str, m.RequestUpdate] = {}

    def go(inbound: m.ToEngine | None = None) -> None:
        for u in core.step(inbound).updates:
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finished is not None:
                finals[u.req_id] = u
        now[0] += 1.0

    go(m.ToEngine(new=[new("a", [1, 2, 3]), new("b", [4, 5], 30, principal="q",
                                                deadline_unix=1080.0)]))
    go()
    go(m.ToEngine(paused={"a": True}))
    for _ in range(4):
        go()
    assert tokens["b"]
    go(m.ToEngine(paused={"a": False}))
    while core.has_work:
        go()
    assert tokens["a"] == expected([1, 2, 3], 8)
    assert finals["a"].finished == m.FinishReason.LENGTH
    assert tokens["b"] == expected([4, 5], 30)
    assert finals["b"].finished == m.FinishReason.LENGTH
    assert core.status().kv_growths_refused_waiting >= 1
    assert_whole(core)


class Failing(FakeRunner):
    """Raises on the given step (counted from 1)."""

    def __init__(self, fail_on: int) -> None:
        super().__init__(VOCAB, 64, 4)
        self.fail_on, self.calls = fail_on, 0

    def execute(self, seqs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected failure")
        return super().execute(seqs)


@pytest.mark.parametrize("end", ["client_gone", "deadline", "error", "shutdown"])
def test_every_block_comes_back_when_a_grown_request_ends_mid_growth(end: str) -> None:
    now = [1000.0]
    core = make_core(runner=Failing(fail_on=20 if end == "error" else 0))
    core.admission.wall_clock = core.admission.clock = lambda: now[0]
    holder = new("h", [1, 2, 3], 40, principal="q")  # in flight throughout, its own blocks
    core.step(m.ToEngine(new=[holder]))
    reserved_before = core.pool.num_reserved_blocks + core.pool.num_used_blocks
    core.step(m.ToEngine(new=[new("a", PROMPT, deadline_unix=1000.5)]))
    a = core.requests["a"]
    first = a.num_reserved_blocks
    ended = None
    for _ in range(19):
        out = core.step()
        ended = next((u for u in out.updates if u.req_id == "a" and u.finished), None)
        if ended is not None:
            break
    if end != "error":
        assert ended is None and a.num_reserved_blocks > first  # it grew, and runs
        inbound = {"client_gone": m.ToEngine(aborts=[m.Abort(req_id="a")]),
                   "shutdown": m.ToEngine(shutdown=True)}.get(end, m.ToEngine())
        now[0] = 1001.0
        out = core.step(inbound)
        ended = next(u for u in out.updates if u.req_id == "a" and u.finished)
    assert ended is not None and a.num_reserved_blocks > first
    assert ended.finished == (m.FinishReason.ERROR if end == "error" else m.FinishReason.ABORT)
    assert not core.pool.holds("a")
    if end != "shutdown" and core.pool.holds("h"):
        # what the holder holds is all that is set aside or written: a's growths are back
        held = core.pool.num_reserved_blocks + core.pool.num_used_blocks
        assert held == reserved_before
    drive(core)
    assert_whole(core)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_tiny_model_writes_past_the_default_as_with_the_budget_named(arch: str,
                                                                      tiny_checkpoint) -> None:
    """Real ModelRunner, no eos among the stop ids (as ignore_eos): the grown request's
    tokens are those of one that named the whole budget up front; a hybrid's state slot is
    the request's throughout, and comes back with its grown blocks."""
    torch.set_num_threads(1)
    model = str(tiny_checkpoint(arch))
    grown = make_core(model_dir=model, context=48)
    run = drive(grown, [new("a", PROMPT)], served=True)
    named = make_core(model_dir=model, context=48)
    ref = drive(named, [new("a", PROMPT, 48 - len(PROMPT))], served=True)
    assert len(run.tokens["a"]) == 48 - len(PROMPT) > 8
    assert run.tokens["a"] == ref.tokens["a"]
    assert grown.status().kv_growths >= 4
    assert_whole(grown, hybrid=arch == "qwen3_5")


def test_nothing_grows_while_the_model_admits_nothing() -> None:
    """A drain or a profile switch stops admitting and waits for in-flight work to end:
    a reply without max_tokens ends at its budget then (counted), rather than growing
    toward the context past the wait; admitting again, replies grow again."""
    core = make_core(num_blocks=64, context=128)
    tokens: dict[str, list[int]] = {}
    finals: dict[str, m.RequestUpdate] = {}

    def go(inbound: m.ToEngine) -> None:
        for u in core.step(inbound).updates:
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finished is not None:
                finals[u.req_id] = u

    go(m.ToEngine(new=[new("a", PROMPT)]))
    steps = 0
    while core.admission.num_in_flight and steps < 200:
        go(m.ToEngine(stop_admitting=True))  # each message carries the flag (client.py)
        steps += 1
    assert tokens["a"] == expected(PROMPT, 8) and steps <= 10
    assert finals["a"].finished == m.FinishReason.LENGTH
    st = core.status()
    assert (st.kv_growths, st.kv_growths_refused_not_admitting) == (0, 1)
    assert_whole(core)
    run = drive(core, [new("b", PROMPT)], served=True)  # admitting again: it grows
    assert len(run.tokens["b"]) == 128 - len(PROMPT)
    assert_whole(core)
