"""The KV block pool and its ledger: mechanism only, it never decides.

The pool is `num_blocks` fixed-size blocks, made once at load. Every block
is in exactly one state:

- free: holds nothing useful; on the free list (FIFO: released blocks go to
  the back, new reservations take from the front);
- cached: holds a full block of prefix-cache content that no request
  references; reclaimable, so it counts as free for new reservations, and is
  evicted least recently released first;
- reserved: set aside for an admitted request that has not written it yet;
- used: referenced by one or more requests (`ref_count`), written or being
  written. A shared prefix block is one used block with ref_count > 1.

A request's life in the pool: `reserve(req_id, n, reuse)` pins the cached
blocks it will reuse and takes `n` more as reserved, all or nothing;
`draw(req_id)` turns one of its reserved blocks into a used one as its
sequence grows; `extend(req_id, n)` sets aside n more, all or nothing (its
output budget grows); `release(req_id)` gives back everything it holds, exactly
once (a second call is a no-op and says so). Admission (policy) decides who
may reserve; this file only answers and mutates.

Hybrid models (linear-attention layers) also hold a fixed-size state per
request: the pool then has `num_state_slots` slots of `fixed_bytes` each, and
a reservation takes one with its blocks (all or nothing) and gives it back in
the same `release`. The ledger counts a held slot as reserved until its
request draws its first block, then as used. With the prefix cache on, such a
pool also keeps `num_snapshot_slots` prefix snapshots (snapshot_pool.py): a
reservation that reuses cached blocks pins the snapshot after them, a block's
eviction drops the snapshot filed under it, and `release` gives back both.

With a host tier (host_tier.py, kv.host_cache_mb) an evicted cached block, and an evicted
snapshot, is filed there and copied out instead of being lost; a reservation may restore a
chain of host blocks after its device hits (`reserve(..., host_blocks=...)`): they are
drawn from its reservation at once, filed under their keys and copied in before any step
reads them, and for a hybrid model the snapshot after them too (`host_snapshot`).

Prefix sharing: a full block's content is named by a `BlockKey`: a SHA-256
chain digest over the parent block's digest and the block's token ids, with
the tokens and the parent digest kept beside it. The index is keyed by the
digest, but a hit counts only when the filed key equals the wanted one
(same tokens, same parent), so a collision, crafted or not, can never serve
one request another's KV. `register` files a used full block under its key;
`match_prefix` finds the longest chain of filed blocks for a prompt.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from helexa.neuron.engine import messages
from helexa.neuron.engine.block_key import BlockKey
from helexa.neuron.engine.host_tier import HostTier
from helexa.neuron.engine.snapshot_pool import SnapshotPool


class BlockState(enum.IntEnum):
    FREE = 0
    CACHED = 1
    RESERVED = 2
    USED = 3


@dataclass(eq=False)
class Block:
    block_id: int
    state: BlockState = BlockState.FREE
    ref_count: int = 0  # requests referencing it (used blocks only)
    block_hash: BlockKey | None = None  # set while filed in the prefix index


class PoolError(RuntimeError):
    """A caller broke the pool's protocol (drew without a reservation, reserved twice)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, bytes_per_block: int, *,
                 num_state_slots: int = 0, fixed_bytes: int = 0,
                 num_snapshot_slots: int = 0, host: HostTier | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs blocks: num_blocks={num_blocks}, block_size={block_size}")
        self.num_state_slots = num_state_slots
        self.fixed_bytes = fixed_bytes  # per request (per card), when there are state slots
        self._free_slots: deque[int] = deque(range(num_state_slots))
        self._slot_of: dict[str, int] = {}  # req -> its state slot
        # prefix snapshots: state slots after the requests' (hybrid models, prefix cache on)
        self.host = host  # the prefix cache's host tier (None: evicted content is lost)
        self.snapshots = SnapshotPool(range(num_state_slots, num_state_slots
                                            + num_snapshot_slots),
                                      host.evicted_snapshot if host is not None else None) \
            if num_state_slots and num_snapshot_slots else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._index: dict[bytes, int] = {}  # block digest -> block id
        self._reserved: dict[str, deque[int]] = {}  # req -> reserved, not yet drawn
        self._held: dict[str, list[int]] = {}  # req -> used blocks it references, in order
        self._num_reserved = 0
        # Blocks made available again (free or cached) since start: admission
        # measures the pool's drain rate from it.
        self.num_released_total = 0
        self.num_evicted_total = 0

    # --- reports -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Free + cached: what a new reservation may take."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_reserved

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached) - self._num_reserved

    def free_block_ids(self) -> list[int]:
        """The free list in allocation order (tests and debugging)."""
        return list(self._free)

    def cached_block_ids(self) -> list[int]:
        """Cached blocks, next to be evicted first."""
        return list(self._cached)

    def holds(self, req_id: str) -> bool:
        return req_id in self._reserved or req_id in self._held

    def num_reserved_for(self, req_id: str) -> int:
        return len(self._reserved.get(req_id, ()))

    def can_reserve(self, n: int, reuse: Sequence[int] = ()) -> bool:
        """Would `reserve(_, n, reuse)` succeed now? Reused cached blocks count against free;
        a hybrid model's request also needs a free state slot."""
        if self.num_state_slots and not self._free_slots:
            return False
        return n + self._num_unreferenced(reuse) <= self.num_free_blocks

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

    def state_slot(self, req_id: str) -> int:
        """The state slot req_id holds (-1: none, a dense model's pool)."""
        return self._slot_of.get(req_id, -1)

    def ledger(self) -> messages.KvLedger:
        """Blocks and state slots in bytes: total = free + reserved + used over both."""
        b, f = self.bytes_per_block, self.fixed_bytes
        held = list(self._slot_of)
        slots_used = sum(1 for r in held if self._held.get(r))
        slots_reserved = len(held) - slots_used
        snaps = self.snapshots
        snap_total, snap_free, snap_cached = (
            (snaps.num_slots * f, snaps.num_free * f, snaps.num_cached * f)
            if snaps is not None else (0, 0, 0))
        return messages.KvLedger(
            total_bytes=self.num_blocks * b + self.num_state_slots * f + snap_total,
            free_bytes=self.num_free_blocks * b + len(self._free_slots) * f + snap_free,
            cached_bytes=self.num_cached_blocks * b + snap_cached,
            reserved_bytes=self.num_reserved_blocks * b + slots_reserved * f,
            used_bytes=self.num_used_blocks * b + slots_used * f + snap_total - snap_free,
            block_size=self.block_size,
            bytes_per_token=b // self.block_size,
            fixed_bytes_per_request=f if self.num_state_slots else 0,
            state_total_bytes=self.num_state_slots * f,
            state_free_bytes=len(self._free_slots) * f,
            snapshot_total_bytes=snap_total,
            snapshot_cached_bytes=snap_cached,
            host_total_bytes=self.host.total_bytes if self.host is not None else 0,
            host_cached_bytes=self.host.cached_bytes if self.host is not None else 0,
        )

    # --- mutations ---------------------------------------------------------

    def reserve(self, req_id: str, n: int, reuse: Sequence[int] = (),
                restore: int = -1, host_blocks: Sequence[tuple[int, BlockKey]] = (),
                host_snapshot: tuple[int, BlockKey] | None = None) -> bool:
        """Pin `reuse` (filed blocks) and set aside `n` blocks for req_id; all or nothing.
        `restore`: the snapshot after `reuse` (hybrid models), pinned with them.
        `host_blocks`: (host block, key) of the chain after `reuse` in the host tier: the
        first of the `n` blocks are drawn for them, filed, and copied in (restored_blocks
        says which). `host_snapshot`: (host snapshot, key) after them, restored into a
        snapshot slot in place of `restore`."""
        if self.holds(req_id):
            raise PoolError(f"{req_id} already holds a reservation")
        if n < len(host_blocks) or not self.can_reserve(n, reuse):
            return False
        if host_snapshot is not None and (self.snapshots is None or not self.snapshots.num_free):
            return False
        host = self.host
        if host_blocks or host_snapshot is not None:
            assert host is not None, "a host restore needs a host tier"
            for host_block, _ in host_blocks:  # before any eviction below may need room there
                host.blocks.pin(host_block)
            if host_snapshot is not None:
                host.snapshots.pin(host_snapshot[0])
        held: list[int] = []
        for block_id in reuse:  # pin first, so taking the n below cannot evict them
            block = self.blocks[block_id]
            if block.block_hash is None or block.state not in (BlockState.CACHED, BlockState.USED):
                raise PoolError(f"block {block_id} is not prefix-cache content")
            if block.state == BlockState.CACHED:
                del self._cached[block_id]
                block.state = BlockState.USED
            block.ref_count += 1
            held.append(block_id)
        self._reserved[req_id] = taken = deque[int]()
        self._set_aside(taken, n)
        self._held[req_id] = held
        if self.num_state_slots:
            self._slot_of[req_id] = self._free_slots.popleft()
        if restore >= 0:
            assert self.snapshots is not None, "a snapshot to restore needs snapshot slots"
            self.snapshots.pin(req_id, restore)
        for host_block, key in host_blocks:
            block_id = self.draw(req_id)
            if not self.register(block_id, key):
                raise PoolError(f"block {block_id}: its key is filed already; not a host hit")
            host.restore_block(host_block, block_id)  # type: ignore[union-attr]
        if host_snapshot is not None:
            assert self.snapshots is not None and host is not None
            slot = self.snapshots.take_for_restore(req_id, host_snapshot[1])
            host.restore_snapshot(host_snapshot[0], slot)
        return True

    def extend(self, req_id: str, n: int) -> bool:
        """Set aside `n` more blocks for req_id, all or nothing (its budget grows: growth.py)."""
        if not self.holds(req_id) or n > self.num_free_blocks:
            return False
        self._set_aside(self._reserved[req_id], n)
        return True

    def restored_blocks(self, req_id: str) -> list[int]:
        """The blocks req_id holds, in table order (its reused and host-restored prefix,
        right after reserve)."""
        return list(self._held.get(req_id, ()))

    def unfile(self, block_ids: Sequence[int]) -> None:
        """Take blocks out of the prefix index (their copy in failed: not their key's content).
        A cached one becomes free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            del self._index[block.block_hash.digest]
            block.block_hash = None
            if block.state == BlockState.CACHED:
                del self._cached[block_id]
                block.state = BlockState.FREE
                self._free.append(block_id)

    def draw(self, req_id: str) -> int:
        """Turn one of req_id's reserved blocks into a used block and return its id."""
        taken = self._reserved.get(req_id)
        if not taken:
            raise PoolError(f"{req_id} has no reserved block left to draw")
        block_id = taken.popleft()
        block = self.blocks[block_id]
        block.state = BlockState.USED
        block.ref_count = 1
        self._num_reserved -= 1
        self._held[req_id].append(block_id)
        return block_id

    def release(self, req_id: str) -> bool:
        """Give back all req_id holds; False (and nothing changes) if it holds nothing."""
        if not self.holds(req_id):
            return False
        # Tail blocks first, so that a shared prefix's later blocks are
        # evicted before its earlier ones (they are worth less).
        for block_id in reversed(self._held.pop(req_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                block.state = BlockState.CACHED
                self._cached[block_id] = None
            else:
                block.state = BlockState.FREE
                self._free.append(block_id)
            self.num_released_total += 1
        slot = self._slot_of.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        if self.snapshots is not None:
            self.snapshots.release(req_id)
        taken = self._reserved.pop(req_id, deque())
        for block_id in taken:
            self.blocks[block_id].state = BlockState.FREE
            self._free.append(block_id)
        self._num_reserved -= len(taken)
        self.num_released_total += len(taken)
        return True

    # --- prefix cache ------------------------------------------------------

    def register(self, block_id: int, key: BlockKey) -> bool:
        """File a full used block under its chain key; False if its digest is filed already
        (the same content, or a collision: either way this block stays private)."""
        block = self.blocks[block_id]
        if block.state != BlockState.USED:
            raise PoolError(f"block {block_id} is {block.state.name}, only used blocks are filed")
        if not isinstance(key, BlockKey):
            raise PoolError(f"block {block_id}: expected a BlockKey, got {type(key).__name__}")
        if block.block_hash is not None or key.digest in self._index:
            return False
        block.block_hash = key
        self._index[key.digest] = block_id
        return True

    def lookup(self, key: BlockKey) -> int | None:
        """The block filed with exactly this content (tokens and parent), if any."""
        block_id = self._index.get(key.digest)
        if block_id is None or self.blocks[block_id].block_hash != key:
            return None  # a digest collision is a miss, never a hit
        return block_id

    def match_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """Block ids of the longest filed chain that starts the given keys."""
        hits: list[int] = []
        for key in keys:
            block_id = self.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- internals ---------------------------------------------------------

    def _num_unreferenced(self, reuse: Sequence[int]) -> int:
        return sum(1 for i in reuse if self.blocks[i].state == BlockState.CACHED)

    def _set_aside(self, taken: deque[int], n: int) -> None:
        for _ in range(n):
            block_id = self._take_block()
            self.blocks[block_id].state = BlockState.RESERVED
            taken.append(block_id)
        self._num_reserved += n

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._cached.popitem(last=False)  # evict the least recently released
        block = self.blocks[block_id]
        key = block.block_hash
        assert key is not None
        del self._index[key.digest]
        block.block_hash = None
        if self.host is not None:  # copied out before the reservation taking it can write it
            self.host.evicted_block(block_id, key)
        if self.snapshots is not None:  # a snapshot after this block can never be hit now
            self.snapshots.evict_key(key.digest)  # (or only from the host tier)
        self.num_evicted_total += 1
        return block_id

    def check(self) -> None:
        """Assert the ledger's invariants (tests call it after every mutation)."""
        counts = {s: 0 for s in BlockState}
        for block in self.blocks:
            counts[block.state] += 1
            if block.state == BlockState.USED:
                assert block.ref_count > 0, block
            else:
                assert block.ref_count == 0, block
            if block.state == BlockState.CACHED:
                assert block.block_hash is not None, block
            if block.block_hash is not None:
                assert self._index[block.block_hash.digest] == block.block_id, block
        assert counts[BlockState.FREE] == len(self._free) == len(set(self._free))
        assert counts[BlockState.CACHED] == len(self._cached)
        assert counts[BlockState.RESERVED] == self._num_reserved
        assert self._num_reserved == sum(len(t) for t in self._reserved.values())
        refs: dict[int, int] = {}
        for held in self._held.values():
            for block_id in held:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.blocks:
            assert refs.get(block.block_id, 0) == block.ref_count, block
        assert len(self._index) == sum(1 for b in self.blocks if b.block_hash is not None)
        slots = list(self._free_slots) + list(self._slot_of.values())
        assert sorted(slots) == list(range(self.num_state_slots)), slots
        assert set(self._slot_of) <= set(self._reserved) | set(self._held)
        if self.snapshots is not None:
            self.snapshots.check()
        if self.host is not None:
            self.host.check()
