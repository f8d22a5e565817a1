"""Prefix reuse on hybrid (Gated DeltaNet) models: an agent session whose every turn repeats
the last one and appends a reply and a tool result hits the cache at a snapshot of the
linear-attention state, and gets exactly a cold server's tokens; a storm that evicts
blocks and snapshots leaves the ledger whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.engine import Run, assert_whole, drive, storm, truth_from, with_drafter
from support.mtp import SPEC

from helexa.checkpoint.memory import kv_bytes_per_token
from helexa.checkpoint.shape import read_model_shape
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import (
    AdversarialDrafter,
    NgramDrafter,
    OracleDrafter,
    PerRequestDrafter,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = m.SamplingParams(temperature=0.0)


def core_for(model_dir: Path, *, prefix_cache: bool = True, num_blocks: int = 400,
             num_snapshot_slots: int | None = None, checkpoint_tokens: int = 4096,
             block_size: int = 8, **limits) -> EngineCore:
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=num_blocks,
                      block_size=block_size, context=2048, prefix_cache=prefix_cache, bytes_per_token=0,
                      num_snapshot_slots=num_snapshot_slots,
                      prefix_checkpoint_tokens=checkpoint_tokens,
                      limits=m.Limits(anon_max_in_flight=64, **limits))
    return EngineCore(spec)


def turn(rid: str, prompt: list[int], max_tokens: int = 16) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY)


def scored(core: EngineCore, prompt: list[int]) -> tuple[Run, list[float]]:
    """Request "b" of `prompt` on `core`, with its sampled tokens' logprobs."""
    logprobs: list[float] = []
    new = m.NewRequest(req_id="b", prompt_token_ids=prompt, max_tokens=16,
                       sampling=m.SamplingParams(temperature=0.0, logprobs=True))
    run = drive(core, [new], served=True, on_update=lambda u: logprobs.extend(
        lp.logprob for lp in u.logprobs or ()))
    return run, logprobs


