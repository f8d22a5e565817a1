"""The draft-model drafter (speculation = "draft:<id>"): a smaller checkpoint of the same
tokenizer, loaded in the target's engine, its KV in the target's pool.

Greedy output is token-identical with and without it, alone and batched with n-gram and
undrafted requests under chunked prefill; drafting with the target itself is accepted
nearly always (so the drafter really drafts, and its catch-up KV is right); the ledger is
whole after a storm with cancellations; a draft of another tokenizer is refused naming
both models."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.engine import assert_whole, drive, with_drafter
from support.fake_runner import FakeRunner
from support.host_sync import CountReads

from helexa.checkpoint.memory import kv_bytes_per_token
from helexa.checkpoint.shape import read_model_shape
from helexa.neuron.engine import messages as m
from helexa.neuron.engine import sampler as sampler_module
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.seq_input import SeqInput
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative import verify as verify_mod
from helexa.neuron.engine.speculative.draft_model import DraftModelDrafter
from helexa.neuron.engine.speculative.drafters import NgramDrafter, PerRequestDrafter

GREEDY = m.SamplingParams(temperature=0.0)
SAMPLED = m.SamplingParams(temperature=0.8, top_k=20, seed=3)


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir  # qwen3, hidden 64, 2 layers, vocab 512


@pytest.fixture(scope="module")
def draft_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, seed=7)  # same tokenizer (vocab 512)


def per_token(model_dir: Path) -> int:
    return kv_bytes_per_token(read_model_shape(model_dir / "config.json"), 1, "auto")


def tiny_core(target: Path, draft: Path | None, *, speculation: str = "off",
              num_blocks: int = 96, context: int = 256, **limits) -> EngineCore:
    torch.set_num_threads(1)
    draft_bpt = per_token(draft) if draft is not None else 0
    spec = EngineSpec(model_id="tiny", model_dir=str(target), num_blocks=num_blocks,
                      block_size=8, context=context,
                      bytes_per_token=per_token(target) + draft_bpt,
                      prefix_cache=True, draft_model_id="small" if draft else "",
                      draft_model_dir=str(draft or ""), draft_bytes_per_token=draft_bpt,
                      limits=m.Limits(**{"anon_max_in_flight": 16, "max_in_flight": 16,
                                            "speculation": speculation, "spec_k": 4,
                                            "spec_full_below": 1.0, "spec_off_above": 1.01,
                                            "spec_min_acceptance": 0.0, **limits}))
    return EngineCore(spec)


def draft_of(core: EngineCore) -> DraftModelDrafter:
    """The draft model's drafter `core` loaded (speculation = "draft:small")."""
    draft = core.speculator.drafters.draft
    assert draft is not None
    return draft


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 10))]
        out.append(base * (1 + i % 3) + [rng.randrange(3, 500) for _ in range(3 + 5 * i)])
    return out


def greedy(rid: str, p: list[int], n: int = 20) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=p, max_tokens=n, sampling=GREEDY)


def test_the_pool_counts_the_draft_and_its_kv_shares_the_blocks(target_dir, draft_dir):
    core = tiny_core(target_dir, draft_dir, speculation="draft:small")
    assert core.speculator.name == "draft:small"
    target, draft = core.runner, draft_of(core).runner
    assert draft.num_blocks == target.num_blocks == core.pool.num_blocks
    # the ledger's bytes per block are the target's layers plus the draft's
    assert core.pool.bytes_per_block == target.kv_bytes_per_block + draft.kv_bytes_per_block
    assert draft.kv_bytes_per_block == per_token(draft_dir) * 8


def test_greedy_output_is_identical_with_a_draft_model_alone(target_dir, draft_dir):
    p = prompts(1)[0]
    ref = drive(tiny_core(target_dir, None), [greedy("r", p, 40)], served=True).tokens
    core = tiny_core(target_dir, draft_dir, speculation="draft:small")
    assert drive(core, [greedy("r", p, 40)], served=True).tokens == ref
    assert core.status().spec_drafted_tokens > 0
    assert_whole(core)


