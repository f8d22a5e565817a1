"""EngineCore on the fake runner: tokens, stops, aborts, failures, refusals, prefix cache,
and a whole ledger after any of it."""

from __future__ import annotations

import random

import msgspec
import pytest
from support.engine import assert_whole, drive
from support.fake_runner import FakeRunner, fake_continuation

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec

VOCAB = 100
GREEDY = m.SamplingParams(temperature=0.0)


def make_core(*, num_blocks: int = 64, block_size: int = 4, context: int = 256,
              prefix_cache: bool = False, runner=None, **limits) -> EngineCore:
    spec = EngineSpec(model_id="fake", num_blocks=num_blocks, block_size=block_size,
                      context=context, bytes_per_token=2, prefix_cache=prefix_cache,
                      limits=m.Limits(**{"anon_max_in_flight": 64, **limits}))
    return EngineCore(spec, runner if runner is not None
                      else FakeRunner(VOCAB, num_blocks, block_size))


def new(rid: str, prompt: list[int], max_tokens: int | None = 8, **kw) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY, **kw)


def expected(prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    return fake_continuation(prompt, n, VOCAB, stop)


def test_single_request_greedy_tokens_and_length_finish():
    core = make_core()
    prompt = [5, 6, 7, 8, 9, 10, 11]
    tokens, final, admitted, _ = drive(core, m.ToEngine(new=[new("a", prompt, 12)]))
    assert tokens["a"] == expected(prompt, 12)
    assert final["a"].finished == m.FinishReason.LENGTH
    assert admitted["a"].prompt_tokens == 7 and admitted["a"].cached_tokens == 0
    assert_whole(core)


def test_stop_token_ends_with_stop_and_is_reported():
    core = make_core()
    prompt = [1, 2, 3]
    want = expected(prompt, 20)
    stop = want[4]
    tokens, final, _, _ = drive(core, m.ToEngine(new=[new("a", prompt, 20, stop_token_ids=[stop])]))
    assert tokens["a"] == want[:5]
    assert final["a"].finished == m.FinishReason.STOP
    assert_whole(core)


def test_output_budget_defaults_to_context_left():
    core = make_core(context=24, default_output_tokens=1000)
    tokens, final, _, _ = drive(core, m.ToEngine(new=[new("a", [1] * 20, None)]))
    assert len(tokens["a"]) == 4 and final["a"].finished == m.FinishReason.LENGTH
    tokens, final, _, _ = drive(core, m.ToEngine(new=[new("b", [1] * 20, 5), new("c", [1] * 24, None),
                                                   new("d", [], 3), new("e", [1], -1),
                                                   new("f", [1] * 20, 0)]))
    assert {r: u.refused_code for r, u in final.items()} == {
        "b": "context_length_exceeded", "c": "context_length_exceeded",
        "d": "invalid_request_error", "e": "invalid_request_error", "f": None}
    # max_tokens 0: the prompt alone (an echo's logprobs), nothing generated
    assert tokens["f"] == [] and final["f"].finished == m.FinishReason.LENGTH
    assert_whole(core)


def test_concurrent_chunked_requests_match_single_runs():
    prompts = [[(7 * i + j) % VOCAB for j in range(3 + 9 * i)] for i in range(8)]
    solo = []
    for i, p in enumerate(prompts):
        tokens = drive(make_core(), m.ToEngine(new=[new(f"s{i}", p, 10 + i)])).tokens
        solo.append(tokens[f"s{i}"])
        assert solo[-1] == expected(p, 10 + i)
    core = make_core(max_slots=8, max_batched_tokens=24, prefill_chunk_tokens=5)
    tokens, final, _, _ = drive(core, m.ToEngine(new=[new(f"c{i}", p, 10 + i)
                                                   for i, p in enumerate(prompts)]))
    assert [tokens[f"c{i}"] for i in range(8)] == solo
    assert all(u.finished == m.FinishReason.LENGTH for u in final.values())
    assert_whole(core)


def test_abort_wherever_the_request_is():
    core = make_core(num_blocks=12, max_slots=1, max_in_flight=2)
    # r0 running, r1 in flight (waits for the one slot), r2 queued (in-flight cap)
    core.step(m.ToEngine(new=[new(f"r{i}", [1, 2, 3, 4], 8) for i in range(3)]))
    assert [r.status.name for r in core.requests.values()] == ["RUNNING", "IN_FLIGHT", "QUEUED"]
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id=f"r{i}", reason="client_gone")
                                       for i in range(3)] + [m.Abort(req_id="nobody")]))
    ends = {u.req_id: (u.finished, u.error) for u in out.updates if u.finished}
    assert ends == {f"r{i}": (m.FinishReason.ABORT, "client_gone") for i in range(3)}
    assert_whole(core)


