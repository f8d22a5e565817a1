"""The prefix cache's host tier (kv.host_cache_mb): an agent whose session another user's
long prompt pushed out of the device pool resumes from host memory, with a cold server's
tokens, on dense and hybrid models and across tensor-parallel ranks; the pool and the tier
keep their invariants through a storm of evictions."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine import assert_whole, drive, storm
from support.fake_runner import FakeRunner

from helexa.kernels import host_kv
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.block_key import hash_block_tokens
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.host_tier import HostTier, KvMoves, host_tier_size
from helexa.neuron.engine.spec import EngineSpec

GREEDY = m.SamplingParams(temperature=0.0)


def turn(rid: str, prompt: list[int], max_tokens: int = 16) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY)


def keys(tokens: list[int], bs: int) -> list:
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


# --- mechanism -----------------------------------------------------------------------


def test_sizes_follow_the_device_pools_mix():
    assert host_tier_size(1000, 10, 10) == (100, 0)
    # device: 10 blocks of 10 B and 2 snapshots of 50 B, 200 B; twice that on the host
    assert host_tier_size(400, 10, 10, 2, 50) == (20, 4)
    assert host_tier_size(0, 10, 10, 2, 50) == (0, 0)


def test_an_evicted_chain_is_copied_out_and_a_later_hit_copies_it_back():
    host = HostTier(4, 10)
    pool = BlockPool(4, 2, 10, host=host)
    ks = keys([1, 2, 3, 4, 5, 6], 2)
    assert pool.reserve("a", 3)
    blocks = [pool.draw("a") for _ in range(3)]
    for b, k in zip(blocks, ks, strict=True):
        pool.register(b, k)
    pool.release("a")
    assert pool.reserve("b", 4)  # takes every block: the chain is evicted to the host
    moves = host.take_moves()
    assert sorted(d for d, _ in moves.blocks_out) == sorted(blocks) and not moves.blocks_in
    assert host.match(ks) == [h for _, h in sorted(moves.blocks_out,
                                                   key=lambda p: blocks.index(p[0]))]
    pool.release("b")
    led = pool.ledger()
    assert (led.host_total_bytes, led.host_cached_bytes) == (40, 30)
    # a hit on the host restores the chain into fresh blocks, filed at once
    on_host = host.match(ks)
    assert pool.reserve("c", 3, (), -1, list(zip(on_host, ks, strict=True)))
    restored = pool.restored_blocks("c")
    moves = host.take_moves()
    assert moves.blocks_in == list(zip(on_host, restored, strict=True))
    assert pool.match_prefix(ks) == restored and pool.num_reserved_for("c") == 0
    pool.release("c")
    pool.check()
    assert pool.ledger().free_bytes == pool.ledger().total_bytes


def test_a_host_block_pinned_for_a_copy_in_is_never_evicted_for_a_copy_out():
    host = HostTier(2, 10)
    pool = BlockPool(3, 1, 10, host=host)
    ks = keys([1, 2, 3], 1)
    for i, k in enumerate(ks):  # three single-block requests, each filed and released
        assert pool.reserve(f"r{i}", 1)
        pool.register(pool.draw(f"r{i}"), k)
        pool.release(f"r{i}")
    assert pool.reserve("x", 3)  # evicts all three; the host keeps the last two
    host.take_moves()
    pool.release("x")  # x's blocks were never filed: all free
    assert host.blocks.lookup(ks[0]) is None and host.match(ks[1:2]) != []
    # restore ks[1] while the same reservation's evictions want room on the host
    pool2_hit = host.match(ks[1:2])
    for i, k in enumerate(keys([7, 8, 9], 1)):
        assert pool.reserve(f"y{i}", 1)
        pool.register(pool.draw(f"y{i}"), k)
        pool.release(f"y{i}")
    assert pool.reserve("z", 3, (), -1, [(pool2_hit[0], ks[1])])
    moves = host.take_moves()
    assert moves.blocks_in == [(pool2_hit[0], pool.restored_blocks("z")[0])]
    assert all(h != pool2_hit[0] for _, h in moves.blocks_out)  # never the pinned one
    pool.release("z")
    pool.check()


def test_a_block_restored_into_twice_in_one_intake_keeps_the_later_copy():
    """c's restore lands in block B; c ends before its step (an abort), B goes back filed,
    and d's reservation in the same intake evicts B and restores another host block into
    it. Only d's copy may run: both in one scatter would leave either write on CUDA."""
    host = HostTier(4, 10)
    pool = BlockPool(1, 1, 10, host=host)
    k1, k2 = keys([1], 1)[0], keys([2], 1)[0]
    for i, k in enumerate((k1, k2)):
        assert pool.reserve(f"r{i}", 1)
        pool.register(pool.draw(f"r{i}"), k)
        pool.release(f"r{i}")
    assert pool.reserve("x", 1)  # the last one out to the host too
    host.take_moves()
    pool.release("x")
    (h1,), (h2,) = host.match([k1]), host.match([k2])
    assert pool.reserve("c", 1, (), -1, [(h1, k1)])
    pool.release("c")
    assert pool.reserve("d", 1, (), -1, [(h2, k2)])
    (b,) = pool.restored_blocks("d")
    assert host.take_moves().blocks_in == [(h2, b)]
    assert pool.match_prefix([k2]) == [b] and pool.match_prefix([k1]) == []
    pool.release("d")
    pool.check()
    host.check()  # both host blocks unpinned


