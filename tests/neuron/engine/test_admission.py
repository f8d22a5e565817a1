"""Admission: exactly who is admitted, in what order, when; refusals and their codes."""

from __future__ import annotations

import msgspec
import pytest

from helexa.neuron.engine import messages
from helexa.neuron.engine.admission import Admission, DrainMeter
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.request import Request, RequestStatus

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 64, **limits) -> tuple[Admission, BlockPool, Clock]:
    pool = BlockPool(num_blocks, BS, BS * 2)
    clock = Clock()
    limits = {"max_in_flight": 100, "anon_max_in_flight": 100, **limits}
    lim = messages.Limits(**limits)
    return Admission(pool, lim, clock=clock, wall_clock=clock), pool, clock


def r(rid: str, principal: str = "p", blocks: int = 1, deadline: float = 0.0) -> Request:
    # prompt of 2 tokens + output budget filling `blocks` blocks
    return Request(req_id=rid, prompt_token_ids=[1, 2], output_budget=blocks * BS - 2,
                   principal=principal, deadline_unix=deadline)


def ids(reqs) -> list[str]:
    return [x.req_id for x in reqs]


def test_round_robin_over_principals_fifo_within_one():
    adm, _, _ = make()
    for rid, who in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("b2", "B"), ("c1", "C")]:
        assert adm.submit(r(rid, who)) is None
    assert ids(adm.admit()) == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert adm.num_queued == 0 and adm.num_in_flight == 6


def test_flooding_principal_gets_one_turn_per_round():
    adm, _, _ = make(max_in_flight=2)
    for i in range(5):
        adm.submit(r(f"f{i}", "flood"))
    adm.submit(r("q1", "quiet"))
    assert ids(adm.admit()) == ["f0", "q1"]
    adm.submit(r("q2", "quiet"))
    adm.remove(adm.in_flight["f0"])
    adm.remove(adm.in_flight["q1"])
    assert ids(adm.admit()) == ["f1", "q2"]


def test_no_bypass_big_head_blocks_smaller_followers():
    adm, pool, _ = make(num_blocks=10)
    assert adm.submit(r("x", "X", blocks=5)) is None
    assert ids(adm.admit()) == ["x"]
    assert pool.num_free_blocks == 5
    adm.submit(r("big", "B", blocks=8))
    adm.submit(r("small", "C", blocks=1))
    assert adm.admit() == []  # small would fit, but big is first in turn
    assert ids(adm.queued()) == ["big", "small"]
    x = adm.in_flight["x"]
    adm.remove(x)
    pool.release("x")
    assert ids(adm.admit()) == ["big", "small"]
    assert pool.num_reserved_blocks == 9
    big = next(iter(adm.in_flight.values()))
    assert big.status == RequestStatus.IN_FLIGHT and big.num_reserved_blocks == 8


def test_max_in_flight_and_runtime_limit_change_without_touching_the_pool():
    adm, pool, _ = make(max_in_flight=2)
    for i in range(4):
        adm.submit(r(f"r{i}"))
    assert ids(adm.admit()) == ["r0", "r1"]
    assert adm.admit() == []
    ledger = pool.ledger()
    adm.limits = msgspec.structs.replace(adm.limits, max_in_flight=3)
    assert pool.ledger() == ledger
    assert ids(adm.admit()) == ["r2"]


def test_per_principal_cap_is_refused_at_once_counting_in_flight():
    adm, _, _ = make(max_per_principal=2)
    assert adm.submit(r("a1", "A")) is None
    adm.admit()
    assert adm.submit(r("a2", "A")) is None
    refusal = adm.submit(r("a3", "A"))
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert refusal.retry_after_ms > 0
    assert adm.submit(r("b1", "B")) is None  # others are not affected
    adm.remove(adm.in_flight["a1"])
    assert adm.submit(r("a4", "A")) is None


def test_queue_depth_refuses_overloaded():
    adm, _, _ = make(max_queue_depth=2, max_in_flight=1)
    adm.submit(r("r0"))
    adm.admit()
    assert adm.submit(r("r1")) is None
    assert adm.submit(r("r2", "other")) is None
    refusal = adm.submit(r("r3", "third"))
    assert refusal is not None and refusal.code == "overloaded"
    assert adm.num_queued == 2


def test_anonymous_capped_and_never_blocking_identified():
    adm, _, _ = make(anon_max_in_flight=1)
    adm.submit(r("n1", ""))
    adm.submit(r("n2", ""))
    adm.submit(r("n3", ""))
    adm.submit(r("b1", "B"))
    adm.submit(r("b2", "B"))
    assert ids(adm.admit()) == ["n1", "b1", "b2"]
    adm.remove(adm.in_flight["n1"])
    assert ids(adm.admit()) == ["n2"]