def test_new_and_abort_in_one_message():
    core = make_core()
    out = core.step(m.ToEngine(new=[new("a", [1, 2], 4)], aborts=[m.Abort(req_id="a")]))
    assert [(u.req_id, u.finished) for u in out.updates] == [("a", m.FinishReason.ABORT)]
    assert_whole(core)


class FlakyRunner(FakeRunner):
    def __init__(self, fail_on: set[int], **kw) -> None:
        super().__init__(VOCAB, 64, 4, **kw)
        self.fail_on = fail_on
        self.calls = 0

    def execute(self, seqs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected failure")
        return super().execute(seqs)


def test_failed_step_fails_its_requests_and_the_engine_goes_on():
    core = make_core(runner=FlakyRunner({2}), max_slots=2)
    out = core.step(m.ToEngine(new=[new("a", [1, 2, 3], 5), new("b", [4, 5], 5),
                                     new("c", [6, 7], 5)]))
    assert {u.req_id for u in out.updates if u.new_token_ids} == {"a", "b"}
    out = core.step()  # the runner raises: a and b fail, their blocks return
    failed = {u.req_id: u for u in out.updates if u.finished == m.FinishReason.ERROR}
    assert set(failed) == {"a", "b"} and "injected failure" in failed["a"].error
    assert core.num_failed_steps == 1
    tokens, final, _, _ = drive(core)
    assert tokens["c"] == expected([6, 7], 5) and final["c"].finished == m.FinishReason.LENGTH
    assert_whole(core)


def test_refusals_reach_the_update():
    core = make_core(max_in_flight=1, max_queue_depth=1, max_per_principal=5)
    out = core.step(m.ToEngine(new=[new("a", [1, 2], 8, principal="x"),
                                     new("b", [1, 2], 8, principal="y"),
                                     new("c", [1, 2], 8, principal="z")]))
    refused = {u.req_id: u for u in out.updates if u.refused_code}
    assert list(refused) == ["c"] and refused["c"].refused_code == "overloaded"
    assert refused["c"].retry_after_ms > 0 and refused["c"].finished is None
    out = core.step(m.ToEngine(new=[new("a", [3], 2)]))
    assert [u.refused_code for u in out.updates if u.req_id == "a"] == ["invalid_request_error"]
    drive(core)
    assert_whole(core)


def test_deadline_aborts_a_running_request():
    now = [1000.0]
    core = make_core()
    core.admission.wall_clock = core.admission.clock = lambda: now[0]
    core.step(m.ToEngine(new=[new("a", [1, 2], 50, deadline_unix=1001.0)]))
    now[0] = 1002.0
    out = core.step()
    assert [(u.finished, u.error) for u in out.updates] == [(m.FinishReason.ABORT, "deadline")]
    assert_whole(core)


def test_set_limits_and_stop_admitting_through_messages():
    core = make_core(max_in_flight=1)
    core.step(m.ToEngine(new=[new("a", [1], 30), new("b", [2], 30, principal="q")]))
    assert core.status().in_flight == 1 and core.status().queued == 1
    ledger = core.pool.ledger()
    core.step(m.ToEngine(limits=msgspec.structs.replace(core.limits, max_in_flight=4)))
    assert core.status().in_flight == 2 and core.pool.num_blocks * 8 == ledger.total_bytes
    # a switch's stop holds a newcomer queued; a drain's refuses the queue, and newcomers
    # for as long as admission stays stopped
    out = core.step(m.ToEngine(new=[new("c", [3], 4)], stop_admitting=True))
    assert not any(u.refused_code for u in out.updates) and core.status().queued == 1
    assert core.status().admitting is False
    out = core.step(m.ToEngine(stop_admitting=True, refuse_queued=True, refuse_new=True))
    assert [u.refused_code for u in out.updates if u.req_id == "c"] == ["shutting_down"]
    out = core.step(m.ToEngine(new=[new("d", [3], 4)], stop_admitting=True, refuse_new=True))
    assert [u.refused_code for u in out.updates if u.req_id == "d"] == ["shutting_down"]
    # the drain over and a switch's stop in the same message (the daemon's words since the
    # last step, merged): the newcomer is held, not refused
    out = core.step(m.ToEngine(new=[new("e", [3], 4)], stop_admitting=True))
    assert not any(u.refused_code for u in out.updates) and core.status().queued == 1
    out = core.step(m.ToEngine(shutdown=True))
    assert {u.req_id: u.error for u in out.updates if u.finished} == {"a": "shutdown", "b": "shutdown",
                                                                      "e": "shutdown"}
    assert_whole(core)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_ledger_whole_after_a_storm(prefix_cache: bool):
    rng = random.Random(1)
    runner = FlakyRunner({rng.randrange(400) for _ in range(25)})
    core = make_core(num_blocks=40, runner=runner, prefix_cache=prefix_cache, max_in_flight=6,
                     max_slots=4, max_batched_tokens=16, prefill_chunk_tokens=6,
                     max_queue_depth=10, max_per_principal=6, default_output_tokens=6)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    live: list[str] = []
    outcomes: dict[str, str] = {}
    for i in range(400):
        inbound = m.ToEngine()
        if rng.random() < 0.3:
            prompt = (shared[: rng.randrange(13)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))])
            max_tokens = rng.randrange(1, 30)  # every 4th names none: it grows (growth.py)
            inbound.new = [new(f"r{i}", prompt, None if i % 4 == 0 else max_tokens,
                               principal=rng.choice("abc"))]
            live.append(f"r{i}")
        if live and rng.random() < 0.15:
            inbound.aborts = [m.Abort(req_id=rng.choice(live))]
        out = core.step(inbound)
        for u in out.updates:
            if u.finished is not None:
                outcomes[u.req_id] = u.finished.name
            elif u.refused_code:
                outcomes[u.req_id] = u.refused_code
        core.pool.check()
        led = core.pool.ledger()
        assert led.free_bytes + led.reserved_bytes + led.used_bytes == led.total_bytes
    _, final, _, _ = drive(core)
    outcomes.update({rid: u.finished.name for rid, u in final.items() if u.finished})
    assert_whole(core)
    kinds = set(outcomes.values())
    assert {"ABORT", "ERROR", "LENGTH"} <= kinds, kinds
    assert len(outcomes) == len(live)
    assert core.status().kv_growths > 0


