"""Prefix snapshots of hybrid models: the slots that hold linear-attention states at block
boundaries, and their index. Mechanism only, as the block pool (block_pool.py) is.

A hybrid model's prefix-cache hit needs two things at the same position: the full-attention
KV of the blocks before it (filed blocks, block_pool.py) and the linear-attention state
(recurrent + conv) after them. The model runner carves `num_slots` snapshot slots beside
the request state slots at load (the same shape; helexa/kernels/backends/gdn.py copies a
state into a snapshot after a step and back before a hit's first step), and this pool says
which slot holds what. Every slot is in exactly one state:

- free: holds nothing;
- writing: taken by a request for a snapshot its current step copies out; filed under the
  chain key of the block that ends at its position (`file`) once the step is done, or
  freed with the request's release;
- cached: filed and referenced by no one: a hit may restore it; evicted least recently
  used first, when a new snapshot needs a slot or when the block it is filed under is
  evicted (a snapshot without its blocks can never be hit);
- pinned: a hit admitted a request that restores it (`pin`, in the same reservation that
  pins the blocks before it), until that request's first step copied it (`unpin`) or the
  request ended.

The ledger counts free and cached slots as free bytes (cached ones also as cached), pinned
and writing ones as used; admission never takes a snapshot slot for a request's own state,
so a snapshot's bytes never pass for room a reservation could use.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helexa.neuron.engine.block_key import BlockKey


class SnapshotError(RuntimeError):
    """A caller broke the snapshot protocol (filed a slot it was not writing)."""


class SnapshotPool:
    def __init__(self, slots: range,
                 on_evict: Callable[[int, BlockKey], None] | None = None) -> None:
        self.slots = slots  # absolute state slots (after the request slots)
        # Told of each cached snapshot evicted (slot, key) before its slot is reused: the
        # host tier (host_tier.py) copies it out. A superseded one (discard) is not evicted.
        self.on_evict = on_evict
        self._free: deque[int] = deque(slots)
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._key_of: dict[int, BlockKey] = {}  # filed slots
        self._index: dict[bytes, int] = {}  # block digest -> slot
        self._pins: dict[int, int] = {}  # pinned slot -> requests restoring it
        self._restoring: dict[str, int] = {}  # req -> the slot it restores
        self._writing: dict[str, list[int]] = {}  # req -> slots its step copies out
        self.num_evicted_total = 0

    # --- reports -----------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free(self) -> int:
        """Free + cached: slots a new snapshot may take."""
        return len(self._free) + len(self._cached)

    def lookup(self, key: BlockKey) -> int | None:
        """The slot filed under exactly this key (tokens and parent), if any."""
        slot = self._index.get(key.digest)
        if slot is None or self._key_of[slot] != key:
            return None
        return slot

    def restoring(self, req_id: str) -> int:
        """The snapshot req_id is to start from (-1: none, or already restored)."""
        return self._restoring.get(req_id, -1)

    # --- mutations ---------------------------------------------------------

    def pin(self, req_id: str, slot: int) -> None:
        """req_id restores `slot` (a filed one): it stays until unpin or release."""
        if slot not in self._key_of or req_id in self._restoring:
            raise SnapshotError(f"snapshot slot {slot} is not filed, or {req_id} pins one already")
        self._cached.pop(slot, None)
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._restoring[req_id] = slot

    def unpin(self, req_id: str) -> None:
        """req_id's restore is done (or it ended): its snapshot may be evicted again."""
        slot = self._restoring.pop(req_id, None)
        if slot is None:
            return
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
        else:
            del self._pins[slot]
            if slot in self._key_of:
                self._cached[slot] = None  # most recently used now
            else:
                self._free.append(slot)

    def take(self, req_id: str) -> int:
        """A slot for a snapshot req_id's step will copy out (-1: every slot is pinned or
        being written; the step then keeps no snapshot)."""
        if self._free:
            slot = self._free.popleft()
        elif self._cached:
            slot, _ = self._cached.popitem(last=False)
            self._evict(slot)
        else:
            return -1
        self._writing.setdefault(req_id, []).append(slot)
        return slot

    def file(self, req_id: str, slot: int, key: BlockKey) -> bool:
        """File req_id's written `slot` under `key`, the chain key of the block that ends at
        its position; False (the slot freed) if a snapshot of that prefix is filed already."""
        self._written(req_id, slot)
        if key.digest in self._index:
            self._free.append(slot)
            return False
        self._key_of[slot] = key
        self._index[key.digest] = slot
        self._cached[slot] = None
        return True

    def _written(self, req_id: str, slot: int) -> None:
        """req_id is done writing `slot` (SnapshotError if it was not)."""
        writing = self._writing.get(req_id, [])
        if slot not in writing:
            raise SnapshotError(f"{req_id} is not writing snapshot slot {slot}")
        writing.remove(slot)
        if not writing:
            del self._writing[req_id]

    def discard(self, slot: int, key: BlockKey) -> None:
        """Free `slot` if it is cached under `key` (a request's older end-of-generation
        snapshot, superseded by a later one); a pinned or refiled slot is left alone."""
        if slot in self._cached and self._key_of.get(slot) == key:
            del self._cached[slot]
            self._unfile(slot)
            self._free.append(slot)

    def forget(self, slots: list[int]) -> None:
        """Free these slots where cached (their copy in failed: not their key's content)."""
        for slot in slots:
            if slot in self._cached:
                del self._cached[slot]
                self._unfile(slot)
                self._free.append(slot)

    def evict_key(self, digest: bytes) -> None:
        """The block filed under `digest` was evicted: a cached snapshot after it goes too."""
        slot = self._index.get(digest)
        if slot is not None and slot in self._cached:
            del self._cached[slot]
            self._evict(slot)
            self._free.append(slot)

    def release(self, req_id: str) -> None:
        """Give back what req_id holds: its pin, and any slot it was writing."""
        self.unpin(req_id)
        self._free.extend(self._writing.pop(req_id, []))

    # --- internals ---------------------------------------------------------

    def _unfile(self, slot: int) -> None:
        key = self._key_of.pop(slot)
        del self._index[key.digest]

    def _evict(self, slot: int) -> None:
        if self.on_evict is not None:
            self.on_evict(slot, self._key_of[slot])
        self._unfile(slot)
        self.num_evicted_total += 1

    def take_for_restore(self, req_id: str, key: BlockKey) -> int:
        """A slot filed under `key` and pinned for req_id, for a snapshot the host tier copies
        in before req_id's first step (-1: every slot is pinned or being written)."""
        slot = self.take(req_id)
        if slot < 0:
            return -1
        if not self.file(req_id, slot, key):
            raise SnapshotError(f"a snapshot under this key is filed already (slot {slot})")
        self.pin(req_id, slot)
        return slot

    def check(self) -> None:
        """Assert the invariants: every slot in exactly one state."""
        writing = [s for w in self._writing.values() for s in w]
        states = list(self._free) + list(self._cached) + list(self._pins) + writing
        assert sorted(states) == list(self.slots), states
        assert set(self._cached) <= set(self._key_of)
        assert len(self._index) == len(self._key_of)
        for slot, key in self._key_of.items():
            assert self._index[key.digest] == slot
        assert sum(self._pins.values()) == len(self._restoring)
        assert set(self._restoring.values()) == set(self._pins)