def test_a_principal_at_its_in_flight_cap_is_skipped_never_blocking_others():
    adm, _, _ = make(max_in_flight=10, max_in_flight_per_principal=2, anon_max_in_flight=10)
    for i in range(4):  # A came first, with more than its cap
        adm.submit(r(f"a{i}", "A"))
    for who in ("B", ""):
        for i in range(3):
            adm.submit(r(f"{who.lower() or 'n'}{i}", who))
    # A, B and the anonymous callers (one principal) get 2 each; 4 places stay free for
    # whoever comes next
    assert ids(adm.admit()) == ["a0", "b0", "n0", "a1", "b1", "n1"]
    adm.submit(r("c0", "C"))
    assert ids(adm.admit()) == ["c0"]
    adm.remove(adm.in_flight["a0"])
    adm.remove(adm.in_flight["b0"])
    assert ids(adm.admit()) == ["a2", "b2"]  # each its own place back, never another's
    assert ids(adm.queued()) == ["n2", "a3"]
    # raised on reload (None: no cap but max_in_flight, as before), the queue moves on
    adm.limits = msgspec.structs.replace(adm.limits, max_in_flight=12,
                                         max_in_flight_per_principal=None)
    assert ids(adm.admit()) == ["n2", "a3"]


def test_without_a_per_principal_cap_one_key_may_hold_every_place():
    adm, _, _ = make(max_in_flight=3)
    for i in range(3):
        adm.submit(r(f"a{i}", "A"))
    adm.admit()
    adm.submit(r("b0", "B"))
    assert adm.admit() == [] and ids(adm.queued()) == ["b0"]


def test_a_timed_out_request_is_told_what_it_waited_for():
    def timed_out(adm, clock) -> str:
        clock.t += 6.0
        [(_, refusal)] = adm.expire()[0]
        assert refusal.code == "overloaded"
        return refusal.message
    # every in-flight place held (by one key's long requests): no KV was lacking
    adm, pool, clock = make(num_blocks=64, max_in_flight=2, kv_max_wait_secs=5.0)
    for i in range(2):
        adm.submit(r(f"a{i}", "A"))
    adm.admit()
    adm.submit(r("b", "B"))
    assert adm.admit() == []
    assert timed_out(adm, clock) == ("waited 6.0 s for an in-flight place (max_in_flight 2, "
                                      "all held) (kv_max_wait_secs 5)")
    # its own principal's cap
    adm, pool, clock = make(max_in_flight_per_principal=1, kv_max_wait_secs=5.0)
    adm.submit(r("a0", "A"))
    adm.submit(r("a1", "A"))
    assert ids(adm.admit()) == ["a0"]
    assert timed_out(adm, clock) == (
        "waited 6.0 s for an in-flight place (max_in_flight_per_principal 1, all held by its "
        "principal) (kv_max_wait_secs 5)")
    adm, pool, clock = make(anon_max_in_flight=1, kv_max_wait_secs=5.0)
    adm.submit(r("n0", ""))
    adm.submit(r("n1", ""))
    adm.admit()
    assert "(anon_max_in_flight 1, all held by anonymous callers)" in timed_out(adm, clock)
    # KV: its own reservation does not fit; or it would, but waits behind one that does
    # not (no bypass)
    adm, pool, clock = make(num_blocks=10, kv_max_wait_secs=5.0)
    adm.submit(r("h", "H", blocks=6))
    adm.admit()
    adm.submit(r("big", "B", blocks=5))
    adm.submit(r("small", "C", blocks=1))
    assert adm.admit() == []
    clock.t += 6.0
    refused = {req.req_id: refusal.message for req, refusal in adm.expire()[0]}
    assert refused == {
        "big": "waited 6.0 s for KV (5 blocks needed, 4 free) (kv_max_wait_secs 5)",
        "small": "waited 6.0 s for KV (no bypass: the request before it in turn needs 5 "
                 "blocks, 4 free; this one needs 1) (kv_max_wait_secs 5)"}


def test_kv_wait_times_out_with_retry_after_from_the_drain_rate():
    adm, pool, clock = make(num_blocks=10, kv_max_wait_secs=5.0)
    for i in range(5):  # five requests of 2 blocks fill the pool
        adm.submit(r(f"h{i}", f"P{i}", blocks=2))
    adm.admit()
    adm.submit(r("late", "L", blocks=6))
    assert adm.admit() == []
    # two of the holders finish, one per second: 4 blocks in 2 s = 2 blocks/s
    adm.observe_pool()
    for i in range(2):
        clock.t += 1.0
        held = adm.in_flight[f"h{i}"]
        adm.remove(held)
        pool.release(held.req_id)
        adm.observe_pool()
    assert adm.drain.rate() == pytest.approx(2.0)
    assert ids(adm.admit()) == []  # 4 blocks free, 6 wanted
    clock.t += 4.0  # 6 s in the queue
    timed_out, late = adm.expire()
    assert late == []
    [(req, refusal)] = timed_out
    assert req.req_id == "late" and refusal.code == "overloaded"
    # 6 blocks wanted, 4 free: 2 more to drain at 2 blocks/s
    assert refusal.retry_after_ms == 1000


