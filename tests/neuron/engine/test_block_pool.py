"""Block pool: exact block ids, free-list order, ledger figures, exactly-once release."""

from __future__ import annotations

import random

import pytest

from helexa.neuron.engine.block_key import hash_block_tokens
from helexa.neuron.engine.block_pool import BlockPool, BlockState, PoolError


def make_pool(n: int = 8) -> BlockPool:
    return BlockPool(num_blocks=n, block_size=4, bytes_per_block=4 * 10)


def test_reserve_draw_release_order_and_ledger():
    pool = make_pool()
    assert pool.reserve("a", 3)
    assert pool.reserve("b", 2)
    assert pool.free_block_ids() == [5, 6, 7]
    assert pool.draw("a") == 0
    assert pool.draw("b") == 3
    assert pool.draw("a") == 1
    led = pool.ledger()
    assert (led.total_bytes, led.free_bytes, led.reserved_bytes, led.used_bytes, led.cached_bytes) \
        == (320, 120, 80, 120, 0)
    assert (led.block_size, led.bytes_per_token) == (4, 10)
    assert pool.release("a")  # used 1, 0 (tail first), then the undrawn reserved 2
    assert pool.free_block_ids() == [5, 6, 7, 1, 0, 2]
    assert pool.num_reserved_for("b") == 1
    pool.check()


def test_extend_sets_aside_more_all_or_nothing_and_release_returns_them():
    pool = make_pool()
    assert pool.reserve("a", 2) and pool.reserve("b", 3)
    assert [pool.draw("a"), pool.draw("a")] == [0, 1]
    assert not pool.extend("a", 4) and pool.num_reserved_for("a") == 0  # 3 free: nothing
    assert not pool.extend("nobody", 1)
    assert pool.extend("a", 2) and pool.num_reserved_for("a") == 2
    assert pool.draw("a") == 5  # its table goes on in the blocks set aside
    led = pool.ledger()
    assert (led.free_bytes, led.reserved_bytes, led.used_bytes) == (40, 160, 120)
    pool.check()
    assert pool.release("a")
    assert pool.num_free_blocks == 5 and pool.num_reserved_blocks == 3  # b's alone
    pool.check()


def test_release_twice_is_a_reported_noop():
    pool = make_pool()
    pool.reserve("a", 2)
    pool.draw("a")
    assert pool.release("a") is True
    before = pool.free_block_ids()
    assert pool.release("a") is False
    assert pool.release("never") is False
    assert pool.free_block_ids() == before
    assert pool.num_free_blocks == 8
    pool.check()


def test_reservation_is_all_or_nothing():
    pool = make_pool(4)
    assert pool.reserve("a", 3)
    assert not pool.can_reserve(2)
    assert pool.reserve("b", 2) is False
    assert not pool.holds("b")
    assert pool.num_free_blocks == 1
    assert pool.reserve("b", 1)
    pool.check()


def test_protocol_errors():
    pool = make_pool()
    pool.reserve("a", 1)
    pool.draw("a")
    with pytest.raises(PoolError):
        pool.draw("a")  # reservation exhausted
    with pytest.raises(PoolError):
        pool.reserve("a", 1)  # reserves once
    with pytest.raises(PoolError):
        pool.draw("nobody")


def test_cached_blocks_count_as_free_and_are_evicted_oldest_first():
    pool = make_pool(4)
    pool.reserve("a", 2)
    b0, b1 = pool.draw("a"), pool.draw("a")
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert pool.register(b0, h0) and pool.register(b1, h1)
    pool.release("a")
    # tail released first, so it is the first to be evicted
    assert pool.cached_block_ids() == [1, 0]
    assert pool.free_block_ids() == [2, 3]
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    led = pool.ledger()
    assert (led.free_bytes, led.cached_bytes, led.used_bytes) == (160, 80, 0)
    assert pool.match_prefix([h0, h1]) == [0, 1]
    assert pool.reserve("b", 3)  # 2 free + 1 evicted
    assert pool.match_prefix([h0, h1]) == [0]  # block 1 (h1) was evicted
    assert pool.lookup(h1) is None
    assert pool.num_evicted_total == 1
    pool.check()