# --- an engine (the fake runner keeps token ids as its KV: a wrong copy changes output) --


def fake_core(host_cache_mb: int, num_blocks: int = 40) -> tuple[EngineCore, FakeRunner]:
    runner = FakeRunner(512, num_blocks, 4)
    runner.kv_bytes_per_block = 4096  # type: ignore[misc]  # 256 blocks a MiB
    spec = EngineSpec(model_id="fake", num_blocks=num_blocks, block_size=4, context=160,
                      host_cache_mb=host_cache_mb, limits=m.Limits(anon_max_in_flight=8))
    return EngineCore(spec, runner=runner), runner


def pushed_out_session(core: EngineCore, turns: int, seed: int) -> list[tuple[list[int], int]]:
    """An agent session; between its turns another caller's long prompt fills the pool.
    Returns each turn's (tokens, cached tokens)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(30)]
    out = []
    for t in range(turns):
        got = drive(core, [turn(f"a{t}", prompt, 8)], served=True)
        out.append((got.tokens[f"a{t}"], got.admitted[f"a{t}"].cached_tokens))
        other = [rng.randrange(3, 500) for _ in range(154)]  # with its 4: the whole pool
        drive(core, [turn(f"b{t}", other, 4)], served=True)
        prompt = prompt + got.tokens[f"a{t}"] + [rng.randrange(3, 500) for _ in range(5)]
    return out


def test_a_session_pushed_out_of_the_pool_resumes_from_host_memory():
    warm, runner = fake_core(host_cache_mb=1)
    without, _ = fake_core(host_cache_mb=0)
    cold, _ = fake_core(host_cache_mb=0)
    cold.prefix_cache = cold.admission.prefix_cache = False
    got = pushed_out_session(warm, 5, seed=1)
    plain = pushed_out_session(without, 5, seed=1)
    want = pushed_out_session(cold, 5, seed=1)
    assert [t for t, _ in got] == [t for t, _ in want] == [t for t, _ in plain]
    assert all(c == 0 for _, c in plain)  # the long prompts do push the session out
    prompts = [30 + sum(len(t) + 5 for t, _ in got[:i]) for i in range(len(got))]
    for i in range(1, len(got)):  # ... and the host tier brings it back
        assert got[i][1] >= 0.9 * prompts[i - 1], (i, got[i][1], prompts[i - 1])
    st = warm.status()
    assert st.prefix_host_hit_tokens > 0 and st.host_restored_blocks > 0 and runner.num_moves
    led = warm.pool.ledger()
    assert led.host_total_bytes == 2**20  # 1 MiB of 4,096 B blocks
    assert 0 < led.host_cached_bytes <= led.host_total_bytes
    assert_whole(warm)


def test_a_failed_copy_fails_only_the_restoring_request_and_empties_the_tier():
    core, runner = fake_core(host_cache_mb=1)
    prompt = list(range(3, 33))
    drive(core, [turn("a", prompt, 4)], served=True)
    drive(core, [turn("b", list(range(100, 254)), 4)], served=True)

    def broken(moves):
        raise RuntimeError("copy failed")

    runner.move_kv = broken  # type: ignore[method-assign]
    run = drive(core, [turn("c", prompt, 4)])
    assert "host tier" in run.final["c"].error
    assert core.pool.host is not None and core.pool.host.blocks.num_filed == 0
    del runner.move_kv  # the class's again
    again = drive(core, [turn("d", prompt, 4)], served=True)
    assert again.tokens["d"]
    assert_whole(core)


# --- real models ------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model_core(model_dir: Path, *, prefix_cache: bool = True, host_cache_mb: int = 0,
               **kw) -> EngineCore:
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=120, block_size=8,
                      context=960, prefix_cache=prefix_cache, bytes_per_token=0,
                      host_cache_mb=host_cache_mb, num_snapshot_slots=4,
                      limits=m.Limits(anon_max_in_flight=8), **kw)
    return EngineCore(spec)


def model_session(warm: EngineCore, cold: EngineCore, turns: int, seed: int) -> list[int]:
    """A session on both engines, another caller's 900-token prompt between turns (it takes
    most of the pool and half the snapshot slots). Asserts a cold server's tokens each turn and
    cached_tokens >= 0.9 of the last prompt; returns each turn's cached tokens."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(60)]
    cached, previous = [], 0
    for t in range(turns):
        got = drive(warm, [turn(f"w{t}", prompt, 8)], served=True)
        want = drive(cold, [turn(f"c{t}", prompt, 8)], served=True).tokens[f"c{t}"]
        assert got.tokens[f"w{t}"] == want, f"turn {t}"
        cached.append(got.admitted[f"w{t}"].cached_tokens)
        if previous:
            assert cached[t] >= 0.9 * previous, (t, cached[t], previous)
        previous = len(prompt)
        other = [rng.randrange(3, 500) for _ in range(900)]
        drive(warm, [turn(f"o{t}", other, 2)], served=True)
        prompt = prompt + want + [rng.randrange(3, 500) for _ in range(rng.randrange(9, 20))]
    return cached