def test_a_growing_request_drafts_on_with_the_drafts_kv_in_its_grown_blocks(target_dir,
                                                                              draft_dir):
    """The draft model has no pool of its own: its KV lives in the target's blocks, so a
    request that named no max_tokens grows both with its reservation (growth.py) and keeps
    the target's tokens past kv.default_output_tokens."""
    p = prompts(1)[0]
    ref = drive(tiny_core(target_dir, None, context=64), [greedy("r", p, 64 - len(p))],
                served=True).tokens
    core = tiny_core(target_dir, draft_dir, speculation="draft:small", context=64,
                     default_output_tokens=8)
    run = drive(core, [m.NewRequest(req_id="r", prompt_token_ids=p, sampling=GREEDY)],
                served=True)
    assert run.tokens == ref and run.final["r"].finished == m.FinishReason.LENGTH
    s = core.status()
    assert s.kv_growths >= 5 and s.spec_drafted_tokens > 0
    assert_whole(core)


def test_greedy_identical_in_a_batch_of_8_mixed_with_ngram_and_off(target_dir, draft_dir):
    ps = prompts(8)
    news = [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]
    ref = drive(tiny_core(target_dir, None, max_slots=8), news, served=True).tokens
    core = tiny_core(target_dir, draft_dir, speculation="draft:small", max_slots=8,
                     max_batched_tokens=40, prefill_chunk_tokens=9)
    draft = draft_of(core)
    ngram = NgramDrafter(min_n=1)
    core.speculator.drafter = PerRequestDrafter(
        {f"r{i}": (draft, ngram, None)[i % 3] for i in range(8) if i % 3 != 2})
    assert drive(core, news, served=True).tokens == ref
    assert core.status().spec_drafted_tokens > 0
    assert not draft._seen  # every request's drafter state went with it
    assert_whole(core)


def test_the_target_as_its_own_draft_is_accepted_nearly_always(target_dir):
    news = [greedy(f"r{i}", p, 32) for i, p in enumerate(prompts(3))]
    ref = drive(tiny_core(target_dir, None), news, served=True).tokens
    core = tiny_core(target_dir, target_dir, speculation="draft:small",
                     prefill_chunk_tokens=7)
    assert drive(core, news, served=True).tokens == ref
    s = core.status()
    assert s.spec_drafted_tokens >= 40, s
    assert s.spec_accepted_tokens >= 0.9 * s.spec_drafted_tokens, s
    assert_whole(core)


def test_sampled_requests_draft_with_the_draft_models_probabilities(target_dir):
    core = tiny_core(target_dir, target_dir, speculation="draft:small")
    news = [m.NewRequest(req_id=f"s{i}", prompt_token_ids=p, max_tokens=24, sampling=SAMPLED)
            for i, p in enumerate(prompts(2))]
    drive(core, news, served=True)
    s = core.status()
    # q = p when the draft is the target: the rejection rule accepts nearly every draft
    assert s.spec_drafted_tokens > 0 and s.spec_accepted_tokens >= 0.8 * s.spec_drafted_tokens
    assert_whole(core)


def test_ledger_whole_after_a_storm_with_cancellations(target_dir, draft_dir):
    rng = random.Random(4)
    core = tiny_core(target_dir, draft_dir, speculation="draft:small", num_blocks=40,
                     max_in_flight=5, max_slots=4, max_batched_tokens=24,
                     prefill_chunk_tokens=6, max_queue_depth=8)
    live: list[str] = []
    for i in range(160):
        inbound = m.ToEngine()
        if rng.random() < 0.3:
            base = [rng.randrange(3, 500) for _ in range(rng.randrange(2, 6))]
            inbound.new = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=base * 3,
                                        max_tokens=rng.randrange(1, 24),
                                        sampling=rng.choice([GREEDY, SAMPLED]))]
            live.append(f"r{i}")
        if live and rng.random() < 0.12:
            inbound.aborts = [m.Abort(req_id=rng.choice(live))]
        core.step(inbound)
        core.pool.check()
        for req in core.running:  # the draft never draws a block beyond the reservation
            assert len(req.block_table) <= req.num_reserved_blocks
    while core.has_work:
        core.step(None)
    assert_whole(core)
    assert core.status().spec_drafted_tokens > 0
    assert not draft_of(core)._seen