def session(warm: EngineCore, cold: EngineCore, turns: int, seed: int,
            max_tokens: int = 16) -> list[int]:
    """An agent session on both engines: each turn is the last turn's prompt, its reply and
    a tool result. Asserts equal tokens every turn, and that each turn hits the cache up to
    the last block boundary the last turn computed, its reply's too (its last token is
    sampled, never computed), speculating or not; returns each turn's cached tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(90)]
    cached: list[int] = []
    reach = 0  # the last turn's last block boundary: prompt and reply less its last token
    for t in range(turns):
        got = drive(warm, [turn(f"w{t}", prompt, max_tokens)], served=True)
        want = drive(cold, [turn(f"c{t}", prompt, max_tokens)], served=True).tokens[f"c{t}"]
        assert got.tokens[f"w{t}"] == want, f"turn {t}"
        cached.append(got.admitted[f"w{t}"].cached_tokens)
        assert cached[t] == reach, (t, cached[t], reach)
        reach = (len(prompt) + len(want) - 1) // 8 * 8
        prompt = prompt + want + [rng.randrange(3, 500) for _ in range(rng.randrange(9, 40))]
    return cached


# qwen3_next's cache path is qwen3_5's (the same Gated DeltaNet and attention layers and
# states; its MoE MLP holds nothing a turn keeps): under -m slow
@pytest.mark.parametrize("arch", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_agent_session_hits_every_turn_with_a_cold_servers_tokens(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    warm, cold = core_for(model_dir), core_for(model_dir, prefix_cache=False)
    assert warm.spec.prefix_cache and not cold.spec.prefix_cache
    assert warm.pool.snapshots is not None and cold.pool.snapshots is None
    cached = session(warm, cold, 12, seed=3)
    assert cached[0] == 0 and all(cached[1:])
    assert_whole(warm, hybrid=True)
    led = warm.pool.ledger()
    assert led.cached_bytes >= led.snapshot_cached_bytes > 0 and warm.pool.num_cached_blocks


def test_checkpoints_inside_a_long_prompt_serve_a_diverging_one(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    warm = core_for(model_dir, checkpoint_tokens=96, prefill_chunk_tokens=512)
    cold = core_for(model_dir, prefix_cache=False)
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(300)]
    drive(warm, [turn("a", shared + [7] * 20)], served=True)
    b = shared + [rng.randrange(3, 500) for _ in range(5)]  # diverges after 300 tokens:
    # the last checkpoint before, at 288, is the hit (a's prompt-end one is at 320)
    got, warm_logprobs = scored(warm, b)
    assert got.admitted["b"].cached_tokens == 288
    cold_run, cold_logprobs = scored(cold, b)
    assert got.tokens["b"] == cold_run.tokens["b"]
    # the restored state is the one a cold prefill reaches, not merely close enough to it
    # for the same greedy tokens
    assert warm_logprobs == pytest.approx(cold_logprobs, abs=1e-4)
    assert_whole(warm, hybrid=True)


def test_session_with_ngram_speculation_keeps_a_cold_servers_tokens(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    warm = with_drafter(core_for(model_dir, spec_k=3, spec_full_below=1.0,
                                 spec_off_above=1.01), NgramDrafter(min_n=1))
    cold = core_for(model_dir, prefix_cache=False)
    session(warm, cold, 12, seed=3)
    assert warm.status().spec_drafted_tokens > 0
    assert_whole(warm, hybrid=True)


def test_session_with_mtp_speculation_keeps_a_cold_servers_tokens(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    warm = core_for(model_dir, speculation="mtp", **SPEC)
    cold = core_for(model_dir, prefix_cache=False)
    assert warm.status().drafter == "mtp"
    session(warm, cold, 8, seed=4)
    assert warm.status().spec_drafted_tokens > 0
    assert_whole(warm, hybrid=True)


def speculating(model_dir: Path, drafter: str, draft_dir: Path | None = None,
                **kw) -> EngineCore:
    """A prefix-caching core that drafts with `drafter` on every decode step it can: "mtp"
    (the checkpoint's head), "draft" (a dense `draft_dir`), or "ngram" (where its context
    repeats a token)."""
    if drafter == "ngram":
        return with_drafter(core_for(model_dir, **SPEC, **kw), NgramDrafter(min_n=1))
    if drafter == "mtp":
        return core_for(model_dir, speculation="mtp", **SPEC, **kw)
    assert draft_dir is not None
    bpt = [kv_bytes_per_token(read_model_shape(d / "config.json"), 1, "auto")
           for d in (model_dir, draft_dir)]
    return EngineCore(EngineSpec(
        model_id="tiny", model_dir=str(model_dir), num_blocks=400, block_size=8, context=2048,
        bytes_per_token=sum(bpt), draft_model_id="small", draft_model_dir=str(draft_dir),
        draft_bytes_per_token=bpt[1],
        limits=m.Limits(anon_max_in_flight=64, speculation="draft:small", **SPEC, **kw)))


@pytest.mark.parametrize("drafter", ["mtp", "draft", "ngram"])
def test_a_speculated_reply_is_restored_as_a_cold_server_computes_it(
        tiny_checkpoint, drafter):
    """A reply whose steps verified drafts is snapshotted at its block boundaries as a
    plainly decoded one is: the next turn hits up to its last boundary, and its tokens and
    logprobs are a cold server's (the snapshot is the accepted tokens' state, exactly)."""
    model_dir = tiny_checkpoint("qwen3_5", **({"mtp": True} if drafter == "mtp" else {}))
    draft_dir = tiny_checkpoint("qwen3", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=7)
    warm = speculating(model_dir, drafter, draft_dir)
    cold = core_for(model_dir, prefix_cache=False)
    rng = random.Random(12)
    prompt = [rng.randrange(3, 500) for _ in range(45)]
    reply = drive(warm, [turn("a", prompt, 48)], served=True).tokens["a"]
    assert reply == drive(cold, [turn("c", prompt, 48)], served=True).tokens["c"]
    s = warm.status()
    assert s.spec_drafted_tokens >= 15 and s.drafter != "off", s
    got, warm_logprobs = scored(warm, prompt + reply + [5, 6, 7])
    assert got.admitted["b"].cached_tokens == (len(prompt) + len(reply) - 1) // 8 * 8
    cold_run, cold_logprobs = scored(cold, prompt + reply + [5, 6, 7])
    assert got.tokens["b"] == cold_run.tokens["b"]
    assert warm_logprobs == pytest.approx(cold_logprobs, abs=1e-4)
    assert_whole(warm, hybrid=True)


def test_a_row_across_two_boundaries_keeps_the_snapshot_at_the_later(tiny_checkpoint):
    """With blocks of 4 and 6 drafts a row, every right draft accepted, a verification row
    of 7 positions crosses two block boundaries: the reply is snapshotted at the later one,
    as plain decoding leaves it, and the next turn hits up to the reply's last boundary with
    a cold server's tokens."""
    model_dir = tiny_checkpoint("qwen3_5")
    cold = core_for(model_dir, prefix_cache=False, block_size=4)
    rng = random.Random(21)
    prompt = [rng.randrange(3, 500) for _ in range(5)]
    reply = drive(cold, [turn("c", prompt, 20)], served=True).tokens["c"]
    warm = with_drafter(core_for(model_dir, block_size=4, spec_k=6, spec_full_below=1.0,
                                 spec_off_above=1.01, spec_min_acceptance=0.0),
                        OracleDrafter(truth_from({"a": reply}, {"a": prompt})))
    run = drive(warm, [turn("a", prompt, 20)], served=True)
    assert run.tokens["a"] == reply
    # rows from positions 5, 12 and 19 (6, 6 and 4 drafts): the last crosses 20 and 24
    assert run.steps <= 5 and warm.status().spec_accepted_tokens == 16
    nxt = prompt + reply + [5, 6, 7]
    got = drive(warm, [turn("b", nxt)], served=True)
    assert got.admitted["b"].cached_tokens == len(prompt) + len(reply) - 1 == 24
    assert got.tokens["b"] == drive(cold, [turn("d", nxt)], served=True).tokens["d"]
    assert_whole(warm, hybrid=True)


