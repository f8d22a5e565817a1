"""One rule, one owner: the router's estimate, the daemon's early check and the engine's
decision are the same function of the same numbers (helexa/budget.py)."""

from __future__ import annotations

import random

import pytest
from support.fake_runner import FakeRunner

from helexa.budget import check_request, grown_budget, output_budget, reservation_blocks
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.limits import ModelLimits, check_context
from helexa.refusal import Refusal
from helexa.router.selection import Candidate, Estimate, reservation_bytes

BLOCK = 4
BPT = 2  # bytes per token


def engine(context: int, max_output: int | None, default_output: int) -> EngineCore:
    spec = EngineSpec(model_id="m", num_blocks=4096, block_size=BLOCK, context=context,
                      bytes_per_token=BPT, max_output_tokens=max_output, prefix_cache=False,
                      limits=m.Limits(default_output_tokens=default_output,
                                         anon_max_in_flight=1, max_in_flight=1))
    return EngineCore(spec, FakeRunner(64, 4096, BLOCK))


def engine_outcome(core: EngineCore, prompt: int, max_tokens: int | None) -> tuple[str, int]:
    """("", blocks reserved) when the engine admits the request, else (code, 0)."""
    def request(req_id: str) -> m.ToEngine:
        return m.ToEngine(new=[m.NewRequest(req_id=req_id, prompt_token_ids=[1] * prompt,
                                            max_tokens=max_tokens)])

    out = core.step(request("r"))
    [upd] = [u for u in out.updates if u.req_id == "r" and (u.admitted or u.refused_code)]
    if upd.refused_code:
        return upd.refused_code, 0
    core.step(m.ToEngine(aborts=[m.Abort(req_id="r")]))
    # Admission alone (no step runs, so nothing is written or finished yet): the ledger
    # shows the whole reservation.
    core.apply(request("again"))
    blocks = core.pool.ledger().reserved_bytes // (BLOCK * BPT)
    core.apply(m.ToEngine(aborts=[m.Abort(req_id="again")]))
    assert core.pool.num_free_blocks == core.pool.num_blocks  # the ledger is whole again
    return "", blocks


def daemon_outcome(prompt: int, max_tokens: int | None, context: int,
                   max_output: int) -> str:
    try:
        check_context(prompt, max_tokens, ModelLimits(context, context - 1, max_output))
    except Refusal as e:
        return e.code
    return ""


@pytest.mark.parametrize("seed", range(4))
def test_router_daemon_and_engine_apply_one_rule(seed: int) -> None:
    rng = random.Random(seed)
    context = rng.choice([32, 100, 257])
    max_output = rng.randint(1, context - 1)
    default_output = rng.randint(1, 2 * context)
    core = engine(context, max_output, default_output)
    for _ in range(150):
        prompt = rng.randint(1, context + 5)
        max_tokens = rng.choice([None, rng.randint(0, context + 5)])
        code, blocks = engine_outcome(core, prompt, max_tokens)
        assert daemon_outcome(prompt, max_tokens, context, max_output) == code, \
            (prompt, max_tokens)
        problem = check_request(prompt, max_tokens, context=context, max_output_tokens=max_output)
        assert (problem.code if problem else "") == code
        if code:
            continue
        budget = output_budget(prompt, max_tokens, context=context,
                               default_output_tokens=default_output, max_output_tokens=max_output)
        assert blocks == reservation_blocks(prompt, budget, BLOCK)
        # The router knows neither max_output_tokens nor the exact prompt, but given the
        # prompt it predicts the engine's reservation whenever that cap does not bite.
        router = Candidate("n", kv_free_bytes=10**9, bytes_per_token=BPT, block_size=BLOCK,
                           context=context, default_output_tokens=default_output)
        if max_tokens is not None or budget == min(default_output, context - prompt):
            assert reservation_bytes(router, Estimate(prompt, max_tokens)) == \
                blocks * BLOCK * BPT, (prompt, max_tokens)


def test_a_growth_fills_whole_blocks_and_stops_at_the_context_and_the_output_limit() -> None:
    def grow(budget: int, max_output: int | None = None) -> int:
        return grown_budget(5, budget, 8, context=64, block_size=4, max_output_tokens=max_output)
    assert grow(8) == 19  # 5 + 8 + 8 = 21 tokens round up to 24: 6 whole blocks
    assert grow(51) == grow(56) == 59  # the context's last token, no further
    assert grow(19, max_output=21) == 21 and grow(21, max_output=21) == 21


def test_every_past_context_refusal_carries_a_count_bench_can_read_back() -> None:
    """The generation refusal, the neuron's "at least" one and /tokenize's chat and text
    ones are one builder's: `helexa bench` sizes its prompts by the count they carry."""
    from helexa.budget import prompt_past_context, tokens_past_context
    from helexa.neuron.token_bound import PastLimit
    from helexa.neuron.tokenize_work import _past_context

    whole = check_request(70, 1, context=64)
    assert whole is not None and whole.code == "context_length_exceeded"
    assert whole.message == ("This model's maximum context length is 64 tokens; the prompt "
                             "has 70 tokens, which leaves no room for output.")
    assert tokens_past_context(whole.message) == 70
    partial = prompt_past_context(65, 64, counted_all=False)
    assert "the prompt has at least 65 tokens" in partial.message
    assert tokens_past_context(partial.message) == 65
    for what in ("chat", "text"):
        r = _past_context(PastLimit(129), 128, what)
        assert r.code == "context_length_exceeded"
        assert f"the {what} has at least 129 tokens (counted no further" in r.message
        assert "room for output" not in r.message  # a text of the context itself is shown
        assert tokens_past_context(r.message) == 129
    too_long = check_request(10, 100, context=64)
    assert too_long is not None and tokens_past_context(too_long.message) is None