# qwen3_next's cache path is qwen3_5's (the same Gated DeltaNet and attention layers and
# states; its MoE MLP holds nothing a turn keeps): under -m slow
@pytest.mark.parametrize("arch", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow),
                                  "qwen3"])
def test_a_16_turn_session_pushed_out_every_turn_keeps_a_cold_servers_tokens(
        tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    warm = model_core(model_dir, host_cache_mb=4)
    cold = model_core(model_dir, prefix_cache=False)
    assert warm.pool.host is not None
    cached = model_session(warm, cold, 16, seed=2)
    assert cached[0] == 0 and all(cached[1:])
    st = warm.status()
    assert st.prefix_host_hit_tokens > 0 and st.host_restored_blocks > 0
    host = warm.pool.host
    if arch != "qwen3":
        assert host.num_restored_snapshots > 0 and host.num_offloaded_snapshots > 0
    assert_whole(warm, hybrid=arch != "qwen3")


def test_tensor_parallel_ranks_each_restore_their_shard(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    warm = model_core(model_dir, host_cache_mb=4, tp=2, devices=["cpu", "cpu"])
    try:
        model_session(warm, model_core(model_dir, prefix_cache=False), 4, seed=7)
        assert warm.status().prefix_host_hit_tokens > 0
        assert_whole(warm, hybrid=True)
    finally:
        warm.close()


def test_a_failed_copy_on_another_rank_fails_the_restoring_request_not_the_group(
        tiny_checkpoint):
    """Rank 1's copies in fail (its host twins replaced by one-block ones after a turn was
    pushed out to the host, so the rows it should restore are not there): the request
    restoring them fails with an error naming rank 1, the tier is emptied, and the group
    serves on; with rank 1's twins whole again a session resumes from the host, its
    tokens a cold server's."""
    model_dir = tiny_checkpoint("qwen3_5")
    warm = model_core(model_dir, host_cache_mb=4, tp=2, devices=["cpu", "cpu"])
    cold = model_core(model_dir, prefix_cache=False)
    try:
        tp, host = warm.runner._tp, warm.pool.host
        assert tp is not None and host is not None
        rng = random.Random(4)
        prompt = [rng.randrange(3, 500) for _ in range(60)]
        drive(warm, [turn("w0", prompt, 8)], served=True)
        for other in ("o0", "o1"):  # two others' prompts push the first out to the host
            drive(warm, [turn(other, [rng.randrange(3, 500) for _ in range(900)], 2)],
                  served=True)
        tp.allocate_host(1, 1)  # rank 1 alone
        run = drive(warm, [turn("w1", prompt, 8)])
        error = run.final["w1"].error
        assert "host tier" in error and "tensor-parallel rank 1: IndexError" in error, error
        assert host.blocks.num_filed == 0
        tp.allocate_host(host.blocks.num_slots, host.snapshots.num_slots)
        model_session(warm, cold, 3, seed=9)  # asserts a cold server's tokens each turn
        assert warm.status().prefix_host_hit_tokens > 0
        assert_whole(warm, hybrid=True)
    finally:
        warm.close()


def test_a_storm_through_both_tiers_leaves_the_ledger_whole(tiny_checkpoint):
    """Requests sharing three stems, a third of them aborted mid-stream, on a pool and a
    host tier both too small for them: every step keeps both tiers' invariants."""
    model_dir = tiny_checkpoint("qwen3_5")
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=40, block_size=8,
                      context=320, bytes_per_token=0, host_cache_mb=1, num_snapshot_slots=3,
                      prefix_checkpoint_tokens=16,
                      limits=m.Limits(anon_max_in_flight=4, max_in_flight=4, max_slots=4,
                                      max_batched_tokens=64, prefill_chunk_tokens=24,
                                      max_queue_depth=64, max_per_principal=64))
    core = EngineCore(spec)
    host = core.pool.host
    assert host is not None and host.blocks.num_slots > 0
    host.blocks = type(host.blocks)(24)  # smaller than the stems: the host evicts too
    rng = random.Random(12)
    stems = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    news = [turn(f"r{i}", rng.choice(stems)[:rng.randrange(17, 60)]
                 + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))],
                 rng.randrange(2, 20)) for i in range(48)]
    storm(core, news, {n.req_id for n in news[::3]})
    assert core.status().prefix_host_hit_tokens > 0 and host.blocks.num_evicted_total
    assert host.num_restored_snapshots
    assert_whole(core, hybrid=True)