def test_tiny_model_batched_and_chunked_equals_single_requests(tiny_model_dir):
    """Real ModelRunner: 8 concurrent requests of different lengths, prefill in chunks smaller
    than the prompts, give the same greedy tokens as each request alone."""
    import torch
    torch.set_num_threads(1)

    def tiny_core(prefix_cache: bool, **limits) -> EngineCore:
        spec = EngineSpec(model_id="tiny", model_dir=str(tiny_model_dir), num_blocks=128,
                          block_size=8, context=256, prefix_cache=prefix_cache,
                          limits=m.Limits(anon_max_in_flight=8, **limits))
        return EngineCore(spec)

    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(5 + 7 * i)]
               for i in range(8)]
    solo_core = tiny_core(False, max_slots=1, prefill_chunk_tokens=512)
    solo = []
    for i, p in enumerate(prompts):
        tokens = drive(solo_core, m.ToEngine(new=[new(f"s{i}", p, 16)])).tokens
        solo.append(tokens[f"s{i}"])
    core = tiny_core(True, max_slots=8, max_batched_tokens=40, prefill_chunk_tokens=11)
    tokens, final, admitted, _ = drive(core, m.ToEngine(new=[new(f"c{i}", p, 16)
                                                          for i, p in enumerate(prompts)]))
    assert [tokens[f"c{i}"] for i in range(8)] == solo
    assert_whole(core)
    # and again with requests arriving one by one, so later ones hit the filed shared prefix
    core = tiny_core(True, max_slots=8, max_batched_tokens=40, prefill_chunk_tokens=11)
    tokens, admitted = staggered(core, [new(f"p{i}", p, 16) for i, p in enumerate(prompts)])
    assert [tokens[f"p{i}"] for i in range(8)] == solo
    assert admitted["p3"].cached_tokens == 16  # 20 shared tokens: two full blocks of 8
    assert_whole(core)


