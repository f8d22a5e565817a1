"""The prefix cache's host-memory tier (kv.host_cache_mb): where filed blocks and prefix
snapshots go when the device pool evicts them, and the copies that move them. Mechanism
only, as the block pool (block_pool.py) is; the runner does the copies
(helexa/kernels/host_kv.py).

Without it an evicted block is gone: an agent whose session was pushed out of the pool by
another user's long prompt re-prefills its whole history on its next turn. With it:

- the pool's eviction of a cached block files the block's key here and queues a copy out
  (device block -> host block); a hybrid model's cached snapshot goes the same way when it
  is evicted (its own eviction, or its block's);
- admission continues a prompt's chain of device hits with host hits (host_match), and a
  reservation that restores them takes fresh device blocks for them, files them under their
  keys at once and queues a copy in (host -> device), and for a hybrid the snapshot at the
  end of the chain likewise;
- the engine takes the queued copies (take_moves) before any pass of the model can read or
  write the blocks involved, and the runner makes them: all copies out first, then all
  copies in, so a block evicted and re-used in one step is read before it is written.

A host block is in one of three states: free, filed (least recently used first: evicted
when a new copy out needs room) or pinned (a queued copy in reads it; never evicted until
the copies are taken). A key already filed here is not copied again: equal keys are equal
content (block_key.BlockKey). The tier is sized as the device pool's mix of blocks and
snapshots (host_tier_size), per card: each tensor-parallel rank keeps its own shard.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import msgspec

from helexa.budget import host_tier_size  # noqa: F401  (the tier's size rule lives there)

if TYPE_CHECKING:
    from helexa.neuron.engine.block_key import BlockKey


class KvMoves(msgspec.Struct, array_like=True):
    """One step's copies between the device pool and the host tier, in the order made:
    every copy out before any copy in."""

    blocks_out: list[tuple[int, int]] = []  # (device block, host block)
    blocks_in: list[tuple[int, int]] = []  # (host block, device block)
    states_out: list[tuple[int, int]] = []  # (device snapshot slot, host snapshot)
    states_in: list[tuple[int, int]] = []  # (host snapshot, device snapshot slot)

    def __bool__(self) -> bool:
        return bool(self.blocks_out or self.blocks_in or self.states_out or self.states_in)


class HostIndex:
    """One kind of host slot (blocks, or snapshots) and the keys filed in them."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._filed: OrderedDict[int, None] = OrderedDict()  # unpinned, least recent first
        self._key_of: dict[int, BlockKey] = {}
        self._index: dict[bytes, int] = {}  # digest -> slot
        self._pins: dict[int, int] = {}  # slot -> queued copies in reading it
        self.num_evicted_total = 0

    @property
    def num_filed(self) -> int:
        return len(self._key_of)

    def lookup(self, key: BlockKey) -> int | None:
        slot = self._index.get(key.digest)
        if slot is None or self._key_of[slot] != key:
            return None  # a digest collision is a miss
        return slot

    def store(self, key: BlockKey) -> int | None:
        """A slot to copy `key`'s content into, filed under it; None when no copy is needed
        (filed already: refreshed) or every slot is pinned."""
        slot = self.lookup(key)
        if slot is not None:
            if slot in self._filed:
                self._filed.move_to_end(slot)
            return None
        if key.digest in self._index:  # a colliding digest holds the place: leave it
            return None
        if self._free:
            slot = self._free.popleft()
        elif self._filed:
            slot, _ = self._filed.popitem(last=False)
            self._unfile(slot)
            self.num_evicted_total += 1
        else:
            return None
        self._key_of[slot] = key
        self._index[key.digest] = slot
        self._filed[slot] = None
        return slot

    def pin(self, slot: int) -> None:
        if slot not in self._key_of:
            raise RuntimeError(f"host slot {slot} holds nothing to restore")
        self._filed.pop(slot, None)
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
        else:
            del self._pins[slot]
            self._filed[slot] = None  # most recently used now

    def clear(self) -> None:
        """Forget everything (a copy failed: what the slots hold is not known)."""
        self.__init__(self.num_slots)  # type: ignore[misc]

    def _unfile(self, slot: int) -> None:
        key = self._key_of.pop(slot)
        del self._index[key.digest]

    def check(self) -> None:
        states = list(self._free) + list(self._filed) + list(self._pins)
        assert sorted(states) == list(range(self.num_slots)), states
        assert set(self._filed) | set(self._pins) == set(self._key_of)
        assert len(self._index) == len(self._key_of)
        for slot, key in self._key_of.items():
            assert self._index[key.digest] == slot


