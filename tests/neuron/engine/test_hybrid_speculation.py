"""Speculative decoding on hybrid (Gated DeltaNet) models: a rejected draft's linear-attention
state rolls back exactly, so greedy output is token-identical with speculation on or off,
for every drafter, alone and in a mixed batch with chunked prefill, and every block, state
slot and reservation comes back."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from support.spec_engine import assert_whole, drive, truth_from

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

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = m.SamplingParams(temperature=0.0)
VOCAB = 512  # the tiny checkpoints'
ARCHS = ["qwen3_next", "qwen3_5"]


def make_core(model_dir: Path, drafter: Drafter | None = None, **limits) -> EngineCore:
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=160, block_size=8,
                      context=512, bytes_per_token=0,
                      limits=m.SetLimits(**{"anon_max_in_flight": 64, "spec_k": 4,
                                            "spec_full_below": 1.0, "spec_off_above": 1.01,
                                            **limits}))
    return EngineCore(spec, drafter=drafter)








KINDS: dict[str, Callable[[Callable], Drafter]] = {
    "oracle": lambda t: OracleDrafter(t),
    "adversarial": lambda t: AdversarialDrafter(t, VOCAB),
    "ngram": lambda t: NgramDrafter(min_n=1),
}


def run_both(model_dir: Path, news: list[m.NewRequest],
             drafters: Callable[[Callable], Drafter], **limits
             ) -> tuple[dict, dict, EngineCore]:
    reference = drive(make_core(model_dir, **limits), news)
    prompts = {n.req_id: list(n.prompt_token_ids) for n in news}
    core = make_core(model_dir, drafters(truth_from(reference, prompts)), **limits)
    got = drive(core, news)
    assert_whole(core)
    return reference, got, core


def repetitive(rng: random.Random, rid: str, max_tokens: int,
               stop: list[int] | None = None) -> m.NewRequest:
    """A prompt with repeats (prompt lookup finds something), longer than a prefill chunk."""
    base = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))]
    prompt = base * rng.randrange(2, 4) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(9))]
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY, stop_token_ids=stop or [])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_output_is_identical_alone(tiny_checkpoint, arch: str, kind: str):
    news = [repetitive(random.Random(3), "r0", 40)]
    ref, got, core = run_both(tiny_checkpoint(arch), news, KINDS[kind], prefill_chunk_tokens=8)
    assert got == ref and len(got["r0"]) == 40
    s = core.status()
    assert s.drafter == kind and s.spec_drafted_tokens > 0
    if kind == "oracle":  # always right: every draft accepted
        assert s.spec_accepted_tokens == s.spec_drafted_tokens
    if kind == "adversarial":  # always wrong: every verification rolls the state back
        assert s.spec_accepted_tokens == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_in_a_batch_of_8_mixed_with_chunked_prefill(
        tiny_checkpoint, arch: str):
    rng = random.Random(5)
    news = [repetitive(rng, f"r{i}", rng.randrange(8, 30)) for i in range(8)]
    kinds = list(KINDS)

    def mixed(truth: Callable) -> Drafter:
        return PerRequestDrafter({n.req_id: KINDS[kinds[i % 3]](truth)
                                  for i, n in enumerate(news) if i % 4 != 3})

    ref, got, core = run_both(tiny_checkpoint(arch), news, mixed, max_slots=8,
                              prefill_chunk_tokens=5, max_batched_tokens=24)
    assert got == ref
    s = core.status()
    assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens


def test_speculation_setting_turns_ngram_on_for_a_hybrid(tiny_checkpoint):
    # What an operator sets (speculation = "ngram") now drafts on a hybrid, same output.
    model_dir = tiny_checkpoint("qwen3_5")
    news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=p, max_tokens=16, sampling=GREEDY)
            for i, p in enumerate([[5, 6, 7, 8] * 5, [9, 10, 11] * 6])]  # repeats: it drafts
    want = drive(make_core(model_dir, max_slots=2), news)
    core = make_core(model_dir, max_slots=2, speculation="ngram")
    assert core.status().drafter == "ngram"
    assert drive(core, news) == want
    assert core.speculator.drafted_tokens > 0
    assert_whole(core)


class StormDrafter:
    """Right for a random prefix of the draft and wrong after it, or prompt lookup."""

    name = "storm"

    def __init__(self, rng: random.Random, truth: Callable[[list[int], int], list[int]]) -> None:
        self.rng, self.truth, self.ngram = rng, truth, NgramDrafter(min_n=1)

    def propose(self, req, k: int):
        if self.rng.random() < 0.3:
            return self.ngram.propose(req, k)
        good = self.truth(req.all_token_ids(), k)
        cut = self.rng.randrange(len(good) + 1)
        return Draft(good[:cut] + [(t + 1) % VOCAB for t in good[cut:]])


def test_storm_with_aborts_and_stops_leaves_the_ledger_whole_and_holds_at_most_a_row_a_slot(
        tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_next")
    rng = random.Random(11)
    news = [repetitive(rng, f"r{i}", rng.randrange(1, 24), stop=[rng.randrange(3, VOCAB)])
            for i in range(40)]
    # a few sampled (rejection rule; not compared): they roll back as greedy ones do
    news += [m.NewRequest(req_id=f"s{i}", prompt_token_ids=[5, 6, 7, 8] * 4, max_tokens=12,
                          sampling=m.SamplingParams(temperature=0.8, seed=i)) for i in range(4)]
    reference = drive(make_core(model_dir, max_slots=4, max_in_flight=6, prefill_chunk_tokens=6,
                                max_batched_tokens=16), news)
    truth = truth_from(reference, {n.req_id: list(n.prompt_token_ids) for n in news})
    core = make_core(model_dir, StormDrafter(rng, truth), max_slots=4, max_in_flight=6,
                     prefill_chunk_tokens=6, max_batched_tokens=16, max_queue_depth=64)
    got: dict[str, list[int]] = {}
    pending, live, aborted = list(news), [], set()
    while pending or core.has_work:
        inbound = m.ToEngine()
        if pending and rng.random() < 0.4:
            inbound.new = [pending.pop(0)]
            live.append(inbound.new[0].req_id)
        if live and rng.random() < 0.05:
            inbound.aborts = [m.Abort(req_id=rng.choice(live))]
            aborted.add(inbound.aborts[0].req_id)
        for u in core.step(inbound).updates:
            assert u.refused_code is None and u.error in ("", "client_gone"), u
            got.setdefault(u.req_id, []).extend(u.new_token_ids)
        core.pool.check()
        for state in core.runner.linear_states.layers:  # one held row a slot at most
            assert len(state._held) <= core.pool.num_state_slots  # whatever ended
    assert_whole(core)
    for rid, tokens in reference.items():  # greedy, not aborted: exactly plain decoding
        if rid.startswith("r"):
            mine = got.get(rid, [])
            assert mine == (tokens if rid not in aborted else tokens[:len(mine)]), rid
    s = core.status()
    assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens


def test_tensor_parallel_ranks_roll_back_alike(tiny_checkpoint):
    # Every rank settles its heads' share from the same step plan: no message is added.
    model_dir = tiny_checkpoint("qwen3_5")
    rng = random.Random(6)
    news = [repetitive(rng, f"r{i}", 16) for i in range(3)]
    reference = drive(make_core(model_dir, max_slots=3), news)
    truth = truth_from(reference, {n.req_id: list(n.prompt_token_ids) for n in news})
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=160, block_size=8,
                      context=512, bytes_per_token=0, tp=2, devices=["cpu", "cpu"],
                      limits=m.SetLimits(anon_max_in_flight=64, spec_k=3, spec_full_below=1.0,
                                         spec_off_above=1.01, max_slots=3))
    core = EngineCore(spec, drafter=PerRequestDrafter({
        "r0": OracleDrafter(truth), "r1": AdversarialDrafter(truth, VOCAB),
        "r2": NgramDrafter(min_n=1)}))
    try:
        assert drive(core, news) == reference
        assert_whole(core)
        s = core.status()
        assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens
    finally:
        core.close()