def test_a_draft_of_another_tokenizer_is_refused_naming_both(target_dir, tiny_checkpoint):
    other = tiny_checkpoint("qwen3", hidden_size=32, num_layers=1, vocab_size=384)
    with pytest.raises(ValueError, match=r"`small`.*does not share the tokenizer of `tiny`"
                                         r".*vocab_size 384 vs 512"):
        tiny_core(target_dir, other, speculation="draft:small")


def test_catch_up_reads_through_the_block_table_fake_runners():
    """A fake draft that reads its tokens back through the block tables and predicts what
    the fake target does: every draft is accepted only if the draft's catch-up wrote every
    position exactly once where the table says."""
    vocab, blocks, bs = 100, 64, 4
    spec = EngineSpec(model_id="fake", num_blocks=blocks, block_size=bs, context=256,
                      bytes_per_token=2, prefix_cache=False,
                      limits=m.Limits(anon_max_in_flight=8, spec_k=3, spec_full_below=1.0,
                                         spec_off_above=1.01))
    core = EngineCore(spec, FakeRunner(vocab, blocks, bs))
    with_drafter(core, DraftModelDrafter("fake", FakeRunner(vocab, blocks, bs),
                                         core.ensure_blocks, max_batched_tokens=5))
    rng = random.Random(2)
    news = [m.NewRequest(req_id=f"f{i}", prompt_token_ids=[rng.randrange(vocab)
                                                           for _ in range(3 + 4 * i)],
                         max_tokens=30, sampling=GREEDY) for i in range(4)]
    drive(core, news, served=True)
    s = core.status()
    assert s.spec_drafted_tokens > 50 and s.spec_accepted_tokens == s.spec_drafted_tokens
    assert_whole(core)


def fake_logits(context: list[int], vocab: int) -> torch.Tensor:
    """[vocab] what a FakeRunner's model gives after `context`."""
    one_block = FakeRunner(vocab, 1, len(context))
    return one_block.execute([SeqInput(context, 0, [0], True)])[0]


