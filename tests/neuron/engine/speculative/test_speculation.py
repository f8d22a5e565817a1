"""Speculative decoding in the engine core: greedy output is token-identical with any
drafter, alone and batched, with chunked prefill; verification samples the target's
distribution; the ledger is whole after a storm with speculation on."""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import pytest
from support.engine import assert_whole, drive, truth_from, with_drafter
from support.fake_runner import FakeRunner, fake_next_token

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import (
    AdversarialDrafter,
    Draft,
    Drafter,
    NgramDrafter,
    OracleDrafter,
    PerRequestDrafter,
)

VOCAB = 100
GREEDY = m.SamplingParams(temperature=0.0)
SAMPLED = m.SamplingParams(temperature=0.7, top_k=5, seed=4)  # verified by the rejection rule


def make_core(runner=None, drafter: Drafter | None = None, *, num_blocks: int = 128,
              block_size: int = 4, prefix_cache: bool = False, **limits) -> EngineCore:
    spec = EngineSpec(model_id="fake", num_blocks=num_blocks, block_size=block_size,
                      context=256, bytes_per_token=2, prefix_cache=prefix_cache,
                      limits=m.Limits(**{"anon_max_in_flight": 64, "spec_k": 4,
                                            "spec_off_above": 1.01, "spec_full_below": 1.0,
                                            **limits}))
    core = EngineCore(spec, runner if runner is not None
                      else FakeRunner(VOCAB, num_blocks, block_size))
    return with_drafter(core, drafter) if drafter is not None else core








def workload(rng: random.Random, n: int) -> list[m.NewRequest]:
    """Prompts with repeats (n-gram finds something) and without, some longer than a chunk."""
    out = []
    for i in range(n):
        base = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))]
        prompt = base * rng.randrange(1, 4) + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 9))]
        out.append(m.NewRequest(req_id=f"r{i}", prompt_token_ids=prompt,
                                max_tokens=rng.randrange(5, 40), sampling=GREEDY))
    return out


def run_all(make_runner: Callable[[], object] | None, news: list[m.NewRequest],
            drafters: Callable[[Callable], Drafter], **limits):
    ref_core = make_core(make_runner() if make_runner else None, **limits)
    reference = drive(ref_core, news, served=True).tokens
    prompts = {n.req_id: list(n.prompt_token_ids) for n in news}
    core = make_core(make_runner() if make_runner else None,
                     drafters(truth_from(reference, prompts)), **limits)
    got = drive(core, news, served=True).tokens
    assert_whole(core)
    return reference, got, core, ref_core