# --- prefix cache -----------------------------------------------------------------


def staggered(core: EngineCore, requests: list[m.NewRequest], every: int = 3):
    """Feed one request every `every` steps (so earlier prefixes get filed), then drain."""
    tokens: dict[str, list[int]] = {}
    admitted: dict[str, m.RequestUpdate] = {}
    pending = list(requests)
    step = 0
    while pending or core.has_work:
        inbound = m.ToEngine(new=[pending.pop(0)]) if pending and step % every == 0 else None
        for u in core.step(inbound).updates:
            tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.admitted:
                admitted[u.req_id] = u
            assert u.finished in (None, m.FinishReason.LENGTH, m.FinishReason.STOP), u
        step += 1
        core.pool.check()
    return tokens, admitted


def test_prefix_cache_same_tokens_on_and_off_with_shared_prefixes():
    rng = random.Random(5)
    system = [rng.randrange(VOCAB) for _ in range(18)]
    reqs = [new(f"q{i}", system[: 9 + (i % 3) * 4] + [rng.randrange(VOCAB) for _ in range(i % 5 + 1)],
                6 + i % 4) for i in range(12)]
    runs = {}
    for on in (False, True):
        core = make_core(prefix_cache=on, max_slots=4, max_batched_tokens=12, prefill_chunk_tokens=5)
        runs[on] = staggered(core, reqs)
        assert_whole(core)
    assert runs[True][0] == runs[False][0]
    cached = {rid: u.cached_tokens for rid, u in runs[True][1].items()}
    assert cached["q0"] == 0 and sum(cached.values()) > 0
    assert all(c % 4 == 0 for c in cached.values())
    assert not any(u.cached_tokens for u in runs[False][1].values())
    # q3 shares 9 prompt tokens with q0: two full blocks of 4, the rest computed
    assert cached["q3"] == 8


def test_multi_turn_second_turn_reuses_the_first_turns_blocks():
    core = make_core(prefix_cache=True)
    turn1 = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    tokens = drive(core, m.ToEngine(new=[new("t1", turn1, 9)])).tokens
    turn2 = turn1 + tokens["t1"] + [7, 7, 7]
    tokens2, _, admitted, _ = drive(core, m.ToEngine(new=[new("t2", turn2, 5)]))
    # prompt and output blocks of turn 1 were filed: 19 tokens -> 4 full blocks (16 tokens)
    assert admitted["t2"].cached_tokens == 16
    assert tokens2["t2"] == expected(turn2, 5)
    st = core.status()
    assert (st.prefix_query_tokens, st.prefix_hit_tokens) == (10 + 22, 16)
    assert st.kv.cached_bytes > 0 and st.kv.free_bytes == st.kv.total_bytes