@pytest.mark.parametrize("sampled", [False, True])
def test_a_proposal_reads_the_device_back_once(monkeypatch, sampled):
    """Every draft of every request, over a catch-up of several forwards and chains of
    different lengths, reaches the host in one read: each forward's input tokens are the
    drafts of the one before, left on the device (was one read a draft of every request:
    22 here). Greedy rows draft the fake draft model's argmax chain; a seeded sampled row
    draws each draft from q = the sampler's distribution of the fake's logits after the
    drafts before it, with its own generator, in order."""
    vocab, blocks, bs = 100, 96, 4
    spec = EngineSpec(model_id="fake", num_blocks=blocks, block_size=bs, context=256,
                      bytes_per_token=2, prefix_cache=False,
                      limits=m.Limits(anon_max_in_flight=8, max_in_flight=8))
    core = EngineCore(spec, FakeRunner(vocab, blocks, bs))
    drafter = DraftModelDrafter("fake", FakeRunner(vocab, blocks, bs), core.ensure_blocks,
                                max_batched_tokens=8)  # the catch-up takes several forwards
    kinds = [GREEDY, m.SamplingParams(temperature=0.8, top_k=20, seed=5),
             m.SamplingParams(temperature=1.1), m.SamplingParams(temperature=0.7, seed=9)]
    rng = random.Random(0)
    news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=[rng.randrange(vocab)
                                                           for _ in range(3 + 3 * i)],
                         max_tokens=30, sampling=kinds[i % 4] if sampled else GREEDY)
            for i in range(7)]
    core.step(m.ToEngine(new=news))
    for _ in range(3):
        core.step()
    reqs = sorted(core.running, key=lambda r: r.req_id)
    assert len(reqs) == 7 and not any(r.is_prefilling for r in reqs)
    ks = [4, 4, 3, 1, 4, 2, 4]
    contexts = [r.token_slice(0, r.num_tokens) for r in reqs]
    gens = {}
    for r in reqs:
        gen = r.sampling_state.seeded_generator(torch.device("cpu"))
        if gen is not None:
            gens[r.req_id] = torch.Generator().set_state(gen.get_state())

    counted = CountReads()
    real_step = drafter.runner.run_step

    def model_step(seqs, **kw):  # a real runner takes the tokens without reading them
        counted.paused = True
        try:
            return real_step(seqs, **kw)
        finally:
            counted.paused = False

    monkeypatch.setattr(drafter.runner, "run_step", model_step)
    for where in (sampler_module, verify_mod):  # truncate as on a GPU: nothing read back
        monkeypatch.setattr(where, "reads_back", lambda device: False)
    with counted:
        drafts = drafter.propose_batch(reqs, ks)
    assert counted.reads == ["tolist (22,)"], (len(counted.reads), counted.reads[:2])

    for r, k, d, ctx in zip(reqs, ks, drafts, contexts, strict=True):
        assert len(d.tokens) == k
        st = r.sampling_state
        if st.greedy:
            assert d.probs is None
            for t in d.tokens:
                assert t == int(fake_logits(ctx, vocab).argmax())
                ctx = [*ctx, t]
            continue
        assert d.probs is not None and d.probs.shape == (k, vocab)
        for j, t in enumerate(d.tokens):
            q = verify_mod.target_probs(fake_logits(ctx, vocab).unsqueeze(0), st)[0]
            torch.testing.assert_close(d.probs[j], q)
            assert q[t] > 0
            if r.req_id in gens:
                assert t == int(torch.multinomial(q, 1, generator=gens[r.req_id])[0])
            ctx = [*ctx, t]
    if sampled:
        assert len(gens) == 3  # r1, r3, r5: each checked against its own generator


def test_a_draft_model_under_tensor_parallelism_is_refused(target_dir, draft_dir):
    from helexa.neuron.engine.speculative.draft_model import load_draft

    spec = EngineSpec(model_id="tiny", model_dir=str(target_dir), num_blocks=8, context=64,
                      tp=2, devices=["cpu", "cpu"], draft_model_id="small",
                      draft_model_dir=str(draft_dir))
    with pytest.raises(ValueError, match=r"draft:small.*tp = 1 only.*got tp = 2"):
        load_draft(spec, m.Limits())


def test_a_failing_draft_forward_costs_only_the_drafts(target_dir, draft_dir):
    p = prompts(1)[0]
    ref = drive(tiny_core(target_dir, None), [greedy("r", p, 20)], served=True).tokens
    core = tiny_core(target_dir, draft_dir, speculation="draft:small")
    runner = draft_of(core).runner
    calls = {"n": 0}
    real = runner.execute

    def flaky(seqs, tokens=None):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("draft forward failed")
        return real(seqs, tokens)

    runner.execute = flaky
    assert drive(core, [greedy("r", p, 20)], served=True).tokens == ref
    assert calls["n"] >= 3 and core.num_failed_steps == 0
    assert_whole(core)