def test_a_kv_dtype_switch_re_plans_the_host_tier_with_the_pool(tiny_checkpoint, monkeypatch):
    """A profile's kv_dtype switch (ResetKv) drops the pool and the tier together (the old
    twins, which hold the old pool's tensors, before the new pool is made: both at once
    would not fit a GPU), and the new tier's twins hold the new dtype's blocks: a session
    resumes from host after it."""
    model_dir = tiny_checkpoint("qwen3")
    core = model_core(model_dir, host_cache_mb=2)
    cold = model_core(model_dir, prefix_cache=False)
    model_session(core, cold, 2, seed=8)
    before = core.pool.host
    assert before is not None and before.blocks.num_filed
    tiers_at_allocation: list[object] = []
    real = core.runner._allocate_kv
    monkeypatch.setattr(core.runner, "_allocate_kv", lambda *a, **kw: (
        tiers_at_allocation.append(core.runner.host_kv), real(*a, **kw))[1])
    assert core.reset_kv(m.ResetKv(num_blocks=120, kv_dtype="int8", bytes_per_token=0,
                                   context=960, max_output_tokens=959)) == "ok"
    assert tiers_at_allocation == [None]
    after = core.pool.host
    assert after is not None and after is not before and after.blocks.num_filed == 0
    assert core.runner.host_kv is not None and core.runner.kv_dtype == "int8"
    quantised = model_core(model_dir, prefix_cache=False, kv_dtype="int8")
    model_session(core, quantised, 3, seed=9)  # int8 KV both sides: the same tokens
    assert core.status().prefix_host_hit_tokens > 0
    assert_whole(core)