def test_whole_prompt_cached_still_computes_its_last_token():
    core = make_core(prefix_cache=True)
    prompt = list(range(1, 13))  # exactly 3 blocks
    drive(core, m.ToEngine(new=[new("a", prompt, 3)]))
    tokens, _, admitted, _ = drive(core, m.ToEngine(new=[new("b", prompt, 3)]))
    assert admitted["b"].cached_tokens == 8  # the last block is recomputed for its logits
    assert tokens["b"] == expected(prompt, 3)


def test_eviction_under_pressure_keeps_outputs_and_the_ledger():
    rng = random.Random(9)
    prefixes = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(6)]
    # one hot prefix every other request, cold ones between that push it out now and then
    reqs = [new(f"e{i}", prefixes[0 if i % 2 else 1 + i % 5] + [rng.randrange(VOCAB)], 7)
            for i in range(30)]
    runs = {}
    for on in (False, True):
        # 16 blocks: 2 requests of 5 blocks in flight, little room left to keep prefixes
        core = make_core(num_blocks=16, prefix_cache=on, max_in_flight=2, max_slots=2)
        runs[on] = staggered(core, reqs, every=2)
        assert_whole(core)
        if on:
            assert core.pool.num_evicted_total > 0
            hits = sum(u.cached_tokens > 0 for u in runs[on][1].values())
            assert 0 < hits < 30
    assert runs[True][0] == runs[False][0]


def test_pinned_prefix_cannot_be_evicted_before_its_prefill():
    # b reuses a's cached blocks; c's reservation must not take them while b waits for a row
    core = make_core(num_blocks=9, prefix_cache=True, max_slots=1, max_in_flight=3)
    prompt = list(range(20, 29))  # 9 tokens: 2 full blocks
    drive(core, m.ToEngine(new=[new("a", prompt, 3, principal="b")]))  # b's own prefix
    assert core.pool.num_cached_blocks == 2
    out = core.step(m.ToEngine(new=[new("x", [1, 2, 3], 9, principal="x"),
                                     new("b", prompt + [5], 2, principal="b"),
                                     new("c", [9] * 9, 7, principal="c")]))
    adm = {u.req_id: u.cached_tokens for u in out.updates if u.admitted}
    # x: 3 blocks, b: 1 new + 2 pinned, c would need 4 > 9 - 6 left: it waits
    assert adm == {"x": 0, "b": 8}
    tokens = drive(core).tokens
    assert tokens["b"] == expected(prompt + [5], 2)
    assert_whole(core)


def test_reset_kv_replans_the_pool_only_when_nothing_is_in_flight():
    core = make_core(num_blocks=64, context=256, max_in_flight=1)
    core.step(m.ToEngine(new=[new("a", [1, 2], 20), new("long", [3] * 100, 50, principal="q"),
                              new("short", [4] * 4, 4, principal="r")]))
    out = core.step(m.ToEngine(reset_kv=m.ResetKv(num_blocks=32, kv_dtype="int8",
                                                  bytes_per_token=1, context=128)))
    assert "in flight" in out.kv_reset and core.pool.num_blocks == 64
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id="a")],
                               reset_kv=m.ResetKv(num_blocks=32, kv_dtype="int8",
                                                  bytes_per_token=1, context=128)))
    assert out.kv_reset == "ok"
    assert out.status.kv.total_bytes == 32 * 4 * 1 and core.spec.context == 128
    assert core.runner.kv_dtype == "int8" and len(core.runner.kv) == 32
    # "long" (150 tokens) no longer fits the context and is refused; "short" is served
    assert [u.refused_code for u in out.updates if u.req_id == "long"] == ["context_length_exceeded"]
    first = [t for u in out.updates if u.req_id == "short" for t in u.new_token_ids]
    tokens, final, _, _ = drive(core)
    assert first + tokens["short"] == expected([4] * 4, 4)
    assert_whole(core)


