"""Scheduler: decode first, prefill chunks under the token budget, max_slots — exact plans."""

from __future__ import annotations

from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.scheduler import ScheduledChunk, Scheduler


def req(rid: str, prompt: int, computed: int = 0, outputs: int = 0) -> Request:
    r = Request(req_id=rid, prompt_token_ids=list(range(prompt)), output_budget=100)
    r.output_token_ids = [7] * outputs
    r.num_computed_tokens = computed
    r.status = RequestStatus.RUNNING if computed or outputs else RequestStatus.IN_FLIGHT
    return r


def decoding(rid: str, prompt: int = 10, outputs: int = 1) -> Request:
    # prompt and all but the last sampled token are in the cache
    return req(rid, prompt, computed=prompt + outputs - 1, outputs=outputs)


def test_decode_first_then_running_prefill_then_promotions():
    s = Scheduler(max_slots=4, max_batched_tokens=20, prefill_chunk_tokens=8)
    running = [decoding("d1"), req("p1", 30, computed=8), decoding("d2", outputs=3)]
    waiting = [req("w1", 5), req("w2", 50)]
    plan = s.schedule(running, waiting)
    assert plan.chunks == [
        ScheduledChunk("d1", 1, False),
        ScheduledChunk("d2", 1, False),
        ScheduledChunk("p1", 8, True),
        ScheduledChunk("w1", 5, True),
    ]
    assert plan.promoted == ["w1"]  # slots: 3 running + w1 = 4 = max_slots
    assert plan.num_tokens == 15
    assert plan.decode_ids == ["d1", "d2"]
    assert plan.prefill == [("p1", 8), ("w1", 5)]


def test_budget_caps_the_last_chunk():
    s = Scheduler(max_slots=8, max_batched_tokens=12, prefill_chunk_tokens=8)
    plan = s.schedule([decoding("d1"), decoding("d2")], [req("w1", 40), req("w2", 40)])
    assert plan.chunks == [ScheduledChunk("d1", 1, False), ScheduledChunk("d2", 1, False),
                           ScheduledChunk("w1", 8, True), ScheduledChunk("w2", 2, True)]
    assert plan.promoted == ["w1", "w2"]


def test_long_prompt_never_stalls_decodes():
    s = Scheduler(max_slots=2, max_batched_tokens=16, prefill_chunk_tokens=16)
    d, p = decoding("d"), req("p", 100)
    steps = []
    running, waiting = [d], [p]
    while p.is_prefilling:
        plan = s.schedule(running, waiting)
        steps.append([(c.req_id, c.num_tokens) for c in plan.chunks])
        for c in plan.chunks:
            r = d if c.req_id == "d" else p
            r.num_computed_tokens += c.num_tokens
            if c.req_id == "d":
                d.output_token_ids.append(1)
        if plan.promoted:
            running, waiting = [d, p], []
    # every step carries d's decode token; p's 100 tokens go 15 at a time
    assert all(step[0] == ("d", 1) for step in steps)
    assert [n for step in steps for rid, n in step if rid == "p"] == [15] * 6 + [10]


def test_max_slots_holds_waiting_back_and_empty_plan():
    s = Scheduler(max_slots=2, max_batched_tokens=100, prefill_chunk_tokens=100)
    plan = s.schedule([decoding("a"), decoding("b")], [req("w", 5)])
    assert plan.promoted == [] and [c.req_id for c in plan.chunks] == ["a", "b"]
    assert s.schedule([], []).is_empty


def test_decode_budget_smaller_than_batch():
    s = Scheduler(max_slots=8, max_batched_tokens=2, prefill_chunk_tokens=4)
    plan = s.schedule([decoding("a"), decoding("b"), decoding("c")], [req("w", 5)])
    assert plan.decode_ids == ["a", "b"] and plan.promoted == []


def test_prefix_hit_prefills_only_the_rest():
    s = Scheduler(max_slots=2, max_batched_tokens=100, prefill_chunk_tokens=100)
    w = req("w", 37)
    w.num_computed_tokens = 32  # 2 cached blocks of 16
    assert s.schedule([], [w]).chunks == [ScheduledChunk("w", 5, True)]