def test_a_draft_models_layers_go_to_the_host_and_back_with_each_block(tiny_checkpoint):
    """speculation = "draft:<id>": the draft model's layers share every block, so its KV is
    copied with the target's; the session keeps a cold server's tokens while drafting."""
    from helexa.checkpoint.memory import kv_bytes_per_token
    from helexa.checkpoint.shape import read_model_shape

    target = tiny_checkpoint("qwen3")
    draft = tiny_checkpoint("qwen3", hidden_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, seed=7)
    def per_token(d: Path) -> int:
        return kv_bytes_per_token(read_model_shape(d / "config.json"), 1, "auto")

    draft_bpt = per_token(draft)
    spec = EngineSpec(model_id="tiny", model_dir=str(target), num_blocks=120, block_size=8,
                      context=960, bytes_per_token=per_token(target) + draft_bpt,
                      host_cache_mb=2,
                      draft_model_id="small", draft_model_dir=str(draft),
                      draft_bytes_per_token=draft_bpt,
                      limits=m.Limits(anon_max_in_flight=8, speculation="draft:small",
                                      spec_k=4, spec_full_below=1.0, spec_off_above=1.01,
                                      spec_min_acceptance=0.0))
    warm = EngineCore(spec)
    assert warm._runners.draft is not None and warm._runners.draft.host_kv is not None
    model_session(warm, model_core(target, prefix_cache=False), 4, seed=10)
    st = warm.status()
    assert st.prefix_host_hit_tokens > 0 and st.spec_drafted_tokens > 0
    assert_whole(warm)


@pytest.mark.parametrize("stage_bytes", [1, 64 * 2**20])  # a wait per tensor, or one
def test_host_copies_carry_every_tensors_rows_there_and_back(monkeypatch, stage_bytes):
    """HostKv's copies, whatever the copy-out's staging holds at once: blocks and state
    slots copied out land in their host slots, and copied back in they land in their device
    slots, byte for byte, the rows not moved untouched (a transposed state view too)."""
    monkeypatch.setattr(host_kv, "STAGE_BYTES", stage_bytes)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(6, 4, 3, generator=gen) for _ in range(2))
    conv = torch.randn(3, 5, 2, generator=gen)
    recurrent = torch.randn(3, 2, 4, 4, generator=gen).transpose(-1, -2)  # as a V-major pool's
    tier = host_kv.HostKv([k, v], [conv, recurrent], num_blocks=4, num_snapshots=2)
    before = [t.clone() for t in (k, v, conv, recurrent)]
    tier.apply(KvMoves(blocks_out=[(5, 0), (2, 3)], states_out=[(1, 1)]))
    for t in (k, v, conv, recurrent):
        t.zero_()
    tier.apply(KvMoves(blocks_in=[(3, 0), (0, 4)], states_in=[(1, 2)]))
    for got, want in zip((k, v), before[:2], strict=True):
        assert torch.equal(got[0], want[2]) and torch.equal(got[4], want[5])
        assert not got[[1, 2, 3, 5]].any()  # only the two moved in
    for got, want in zip((conv, recurrent), before[2:], strict=True):
        assert torch.equal(got[2], want[1]) and not got[:2].any()


def test_a_host_block_evicted_into_twice_in_one_intake_keeps_the_later_copy():
    """A host tier of one block: two device blocks evicted in one intake both go to it,
    the second's key filed there. Only the second copy out may run (one scatter with a
    repeated target leaves a mix of both rows)."""
    host = HostTier(1, 10)
    k0, k1 = keys([1], 1)[0], keys([2], 1)[0]
    host.evicted_block(0, k0)
    host.evicted_block(1, k1)
    moves = host.take_moves()
    assert moves.blocks_out == [(1, 0)]
    assert host.match([k1]) == [0] and host.match([k0]) == []