def test_a_row_whose_drafts_fall_short_of_its_boundary_evicts_no_snapshot(tiny_checkpoint):
    """The one snapshot slot holds a's prompt snapshot; b's verification row crosses a block
    boundary but its drafts are rejected, and b stops before reaching it: a's snapshot is
    still there for a's next turn, whose tokens are a cold server's."""
    model_dir = tiny_checkpoint("qwen3_5")
    cold = core_for(model_dir, prefix_cache=False)
    rng = random.Random(4)
    a, b = ([rng.randrange(3, 500) for _ in range(n)] for n in (12, 5))
    b_reply = drive(cold, [turn("cb", b)], served=True).tokens["cb"]
    assert b_reply[0] != b_reply[1]  # b stops at its second token, after one row
    drafter = AdversarialDrafter(truth_from({"b": b_reply}, {"b": b}), vocab_size=512)
    warm = with_drafter(core_for(model_dir, num_snapshot_slots=1, spec_k=3,
                                 spec_full_below=1.0, spec_off_above=1.01,
                                 spec_min_acceptance=0.0), PerRequestDrafter({"b": drafter}))
    drive(warm, [turn("a", a, 2)], served=True)
    snaps = warm.pool.snapshots
    assert snaps is not None and snaps.num_cached == 1  # a's, at 8
    stop = m.NewRequest(req_id="b", prompt_token_ids=b, max_tokens=16, sampling=GREEDY,
                        stop_token_ids=[b_reply[1]])
    got = drive(warm, [stop], served=True)
    assert got.tokens["b"] == b_reply[:2] and got.final["b"].finished == m.FinishReason.STOP
    s = warm.status()  # its row, positions 5 to 8, verified 3 drafts and kept none
    assert (s.spec_drafted_tokens, s.spec_accepted_tokens) == (3, 0)
    again = a + [7, 8, 9]
    hit = drive(warm, [turn("a2", again)], served=True)
    assert hit.admitted["a2"].cached_tokens == 8
    assert hit.tokens["a2"] == drive(cold, [turn("c2", again)], served=True).tokens["c2"]
    assert_whole(warm, hybrid=True)