def test_reuse_pins_shared_blocks_and_refcounts():
    pool = make_pool(4)
    pool.reserve("a", 1)
    b = pool.draw("a")
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.register(b, h)
    assert pool.reserve("b", 1, reuse=[b])  # a still uses it: pinning costs nothing
    assert pool.blocks[b].ref_count == 2
    pool.release("a")
    assert pool.blocks[b].state == BlockState.USED and pool.blocks[b].ref_count == 1
    pool.release("b")
    assert pool.blocks[b].state == BlockState.CACHED
    # a cached block being reused counts against what is free
    assert pool.num_free_blocks == 4
    assert not pool.can_reserve(4, reuse=[b])
    assert pool.can_reserve(3, reuse=[b])
    assert pool.reserve("c", 3, reuse=[b])  # pinned first, so the 3 come from the free list
    assert pool.blocks[b].state == BlockState.USED and pool.num_free_blocks == 0
    pool.check()


def test_register_refuses_duplicates_and_unused_blocks():
    pool = make_pool()
    pool.reserve("a", 2)
    x, y = pool.draw("a"), pool.draw("a")
    h = hash_block_tokens(None, [9, 9, 9, 9])
    assert pool.register(x, h)
    assert not pool.register(y, h)  # same content filed already: y stays private
    pool.release("a")
    assert pool.cached_block_ids() == [x]
    with pytest.raises(PoolError):
        pool.register(y, h)  # free blocks are not filed
    pool.check()


def test_random_storm_keeps_the_ledger_whole():
    rng = random.Random(0)
    pool = BlockPool(num_blocks=32, block_size=4, bytes_per_block=4)
    live: list[str] = []
    hashes: list = []
    for i in range(3000):
        op = rng.random()
        if op < 0.35:
            rid = f"r{i}"
            reuse = list({pool.lookup(h) for h in rng.sample(hashes, min(len(hashes), 2))} - {None})
            if pool.reserve(rid, rng.randint(0, 6), reuse=reuse):
                live.append(rid)
        elif op < 0.7 and live:
            rid = rng.choice(live)
            if pool.num_reserved_for(rid):
                b = pool.draw(rid)
                h = hash_block_tokens(None, [rng.getrandbits(20)])
                if pool.register(b, h):
                    hashes.append(h)
        elif live:
            rid = live.pop(rng.randrange(len(live)))
            assert pool.release(rid)
        hashes = [h for h in hashes if pool.lookup(h) is not None]
        pool.check()
    for rid in live:
        pool.release(rid)
    pool.check()
    assert pool.num_free_blocks == 32 and pool.num_reserved_blocks == 0 and pool.num_used_blocks == 0


def test_a_digest_collision_is_a_miss_never_another_prompts_blocks(monkeypatch):
    from helexa.neuron.engine import block_key

    # Every block gets the same digest: what a crafted collision would achieve.
    monkeypatch.setattr(block_key, "_digest", lambda parent, tokens: b"\x00" * 32)
    pool = make_pool(4)
    pool.reserve("tenant-a", 2)
    b0, b1 = pool.draw("tenant-a"), pool.draw("tenant-a")
    mine = hash_block_tokens(None, [1, 2, 3, 4])
    theirs = hash_block_tokens(None, [5, 6, 7, 8])
    assert mine.digest == theirs.digest
    assert pool.register(b0, mine)
    # a second block with a colliding digest is not filed: it stays private
    assert not pool.register(b1, hash_block_tokens(mine, [9, 9, 9, 9]))
    pool.release("tenant-a")
    assert pool.match_prefix([theirs]) == []  # same digest, other tokens: not served
    assert pool.lookup(theirs) is None
    assert pool.match_prefix([theirs, hash_block_tokens(theirs, [9, 9, 9, 9])]) == []
    assert pool.match_prefix([mine]) == [b0]
    pool.check()