def _last_per_target(copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(source, target) copies, the last one to each target alone, in queue order."""
    last = {target: i for i, (_, target) in enumerate(copies)}
    return [c for i, c in enumerate(copies) if last[c[1]] == i]


class HostTier:
    """Host blocks and host snapshots, and the copies queued since the engine last took
    them. `bytes_per_block` and `snapshot_bytes` are per card, as the ledger's."""

    def __init__(self, num_blocks: int, bytes_per_block: int, num_snapshots: int = 0,
                 snapshot_bytes: int = 0) -> None:
        self.blocks = HostIndex(num_blocks)
        self.snapshots = HostIndex(num_snapshots)
        self.bytes_per_block = bytes_per_block
        self.snapshot_bytes = snapshot_bytes
        self._moves = KvMoves([], [], [], [])
        self.num_offloaded_blocks = 0  # copies out, since start
        self.num_restored_blocks = 0  # copies in
        self.num_offloaded_snapshots = 0
        self.num_restored_snapshots = 0

    @property
    def total_bytes(self) -> int:
        return (self.blocks.num_slots * self.bytes_per_block
                + self.snapshots.num_slots * self.snapshot_bytes)

    @property
    def cached_bytes(self) -> int:
        return (self.blocks.num_filed * self.bytes_per_block
                + self.snapshots.num_filed * self.snapshot_bytes)

    def match(self, keys: list[BlockKey]) -> list[int]:
        """Host blocks of the longest chain of `keys` filed here, in order."""
        hits: list[int] = []
        for key in keys:
            slot = self.blocks.lookup(key)
            if slot is None:
                break
            hits.append(slot)
        return hits

    # --- the pool's evictions ----------------------------------------------

    def evicted_block(self, device_block: int, key: BlockKey) -> None:
        slot = self.blocks.store(key)
        if slot is not None:
            self._moves.blocks_out.append((device_block, slot))
            self.num_offloaded_blocks += 1

    def evicted_snapshot(self, device_slot: int, key: BlockKey) -> None:
        slot = self.snapshots.store(key)
        if slot is not None:
            self._moves.states_out.append((device_slot, slot))
            self.num_offloaded_snapshots += 1

    # --- a reservation's restores (the pool pins first, then queues) ------------

    def restore_block(self, host_block: int, device_block: int) -> None:
        """Queue host_block's copy into device_block (pinned by the caller beforehand)."""
        self._moves.blocks_in.append((host_block, device_block))
        self.num_restored_blocks += 1

    def restore_snapshot(self, host_snapshot: int, device_slot: int) -> None:
        self._moves.states_in.append((host_snapshot, device_slot))
        self.num_restored_snapshots += 1

    def take_moves(self) -> KvMoves:
        """The copies queued since the last call, for the runner to make now; the host
        slots they read are unpinned (nothing can evict them before the copies run). A
        device block or slot restored into twice (its first restore's request ended
        before its step, the block went back and a later one in the same intake drew it)
        keeps only its last copy in: one scatter with a repeated target leaves either
        write on CUDA, not the later."""
        moves, self._moves = self._moves, KvMoves([], [], [], [])
        for host_block, _ in moves.blocks_in:
            self.blocks.unpin(host_block)
        for host_snapshot, _ in moves.states_in:
            self.snapshots.unpin(host_snapshot)
        # likewise a host block or snapshot evicted into twice in one intake (its first
        # key evicted from the host again by a later copy out): the later key is the one
        # filed there; a pinned host slot (a copy in reads it) is never evicted
        moves.blocks_out = _last_per_target(moves.blocks_out)
        moves.states_out = _last_per_target(moves.states_out)
        moves.blocks_in = _last_per_target(moves.blocks_in)
        moves.states_in = _last_per_target(moves.states_in)
        return moves

    def clear(self) -> None:
        """The copies failed: nothing here is trusted any more."""
        self.blocks.clear()
        self.snapshots.clear()
        self._moves = KvMoves([], [], [], [])

    def check(self) -> None:
        self.blocks.check()
        self.snapshots.check()