def test_a_hybrids_prefill_chunks_end_where_prefix_snapshots_are_kept():
    # block 8, a checkpoint every 32 tokens: chunks end at 32, 64, then the prompt's last
    # two block boundaries (88, 96), then its rest
    sched = Scheduler(max_slots=4, max_batched_tokens=512, prefill_chunk_tokens=512,
                      snapshot_block_tokens=8, snapshot_every_tokens=32)
    r = req("h", 100)
    ends = []
    while r.num_computed_tokens < 100:
        (chunk,) = sched.schedule([], [r]).chunks
        r.num_computed_tokens += chunk.num_tokens
        ends.append(r.num_computed_tokens)
    assert ends == [32, 64, 88, 96, 100]
    plain = Scheduler(max_slots=4, max_batched_tokens=512, prefill_chunk_tokens=512)
    assert [c.num_tokens for c in plain.schedule([], [req("d", 100)]).chunks] == [100]


def test_a_resumed_request_is_promoted_with_its_decode_token():
    """A request resumed after a pause waits in flight with its prompt in the cache: it gets
    a row back as a waiting prompt would, but one decode token rather than a prefill chunk;
    a paused one is in neither list, so its row went to the waiting prompt."""
    s = Scheduler(max_slots=2, max_batched_tokens=16, prefill_chunk_tokens=8)
    resumed = decoding("r", outputs=5)
    resumed.status = RequestStatus.IN_FLIGHT
    plan = s.schedule([decoding("d")], [resumed, req("w", 30)])
    assert plan.chunks == [ScheduledChunk("d", 1, False), ScheduledChunk("r", 1, False)]
    assert plan.promoted == ["r"] and plan.decode_ids == ["d", "r"]
    plan = s.schedule([decoding("d")], [req("w", 30)])  # r paused: w takes the row
    assert plan.promoted == ["w"]


def test_rows_go_back_to_requests_that_had_one_from_those_admitted_after_them():
    """Every row held: a waiting request that had a row takes one back from the decoding
    request admitted last, only where that one was admitted after it; a request still
    prefilling keeps its row, and a free row is taken before any is reclaimed."""
    def seq(r: Request, n: int, had_row: bool = True) -> Request:
        r.seq, r.had_row = n, had_row
        return r

    s = Scheduler(max_slots=3, max_batched_tokens=64, prefill_chunk_tokens=8)
    a, b = seq(decoding("a"), 1), seq(decoding("b"), 2)
    c, d = seq(decoding("c"), 5), seq(req("p", 30, computed=8), 6)
    new = seq(req("n", 5), 7, had_row=False)
    assert [r.req_id for r in s.reclaims([c, d, seq(decoding("e"), 4)], [a, b, new])] == \
        ["c", "e"]  # most senior waiting from the latest decoding; p keeps its prefill row
    assert s.reclaims([c, d, seq(decoding("e"), 4)], [new]) == []  # never had a row: waits
    assert [r.req_id for r in s.reclaims([c, d], [a, b])] == ["c"]  # a takes the free row
    assert s.reclaims([c, d, seq(decoding("x"), 0)], [seq(decoding("z"), 9)]) == []


def resumed(rid: str, seq: int, outputs: int = 5) -> Request:
    """A request that had a row, paused and resumed: waiting, its prompt in the cache."""
    r = decoding(rid, outputs=outputs)
    r.status, r.seq, r.had_row = RequestStatus.IN_FLIGHT, seq, True
    return r


def test_a_resumed_request_decodes_before_any_prefill_chunk():
    """A prefill that would take the whole budget does not hold a resumed request back: it
    gets its row with its decode token first, and the prefill the budget left."""
    s = Scheduler(max_slots=2, max_batched_tokens=4, prefill_chunk_tokens=4)
    p = req("p", 60, computed=8)
    plan = s.schedule([p], [resumed("r", 1)])
    assert plan.chunks == [ScheduledChunk("r", 1, False), ScheduledChunk("p", 3, True)]
    assert plan.promoted == ["r"]