def test_requests_held_by_a_switch_are_sized_again_for_its_pool_and_limits():
    """Queued while a switch waits for its in-flight work, requests are sized again for
    the re-planned pool and the profile's limits, as new requests would be: refused with
    the arithmetic where they no longer fit, and one without max_tokens takes the budget
    a new one would (not the old context's, as if it had asked that many), one whose
    max_tokens is a ceiling is fitted to the new context."""
    core = make_core(num_blocks=64, context=256, max_in_flight=4, default_output_tokens=1000)
    core.step(m.ToEngine(new=[new("a", [1, 2], 20)]))
    held = [new("free", [3] * 10, None, principal="q"), new("asked", [4] * 10, 200,
                                                            principal="r"),
            # Anthropic's max_tokens 1000: a ceiling the daemon fitted to the context
            new("fit", [5] * 10, 246, principal="s", max_tokens_ceiling=1000)]
    out = core.step(m.ToEngine(new=held, stop_admitting=True))
    assert not [u for u in out.updates if u.admitted or u.refused_code]
    assert core.admission.reservation_blocks(core.requests["free"]) == 64  # 246 + 10 tokens
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id="a")], stop_admitting=True,
                               reset_kv=m.ResetKv(num_blocks=32, kv_dtype="int8",
                                                  bytes_per_token=1, context=128)))
    assert out.kv_reset == "ok"
    refused = {u.req_id: (u.refused_code, u.refused_message) for u in out.updates
               if u.refused_code}
    assert refused == {"asked": ("context_length_exceeded", (
        "This model's maximum context length is 128 tokens; the request asks for 210 "
        "tokens (10 in the prompt + 200 max_tokens)."))}
    assert core.requests["free"].output_budget == 118  # the new context's
    # the switch ends: admission resumes under the profile's limits, in one message
    tokens, final, admitted, _ = drive(core, m.ToEngine(limits=m.Limits(
        anon_max_in_flight=64, default_output_tokens=6, grow_output=False)))
    assert tokens["free"] == expected([3] * 10, 6)  # the new default_output_tokens
    assert admitted["fit"].output_budget == 118 and len(tokens["fit"]) == 118
    assert_whole(core)


def test_a_prefix_digest_collision_serves_no_other_tenants_kv(monkeypatch):
    from helexa.neuron.engine import block_key

    monkeypatch.setattr(block_key, "_digest", lambda parent, tokens: b"\x01" * 32)
    core = make_core(prefix_cache=True)
    secret = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    drive(core, m.ToEngine(new=[new("alice", secret, 3, principal="alice")]))
    probe = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # every block collides with alice's
    tokens, _, admitted, _ = drive(core, m.ToEngine(new=[new("mallory", probe, 3, principal="mallory")]))
    assert admitted["mallory"].cached_tokens == 0
    assert tokens["mallory"] == expected(probe, 3)
    assert_whole(core)


def test_a_request_admitted_with_no_row_free_is_started_when_it_gets_one() -> None:
    """More in flight than max_slots: b is admitted at once (its stream opens) but its
    prefill begins only when a's row frees, and its update says so then, not before."""
    core = make_core(max_slots=1, max_in_flight=2)
    started: dict[str, list[int]] = {"a": [], "b": []}
    admitted: dict[str, int] = {}
    for step in range(1, 40):
        out = core.step(m.ToEngine(new=[new("a", [3, 4], 6), new("b", [5, 6], 2)])
                        if step == 1 else None)
        for u in out.updates:
            if u.admitted:
                admitted[u.req_id] = step
            if u.started:
                started[u.req_id].append(step)
        if not core.has_work:
            break
    assert admitted == {"a": 1, "b": 1}
    assert started["a"] == [1]
    assert len(started["b"]) == 1 and started["b"][0] > 6  # a's 6 tokens came first
    assert_whole(core)