def test_tensor_parallel_mtp_session_snapshots_its_replies_on_every_rank(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=400, block_size=8,
                      context=2048, bytes_per_token=0, tp=2, devices=["cpu", "cpu"],
                      limits=m.Limits(anon_max_in_flight=64, speculation="mtp", **SPEC))
    warm = EngineCore(spec)
    try:
        session(warm, core_for(model_dir, prefix_cache=False), 3, seed=8, max_tokens=40)
        assert warm.status().spec_drafted_tokens > 0
        assert_whole(warm, hybrid=True)
    finally:
        warm.close()


def test_tensor_parallel_session_restores_on_every_rank(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=400, block_size=8,
                      context=2048, bytes_per_token=0, tp=2, devices=["cpu", "cpu"],
                      limits=m.Limits(anon_max_in_flight=64))
    warm = EngineCore(spec)
    try:
        session(warm, core_for(model_dir, prefix_cache=False), 4, seed=6)
        assert_whole(warm, hybrid=True)
    finally:
        warm.close()


def test_a_grammar_constrained_turn_on_a_hit_is_a_cold_servers_and_parses(tiny_checkpoint):
    import json

    from helexa import grammar
    from helexa.neuron.tokenizer import Tokenizer

    model_dir = tiny_checkpoint("qwen3_5")
    tok = Tokenizer.from_dir(model_dir)
    schema = {"type": "object", "additionalProperties": False, "required": ["file", "line"],
              "properties": {"file": {"type": "string", "maxLength": 16},
                             "line": {"type": "integer", "minimum": 0, "maximum": 999}}}
    chat = [{"role": "user", "content": "Find the bug in the parser, then report it. " * 6}]
    first = tok.encode_chat(chat)
    warm, cold = core_for(model_dir), core_for(model_dir, prefix_cache=False)
    reply = drive(warm, [turn("w0", first)], served=True).tokens["w0"]
    chat += [{"role": "assistant", "content": tok.decode(reply)},
             {"role": "user", "content": "Report it as JSON."}]
    second = tok.encode_chat(chat)

    def constrained(rid: str) -> m.NewRequest:
        return m.NewRequest(req_id=rid, prompt_token_ids=second, max_tokens=80,
                            sampling=GREEDY, stop_token_ids=tok.eos_token_ids,
                            grammar=grammar.grammar_text(grammar.json_schema(schema)))

    got = drive(warm, [constrained("w1")], served=True)
    want = drive(cold, [constrained("c1")], served=True).tokens["c1"]
    assert got.tokens["w1"] == want and got.admitted["w1"].cached_tokens >= 0.9 * len(first)
    assert got.final["w1"].finished == m.FinishReason.STOP
    assert set(json.loads(tok.decode(want))) == {"file", "line"}
    assert_whole(warm, hybrid=True)


def test_storm_evicting_blocks_and_snapshots_leaves_the_ledger_whole(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    core = core_for(model_dir, num_blocks=60, num_snapshot_slots=3, checkpoint_tokens=16,
                    max_in_flight=4, max_slots=4, max_batched_tokens=64,
                    prefill_chunk_tokens=24, max_queue_depth=64, max_per_principal=64)
    rng = random.Random(11)
    stems = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
    news = [turn(f"r{i}", rng.choice(stems)[:rng.randrange(17, 40)]
                 + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))],
                 rng.randrange(2, 20)) for i in range(40)]
    hits = storm(core, news, {n.req_id for n in news[::3]})
    assert hits and core.pool.num_evicted_total and core.pool.snapshots is not None
    assert core.pool.snapshots.num_evicted_total
    assert_whole(core, hybrid=True)