def test_a_row_is_taken_back_only_for_a_claimant_that_decodes_in_the_same_step():
    """Every row held, one by a prefill that takes what budget is left: the row taken back
    from the decoding request admitted last goes to the resumed one in the same step; where
    the budget has no token for the claimant after the running decodes, no row is taken."""
    s = Scheduler(max_slots=2, max_batched_tokens=4, prefill_chunk_tokens=4)
    a, b = resumed("a", 1), decoding("b")
    b.seq, b.had_row = 2, True
    p = req("p", 60, computed=8)
    p.seq, p.had_row = 3, True
    assert s.reclaims([b, p], [a]) == [b]
    plan = s.schedule([p], [a, b])  # b waits for a row again, behind a
    assert plan.promoted == ["a"] and plan.chunks[0] == ScheduledChunk("a", 1, False)
    c, d = decoding("c"), decoding("d")
    c.seq, d.seq = 4, 5
    two = Scheduler(max_slots=3, max_batched_tokens=2, prefill_chunk_tokens=4)
    assert two.reclaims([c, d, p], [a]) == [d]  # c's token, and a's where d's was
    assert two.schedule([c, p], [a, d]).decode_ids == ["c", "a"]
    one = Scheduler(max_slots=3, max_batched_tokens=1, prefill_chunk_tokens=4)
    assert one.reclaims([c, d, p], [a]) == []  # one token: c's; a row taken would idle


def test_drafts_take_only_what_the_decode_tokens_leave():
    """A running request's draft never takes a token another decoding request, or a
    resumed one taking its row, needs in the step."""
    from helexa.neuron.engine.speculative.drafters import Draft
    s = Scheduler(max_slots=3, max_batched_tokens=4, prefill_chunk_tokens=4)
    d1, d2 = decoding("d1"), decoding("d2")
    d1.draft = Draft([1, 2])
    plan = s.schedule([d1, d2], [resumed("r", 1)])
    assert plan.chunks == [ScheduledChunk("d1", 1, False), ScheduledChunk("d2", 1, False),
                           ScheduledChunk("r", 1, False)]
    plan = s.schedule([d1, d2], [])  # room for the whole draft
    assert plan.chunks == [ScheduledChunk("d1", 3, False, num_draft=2),
                           ScheduledChunk("d2", 1, False)]


def test_prompt_logprobs_chunks_share_four_rows_a_slot_in_a_step():
    """Chunks of requests scoring their prompt (every row's logits kept) hold at most
    4 × max_slots tokens in a step together, in equal shares, a share one needs less of
    going to the others; others prefill as before; a new scoring prompt whose share is none
    waits, and nobody admitted after it is promoted past it."""
    from helexa.neuron.engine.messages import SamplingParams

    def scoring(rid: str, prompt: int, computed: int = 0) -> Request:
        r = req(rid, prompt, computed)
        r.sampling = SamplingParams(prompt_logprobs=1)
        return r

    s = Scheduler(max_slots=3, max_batched_tokens=100, prefill_chunk_tokens=16)  # 12 rows
    plan = s.schedule([scoring("a", 40, computed=4), req("p", 40, computed=4),
                       scoring("b", 40, computed=4)], [])
    assert plan.chunks == [ScheduledChunk("a", 6, True), ScheduledChunk("p", 16, True),
                           ScheduledChunk("b", 6, True)]
    plan = s.schedule([scoring("a", 40, computed=37)],  # needs 3 of its 6: w takes 9
                      [scoring("w", 40), req("late", 40)])
    assert plan.chunks == [ScheduledChunk("a", 3, True), ScheduledChunk("w", 9, True),
                           ScheduledChunk("late", 16, True)]
    s.scoring_rows = 1  # one row for two: the first running one's; w waits, late too
    plan = s.schedule([scoring("a", 40, computed=4)], [scoring("w", 40), req("late", 40)])
    assert plan.chunks == [ScheduledChunk("a", 1, True)] and plan.promoted == []


def test_a_short_scoring_prompt_behind_a_long_one_takes_its_share():
    """A long scoring prompt running and a short one waiting for a row: the short one is
    promoted with half the step's scoring rows rather than waiting for the long one."""
    from helexa.neuron.engine.messages import SamplingParams

    long_, short = req("long", 6000, computed=32), req("short", 200)
    long_.sampling = short.sampling = SamplingParams(prompt_logprobs=1)
    s = Scheduler(max_slots=8, max_batched_tokens=2048, prefill_chunk_tokens=512)  # 32 rows
    plan = s.schedule([long_], [short])
    assert plan.chunks == [ScheduledChunk("long", 16, True), ScheduledChunk("short", 16, True)]
    assert plan.promoted == ["short"]