def test_retry_after_scales_with_the_deficit():
    adm, pool, clock = make(num_blocks=10)
    adm.submit(r("h", "H", blocks=10))
    adm.admit()
    adm.observe_pool()
    assert adm.retry_after_ms(4) == int(adm.limits.kv_max_wait_secs * 1000)  # nothing drained yet
    pool.reserve("tmp", 0)
    clock.t += 2.0
    pool.num_released_total += 10  # as if 10 blocks came back over 2 s
    adm.observe_pool()
    assert adm.retry_after_ms(4) == 800
    assert adm.retry_after_ms(20) == 4000


def test_deadlines_of_queued_and_in_flight_requests():
    adm, _, clock = make(max_in_flight=1)
    adm.submit(r("run", deadline=clock.t + 1))
    adm.admit()
    adm.submit(r("wait", "Q", deadline=clock.t + 2))
    adm.submit(r("free", "Z"))
    assert adm.expire() == ([], [])
    clock.t += 1.5
    assert ids(adm.expire()[1]) == ["run"]
    clock.t += 1.0
    assert sorted(ids(adm.expire()[1])) == ["run", "wait"]


def test_a_drain_refuses_newcomers_and_holds_the_queue():
    adm, _, _ = make()
    adm.submit(r("q"))
    adm.admitting, adm.refusing = False, True
    refusal = adm.submit(r("new"))
    assert refusal is not None and refusal.code == "shutting_down"
    assert adm.admit() == []
    adm.admitting, adm.refusing = True, False
    assert ids(adm.admit()) == ["q"]


def test_a_stopped_admission_without_a_drain_queues_newcomers_until_it_resumes():
    """A profile switch stops admitting while its in-flight work ends: what comes then
    waits in the queue, in turn, and is admitted once admission resumes."""
    adm, _, _ = make()
    adm.submit(r("q"))
    adm.admitting = False
    assert adm.submit(r("new", "Q")) is None
    assert adm.admit() == [] and adm.num_queued == 2
    adm.admitting = True
    assert ids(adm.admit()) == ["q", "new"]


def test_a_switch_holding_the_queue_is_no_wait_for_kv_and_a_deadline_in_it_names_it():
    """Held by a profile switch (`hold`), queued requests are not timed out by
    kv_max_wait_secs, however long the switch takes; their wait for KV counts again from
    its end, and one whose deadline passes while held is told it waited for the switch."""
    adm, pool, clock = make(num_blocks=10, kv_max_wait_secs=5.0)
    adm.submit(r("h", "H", blocks=8))
    adm.admit()
    adm.submit(r("w", "W", blocks=5))  # waits for KV from t 0
    assert adm.admit() == []
    clock.t += 2.0
    adm.hold(False, False)  # the switch stops admitting, t 2
    adm.submit(r("d", "D", deadline=clock.t + 3.0))
    clock.t += 28.0
    [(req, refusal)] = adm.expire()[0]  # t 30: "w" is not timed out, 30 s queued
    assert req.req_id == "d" and refusal.code == "service_unavailable"
    assert refusal.message == ("the model was switching profile: the request waited 28.0 s "
                               "in its queue for the switch to end and its deadline passed; "
                               "retry shortly")
    adm.remove(req)
    adm.hold(True, False)  # the switch ends, t 30; "w" still does not fit
    assert adm.admit() == []
    clock.t += 2.9
    assert adm.expire() == ([], [])  # 2 s before the hold + 2.9 after it
    clock.t += 0.2
    [(req, refusal)] = adm.expire()[0]
    assert req.req_id == "w" and refusal.code == "overloaded"
    assert refusal.message == ("waited 5.1 s for KV (5 blocks needed, 2 free) "
                               "(kv_max_wait_secs 5), after 28.0 s held by a profile switch")


def test_remove_from_queue_and_unknown():
    adm, _, _ = make()
    a, b = r("a"), r("b")
    adm.submit(a)
    adm.submit(b)
    adm.remove(a)
    adm.remove(r("stranger"))
    assert ids(adm.queued()) == ["b"] and adm.num_queued == 1
    assert ids(adm.admit()) == ["b"]


def test_drain_meter_window():
    m = DrainMeter(window_secs=10.0, sample_secs=0.0)
    assert m.rate() is None
    m.observe(0.0, 0)
    m.observe(5.0, 50)
    assert m.rate() == pytest.approx(10.0)
    m.observe(30.0, 60)  # old samples leave the window
    assert m.rate() == pytest.approx(10 / 25)
    m.observe(60.0, 60)  # nothing in the window: the rate since the start
    assert m.rate() == pytest.approx(1.0)