def test_pool_pins_a_hit_snapshot_and_drops_one_whose_block_is_evicted():
    from helexa.neuron.engine.block_key import hash_block_tokens
    from helexa.neuron.engine.block_pool import BlockPool

    pool = BlockPool(3, 2, bytes_per_block=10, num_state_slots=1, fixed_bytes=100,
                     num_snapshot_slots=2)
    snaps = pool.snapshots
    assert snaps is not None and list(snaps.slots) == [1, 2]  # after the request slot
    k1 = hash_block_tokens(None, [1, 2])
    k2 = hash_block_tokens(k1, [3, 4])
    assert pool.reserve("a", 2)
    blocks = [pool.draw("a"), pool.draw("a")]
    pool.register(blocks[0], k1)
    pool.register(blocks[1], k2)
    s1, s2 = snaps.take("a"), snaps.take("a")
    assert (s1, s2, snaps.take("a")) == (1, 2, -1)  # none left: that snapshot is skipped
    assert pool.ledger().used_bytes == 20 + 100 + 200  # blocks, the state, two being written
    assert snaps.file("a", s1, k1) and snaps.file("a", s2, k2)
    pool.release("a")
    led = pool.ledger()
    assert (led.cached_bytes, led.snapshot_cached_bytes, led.free_bytes) == (220, 200, 330)
    assert snaps.lookup(k2) == 2 and snaps.lookup(hash_block_tokens(k1, [3, 5])) is None
    # a hit on both blocks pins the snapshot after them with the blocks, in one reservation
    assert pool.reserve("b", 1, blocks, restore=2) and snaps.restoring("b") == 2
    assert pool.ledger().used_bytes == 20 + 200  # the blocks and the pinned snapshot
    assert snaps.take("b") == 1  # evicts the older cached snapshot, never the pinned one
    pool.release("b")
    pool.check()
    assert snaps.restoring("b") == -1 and snaps.lookup(k1) is None and snaps.lookup(k2) == 2
    # a new reservation that evicts k2's block drops the snapshot filed under it
    assert pool.reserve("c", 3) and snaps.lookup(k2) is None
    pool.release("c")
    pool.check()
    assert pool.ledger().free_bytes == pool.ledger().total_bytes == 330


def test_a_steps_fresh_restored_and_saved_slots_reach_the_device_once(tiny_checkpoint,
                                                                      monkeypatch):
    """Clearing a new request's slots, restoring a snapshot and saving one touch every
    linear-attention layer's state; their slot indices go to the device once a step for
    all the layers (each a pinned copy on a GPU), not once a layer, and the states are
    those of copying per layer."""
    from helexa.kernels import linear_state
    from helexa.kernels.backends import gdn
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

    path = tiny_checkpoint("qwen3_5")
    r = ModelRunner(path, num_blocks=16, block_size=8, max_num_seqs=2, max_batched_tokens=64,
                    num_state_slots=4, backend="torch")
    copies: list[str] = []
    for module in (linear_state, gdn):
        real = module.to_device
        monkeypatch.setattr(module, "to_device", lambda v, dt, dev, _r=real, _m=module.__name__:
                            copies.append(_m) or _r(v, dt, dev))
    layers = sum(1 for t in r.model.cfg.layer_types if t == "linear_attention")
    assert layers >= 2
    a = list(range(1, 9))
    first = r.execute([SeqInput(a, 0, [0], True, 0, save_to=2)])  # fresh slot 0, saved to 2
    copies.clear()
    again = r.execute([SeqInput(a, 0, [1], True, 1, save_to=3)])  # fresh 1; save to 3
    # the fresh slot (gdn) and the save's pair (linear_state.pair_indices) once each, where
    # each layer made one of each
    assert copies.count("helexa.kernels.linear_state") == 1 < layers
    torch.testing.assert_close(again, first)
    follow = r.execute([SeqInput([9], 8, [0, 2], True, 0)])
    copies.clear()
    resumed = r.execute([SeqInput([9], 8, [1, 3], True, 1, restore_from=2)])  # from the save
    assert copies.count("helexa.kernels.linear_state") == 1 < layers
    torch.testing.assert_close(resumed, follow)
    r.close()