def test_prefix_cache_hits_keep_output_and_acceptance(target_dir):
    """Requests reusing cached prefix blocks: the draft recomputes its own layers for the
    reused positions (the target's cached KV is not touched), output unchanged."""
    rng = random.Random(9)
    system = [rng.randrange(3, 500) for _ in range(24)]
    ps = [system + [rng.randrange(3, 500) for _ in range(5 + i)] for i in range(4)]
    ref = drive(tiny_core(target_dir, None), [greedy(f"r{i}", p, 16) for i, p in enumerate(ps)],
                served=True).tokens
    core = tiny_core(target_dir, target_dir, speculation="draft:small")
    got: dict[str, list[int]] = {}
    cached = 0
    for i, p in enumerate(ps):  # one after another: later ones hit the filed prefix
        run = drive(core, [greedy(f"r{i}", p, 16)])
        got.update(run.tokens)
        cached += sum(u.cached_tokens for u in run.admitted.values())
    assert got == ref and cached >= 3 * 16
    s = core.status()
    assert s.spec_accepted_tokens >= 0.9 * s.spec_drafted_tokens > 0
    assert_whole(core)


def test_a_speculated_reply_is_cached_for_the_next_turn_as_a_plain_one(target_dir):
    """A verification row's accepted drafts are keyed with its block: the next turn, which
    repeats the reply, hits as far as after a reply decoded without drafts."""
    p = prompts(1, seed=4)[0]
    hits = []
    for draft in (None, target_dir):
        core = tiny_core(target_dir, draft, speculation="draft:small" if draft else "off")
        reply = drive(core, [greedy("t0", p, 40)], served=True).tokens["t0"]
        run = drive(core, [greedy("t1", p + reply + [7, 8, 9], 4)], served=True)
        hits.append(run.admitted["t1"].cached_tokens)
        assert_whole(core)
    assert core.status().spec_accepted_tokens >= 30
    assert hits[1] == hits[0] >= (len(p) + 40) // 8 * 8 - 8, (hits, len(p))


def test_a_kv_dtype_switch_replans_the_drafts_layers_with_the_targets(target_dir):
    core = tiny_core(target_dir, target_dir, speculation="draft:small")
    draft = draft_of(core).runner
    bpt = 2 * kv_bytes_per_token(read_model_shape(target_dir / "config.json"), 1, "int8")
    assert core.reset_kv(m.ResetKv(num_blocks=50, kv_dtype="int8", bytes_per_token=bpt,
                                   context=256)) == "ok"
    assert (draft.num_blocks, draft.kv_dtype) == (50, "int8") == (core.runner.num_blocks,
                                                                   core.runner.kv_dtype)
    assert core.pool.bytes_per_block == core.runner.kv_bytes_per_block + draft.kv_bytes_per_block
    drive(core, [greedy("r", prompts(1)[0], 24)], served=True)
    s = core.status()
    assert s.spec_accepted_tokens >= 0.9 * s.spec_drafted_tokens > 0
    assert_whole(core)


def test_a_hybrid_target_drafts_with_a_dense_draft_model(tiny_checkpoint, draft_dir):
    """qwen3_5 target (its linear-attention state rolls back) and a dense draft of the
    same tokenizer: greedy output unchanged, drafts verified, ledger (and slots) whole."""
    target = tiny_checkpoint("qwen3_5")
    news = [greedy(f"r{i}", p, 24) for i, p in enumerate(prompts(3))]
    ref = drive(tiny_core(target, None), news, served=True).tokens
    core = tiny_core(target, draft_dir, speculation="draft:small", prefill_chunk_tokens=8)
    assert core.spec.num_state_slots > 0  # a hybrid pool: blocks and state slots
    assert drive(core, news, served=True).tokens == ref
    assert core.status().spec_drafted_tokens > 0
    assert_whole(core)


def test_a_hybrid_draft_model_is_refused(target_dir, tiny_checkpoint):
    with pytest.raises(ValueError, match=r"`small` is a hybrid.*must be dense"):
        tiny_core(target_dir, tiny_checkpoint("qwen3_5"), speculation="draft:small")