def test_a_copy_out_waits_for_nothing_and_lands_before_a_copy_in_reads(monkeypatch):
    """On a GPU a copy out's rows reach pinned memory without the host waiting (a wait
    would drain the step the engine's lookahead holds in flight). They land in the twins
    once copied, oldest first, and at the latest before a copy in, which may read them:
    here host block 0 is written twice, by two steps' evictions, and read back."""
    events: list[Any] = []

    class Copies:  # a CUDA event whose copies run only when the test says
        def __init__(self) -> None:
            self.ran = False
            self.waits = 0
            events.append(self)

        def query(self) -> bool:
            return self.ran

        def synchronize(self) -> None:
            self.waits += 1
            self.ran = True

    monkeypatch.setattr(host_kv, "copied_event", lambda device: Copies())
    k = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    tier = host_kv.HostKv([k], [], num_blocks=2, num_snapshots=0)
    twin = tier._blocks[0][1]
    twin.zero_()
    tier.apply(KvMoves(blocks_out=[(5, 0)]))
    assert not twin.any() and tier.pending_bytes == 16  # queued, not landed, no wait
    tier.apply(KvMoves(blocks_out=[(2, 0), (3, 1)]))  # a later step's eviction, same slot
    assert not twin.any() and [e.waits for e in events] == [0, 0]
    events[0].ran = True  # the first step's copies have run: the next apply lands them
    tier.apply(KvMoves())
    assert torch.equal(twin[0], k[5]) and not twin[1].any() and events[1].waits == 0
    k.zero_()
    tier.apply(KvMoves(blocks_in=[(0, 4), (1, 0)]))  # reads slot 0: the later copy landed
    assert events[1].waits == 1 and tier.pending_bytes == 0
    assert torch.equal(k[4], torch.arange(8, 12.0)) and torch.equal(k[0], torch.arange(12, 16.0))



def test_a_copy_in_stages_at_most_stage_bytes_before_it_waits(monkeypatch):
    """A restore is staged in pinned memory a part at a time (half STAGE_BYTES, a tensor's
    rows cut too): past STAGE_BYTES queued the host waits for the oldest part to have
    reached the device, so the pinned buffers (which PyTorch keeps once freed) never hold
    much more than that, whatever the restore's size, and the next part is gathered while
    the one before copies. Here a row a part, two rows' bytes queued at most, five rows a
    tensor: every part from the third waits for the one two before it."""
    waits: list[int] = []
    made: list[int] = []

    class Copies:
        def __init__(self) -> None:
            self.part = len(made)
            made.append(self.part)

        def synchronize(self) -> None:
            waits.append(self.part)

    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(8, 4, 3, generator=gen) for _ in range(2))
    tier = host_kv.HostKv([k, v], [], num_blocks=8, num_snapshots=0)
    tier.apply(KvMoves(blocks_out=[(i, 7 - i) for i in range(8)]))
    before = (k.clone(), v.clone())
    k.zero_(), v.zero_()
    monkeypatch.setattr(host_kv, "STAGE_BYTES", 2 * k[0].nbytes)
    monkeypatch.setattr(host_kv, "copied_event", lambda device: Copies())
    tier.apply(KvMoves(blocks_in=[(7 - i, i) for i in range(5)]))
    assert len(made) == 10 and waits == list(range(8))  # the last two left to the allocator
    for got, want in zip((k, v), before, strict=True):
        assert torch.equal(got[:5], want[:5]) and not got[5:].any()


def test_a_copy_out_gathers_its_rows_a_part_at_a_time(monkeypatch):
    """An eviction's rows are gathered on the device in parts of at most half STAGE_BYTES
    (a long context's blocks gathered whole were that many bytes of the device's memory a
    tensor, beside the step), and every row still lands in its host slot."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gathered: list[int] = []

    class Gathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index_select.default and args[0].shape[1:] == (4, 3):
                gathered.append(out.shape[0])
            return out

    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(9, 4, 3, generator=gen) for _ in range(2))
    tier = host_kv.HostKv([k, v], [], num_blocks=9, num_snapshots=0)
    monkeypatch.setattr(host_kv, "STAGE_BYTES", 4 * k[0].nbytes)  # parts of 2 rows
    with Gathers():
        tier.apply(KvMoves(blocks_out=[(i, 8 - i) for i in range(7)]))
    assert gathered == [2, 2, 2, 2, 2, 2, 1, 1]  # k and v of each part
    before = (k.clone(), v.clone())
    k.zero_(), v.zero_()
    tier.apply(KvMoves(blocks_in=[(8 - i, i) for i in range(7)]))
    for got, want in zip((k, v), before, strict=True):
        assert torch.equal(got[:7], want[:7]) and not got[7:].any()