KINDS: dict[str, Callable[[Callable], Drafter]] = {
    "oracle": lambda t: OracleDrafter(t),
    "adversarial": lambda t: AdversarialDrafter(t, VOCAB),
    "ngram": lambda t: NgramDrafter(min_n=1),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_output_is_identical_alone(kind: str):
    # every token once in the prompt: prompt lookup always has a guess (right or not)
    news = [m.NewRequest(req_id="r0", prompt_token_ids=list(range(VOCAB)) + [7, 3],
                         max_tokens=60, sampling=GREEDY)]
    ref, got, core, ref_core = run_all(None, news, KINDS[kind])
    assert got == ref
    s = core.status()
    assert s.spec_drafted_tokens > 0
    if kind == "oracle":  # always right: every draft accepted, and fewer steps
        assert s.spec_accepted_tokens == s.spec_drafted_tokens
        assert core.runner.num_steps < ref_core.runner.num_steps
    if kind == "adversarial":
        assert s.spec_accepted_tokens == 0


def test_a_request_without_max_tokens_drafts_through_its_growths():
    """Its budget grows at each end of its reservation (growth.py): the drafts stay inside
    it, and the output is the reference's, past kv.default_output_tokens to the context."""
    news = [m.NewRequest(req_id="r0", prompt_token_ids=list(range(VOCAB)) + [7, 3],
                         sampling=GREEDY)]
    ref, got, core, _ = run_all(None, news, KINDS["oracle"], default_output_tokens=8)
    assert got == ref and len(got["r0"]) == 256 - VOCAB - 2
    s = core.status()
    assert s.kv_growths > 10 and s.spec_accepted_tokens == s.spec_drafted_tokens > 0


def test_greedy_output_is_identical_in_a_batch_of_8_mixed_with_chunked_prefill():
    news = workload(random.Random(5), 8)
    kinds = list(KINDS)

    def mixed(truth: Callable) -> Drafter:
        return PerRequestDrafter({n.req_id: KINDS[kinds[i % 3]](truth)
                                  for i, n in enumerate(news) if i % 4 != 3})

    ref, got, core, _ = run_all(None, news, mixed, max_slots=8, prefill_chunk_tokens=5,
                                max_batched_tokens=24)
    assert got == ref
    assert 0 < core.status().spec_accepted_tokens < core.status().spec_drafted_tokens


def test_stop_token_among_accepted_drafts_ends_the_request_there():
    news = workload(random.Random(7), 1)
    ref, _, _, _ = run_all(None, news, KINDS["oracle"])
    stop = ref["r0"][6]
    cut = ref["r0"][:ref["r0"].index(stop) + 1]
    stopped = [m.NewRequest(req_id="r0", prompt_token_ids=news[0].prompt_token_ids,
                            max_tokens=news[0].max_tokens, sampling=GREEDY,
                            stop_token_ids=[stop])]
    _, got, _, _ = run_all(None, stopped, KINDS["oracle"])
    assert got["r0"] == cut


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_ledger_whole_after_a_storm_with_speculation(prefix_cache: bool):
    rng = random.Random(11)
    core = make_core(None, StormDrafter(rng), num_blocks=48,
                     prefix_cache=prefix_cache, max_in_flight=6, max_slots=4,
                     max_batched_tokens=14, prefill_chunk_tokens=6, max_queue_depth=10,
                     default_output_tokens=6)
    live: list[str] = []
    for i in range(300):
        inbound = m.ToEngine()
        if rng.random() < 0.3:
            base = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
            max_tokens = rng.randrange(1, 30)  # every 4th names none: it grows (growth.py)
            inbound.new = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=base * 3,
                                        max_tokens=None if i % 4 == 0 else max_tokens,
                                        sampling=rng.choice([GREEDY, SAMPLED]),
                                        stop_token_ids=[rng.randrange(VOCAB)])]
            live.append(f"r{i}")
        if live and rng.random() < 0.1:
            inbound.aborts = [m.Abort(req_id=rng.choice(live))]
        core.step(inbound)
        core.pool.check()
        for req in core.running:  # never a block beyond the reservation
            assert len(req.block_table) <= req.num_reserved_blocks
    while core.has_work:
        core.step(None)
    assert_whole(core)
    s = core.status()
    assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens and s.drafter == "storm"
    assert s.kv_growths > 0


def fake_truth(context: list[int], k: int) -> list[int]:
    ctx, out = list(context), []
    for _ in range(k):
        out.append(fake_next_token(ctx, VOCAB))
        ctx.append(out[-1])
    return out


class StormDrafter(Drafter):
    """Right for a random prefix of the draft, wrong after it; or prompt lookup."""

    name = "storm"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ngram = NgramDrafter(min_n=1)

    def propose(self, req, k: int) -> Draft:
        if self.rng.random() < 0.3:
            return self.ngram.propose(req, k)
        good = fake_truth(req.all_token_ids(), k)
        cut = self.rng.randrange(k + 1)
        return Draft(good[:cut] + [(t + 1) % VOCAB for t in good[cut:]])


def test_greedy_identical_on_a_tiny_checkpoint(tiny_model_dir):
    """The real model runner: verification rows over paged KV give the tokens decode gives."""
    from helexa.neuron.engine.model_runner import ModelRunner

    def runner():
        return ModelRunner(tiny_model_dir, num_blocks=128, block_size=4, max_num_seqs=8,
                           max_batched_tokens=64)

    news = workload(random.Random(13), 4)
    for kind in KINDS:
        ref, got, core, _ = run_all(runner, news, KINDS[kind], prefill_chunk_tokens=5,
                                    max_batched_tokens=32)
        assert got == ref, kind
        assert core.status().spec_drafted_tokens > 0


def test_speculation_switches_at_runtime_with_the_limits():
    core = make_core(speculation="off")
    news = [m.NewRequest(req_id="a", prompt_token_ids=list(range(VOCAB)), max_tokens=30,
                         sampling=GREEDY)]
    plain = drive(core, news, served=True).tokens
    assert core.status().drafter == "off" and core.status().spec_drafted_tokens == 0
    core.apply(m.ToEngine(limits=msgspec.structs.replace(core.limits, speculation="ngram")))
    again = drive(core, news, served=True).tokens
    assert core.status().drafter == "ngram" and core.status().spec_drafted_tokens > 0
    assert again == plain
    core.apply(m.ToEngine(limits=msgspec.structs.replace(core.limits, spec_k=0)))  # k = 0: drafter named, never run
    drafted = core.status().spec_drafted_tokens
    drive(core, news, served=True)
    assert core.status().spec_drafted_tokens == drafted
