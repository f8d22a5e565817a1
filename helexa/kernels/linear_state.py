"""The per-request state of Gated DeltaNet layers, and its rollback past rejected drafts.

A linear-attention layer keeps, per request, a conv window and a recurrent
state (helexa/kernels/gated_delta.py) in a ``LinearState`` with one slot per request
the model runner may hold at once, shaped as the layer's memory statement says
(helexa/checkpoint/layer_memory.py LinearAttentionSpec, which `helexa plan` counts).
The state backend (helexa/kernels/backends/gdn.py) says, per step, which slot each row
of the flat batch reads and writes, and runs the kernels over these slots.

Speculative verification. A row of 1 + k tokens (the request's last token and
k drafts, StepPlan's PrefillRow.verify) runs token by token as k + 1 decode steps
would, so its outputs are exactly plain decoding's, but leaves the slot as it
was: the layer's state *holds* the row's inputs (conv inputs and the
k, v, g, beta of each position: a few percent of a state per position). The
engine accepts a prefix and counts only the kept positions as computed, so
the request's next step says how many stood (its num_computed less the row's
start); ``settle`` then advances the slot by exactly those positions, with
the same kernels as decode, before anything reads it. Nothing else of the
engine changes, and every tensor-parallel rank does the same from the same
step plan. A slot whose request ended meanwhile is cleared by its next owner,
dropping what it held: at most one held row per slot (docs/speculation.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.kernels import fla_gdn
from helexa.kernels import gated_delta as gd
from helexa.kernels.backends.base import to_device

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pair_indices(pairs: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """(from, to) slot pairs as one device tensor, the froms then the tos."""
    return to_device([a for a, _ in pairs] + [b for _, b in pairs], torch.long, device)


@dataclass
class VerifyRows:
    """A step's speculative verification rows, padded to [rows, longest] for the kernels."""

    index: torch.Tensor  # [B, T] flat row of each position (a short row repeats its last)
    valid: torch.Tensor  # [valid positions] int64: each real position's b * T + t
    flat: torch.Tensor  # [valid positions] their flat rows, in [B, T] order
    slots: torch.Tensor  # [B] int64 state slots
    slot_ids: list[int]
    starts: list[int]  # each row's first position (its num_computed)
    lengths: list[int]


@dataclass
class _Held:
    """Verification rows' inputs to the state: [B, T, ...] as the layer computed them."""

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    mixed: torch.Tensor  # [B, T, channels] conv inputs
    k: torch.Tensor  # [B, T, key heads, dk] fp32
    v: torch.Tensor  # [B, T, v_heads, dv]
    g: torch.Tensor  # [B, T, v_heads] fp32
    beta: torch.Tensor  # [B, T, v_heads] fp32

    def rows(self, rows: list[int]) -> _Held:
        idx = to_device(rows, torch.long, self.k.device)
        return _Held([self.slots[r] for r in rows], [self.starts[r] for r in rows],
                     [self.lengths[r] for r in rows],
                     *(x.index_select(0, idx) for x in (self.mixed, self.k, self.v, self.g,
                                                        self.beta)))


class LinearState:
    """One layer's conv windows [slots, channels, K - 1] and recurrent states
    [slots, v_heads, k_dim, v_dim], in the model's dtype (as its spec, and so helexa plan,
    counts them), and the verification rows held until their requests' next step.

    ``v_major`` stores the states as [slots + 1, v_heads, v_dim, k_dim] (``pool``, the
    layout FlashInfer's pool decode reads and writes in place: flashinfer_gdn.fi_decode_pool,
    its last slot the ``scratch`` its padding rows run on, which no request holds);
    ``recurrent`` is then the transposed view of the real slots, so every other reader sees
    one shape."""

    def __init__(self, spec: LinearAttentionSpec, num_slots: int,
                 device: torch.device | str, *, v_major: bool = False) -> None:
        dtype = TORCH_DTYPES[spec.dtype]
        self.conv = torch.zeros(num_slots, *spec.conv_shape, dtype=dtype, device=device)
        heads, dk, dv = spec.recurrent_shape
        self.pool: torch.Tensor | None = None
        self.scratch: int | None = None  # the pool's padding slot
        if v_major:
            self.pool = torch.zeros(num_slots + 1, heads, dv, dk, dtype=dtype, device=device)
            self.scratch = num_slots
            self.recurrent = self.pool[:num_slots].transpose(-1, -2)
        else:
            self.recurrent = torch.zeros(num_slots, heads, dk, dv, dtype=dtype, device=device)
        # the slots' bytes (as the spec counts them; the scratch slot is the graph pool's)
        self.nbytes = self.conv.nbytes + self.recurrent.numel() * self.recurrent.element_size()
        self._held: dict[int, tuple[_Held, int]] = {}  # slot -> (rows, its row)

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes // self.conv.shape[0]

    @property
    def held_bytes(self) -> int:
        """Bytes the held verification rows take (each batch once)."""
        batches = {id(b): b for b, _ in self._held.values()}.values()
        return sum(x.nbytes for b in batches for x in (b.mixed, b.k, b.v, b.g, b.beta))

    def clear(self, slots: list[int], idx: torch.Tensor | None = None) -> None:
        """A request starts from nothing: zero its slots (a recycled slot holds the last one's).
        ``idx``: the slots on the device already (one copy for all layers)."""
        idx = to_device(slots, torch.long, self.conv.device) if idx is None else idx
        self.conv.index_fill_(0, idx, 0)
        self.recurrent.index_fill_(0, idx, 0)
        self._drop(slots)

    def begin_step(self, fresh_slots: list[int], resume: dict[int, int],
                   restores: Sequence[tuple[int, int]] = (), *, fla: bool = False,
                   on_device: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                   ) -> None:
        """Before a step's forward: clear the fresh slots, start the restored ones from their
        snapshots (restores: (snapshot slot, state slot)), settle the held ones (resume:
        slot -> num_computed of each row of the step that continues its own state; ``fla``:
        on fla's kernel, as settle says). ``on_device``: the fresh slots' and the restores'
        indices on the device already (GatedDeltaStates.plan makes them once a step for
        every layer)."""
        if fresh_slots:
            self.clear(fresh_slots, on_device[0])
        if restores:
            self.copy(restores, on_device[1])
            self._drop([to for _, to in restores])  # what a recycled slot held is not theirs
        if self._held:
            self.settle(resume, fla=fla)

    def copy(self, pairs: Sequence[tuple[int, int]], both: torch.Tensor | None = None) -> None:
        """Copy whole slots (from, to): a prefix snapshot taken or restored. A slot is one
        request's conv window and recurrent state; a snapshot slot is the same shape.
        ``both``: pair_indices(pairs) on the device already."""
        both = pair_indices(pairs, self.conv.device) if both is None else both
        src, dst = both[: len(pairs)], both[len(pairs) :]
        self.conv.index_copy_(0, dst, self.conv.index_select(0, src))
        self.recurrent.index_copy_(0, dst, self.recurrent.index_select(0, src))

    def hold(self, rows: VerifyRows, mixed: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor) -> None:
        """Keep a step's verification rows' inputs (shapes as _Held's) until settled."""
        self._drop(rows.slot_ids)
        held = _Held(rows.slot_ids, rows.starts, rows.lengths, mixed, k, v, g, beta)
        for r, slot in enumerate(rows.slot_ids):
            self._held[slot] = (held, r)

    def settle(self, resume: dict[int, int], *, fla: bool = False) -> None:
        """Advance each held slot whose request continues (slot -> its num_computed) by the
        positions of its verification row that stood, exactly as decoding only them would
        (``fla``: in one launch of fla's kernel, fla_gdn.fla_advance, the state carried
        in fp32 between the positions as the verification's own launch carried it)."""
        picked: dict[int, tuple[_Held, list[int], list[int]]] = {}
        for slot, computed in resume.items():
            got = self._held.pop(slot, None)
            if got is None:
                continue
            held, r = got
            kept = computed - held.starts[r]
            if not 1 <= kept <= held.lengths[r]:
                raise ValueError(
                    f"state slot {slot} holds a verification of positions {held.starts[r]}.."
                    f"{held.starts[r] + held.lengths[r] - 1}, but its request continues at "
                    f"position {computed}")
            picked.setdefault(id(held), (held, [], []))
            picked[id(held)][1].append(r)
            picked[id(held)][2].append(kept)
        for held, rows, kept in picked.values():
            # kept[i] is rows[i]'s, in the order the step lists the slots: line both up
            # with the held rows' own order
            order = sorted(range(len(rows)), key=rows.__getitem__)
            rows, kept = [rows[i] for i in order], [kept[i] for i in order]
            if rows != list(range(len(held.slots))):
                held = held.rows(rows)
            self._advance(held, kept, fla)
        self._compact({id(h): h for h, _, _ in picked.values()})

    def save_held(self, saves: Sequence[tuple[int, int, int]], *, fla: bool = False) -> None:
        """Write into snapshot slots the states of held verification rows after their first
        positions: (state slot, snapshot slot, positions), each exactly as settling that
        many would leave its slot (the same kernels); the slots and what they hold stay as
        they are, for the next step to settle."""
        picked: dict[int, tuple[_Held, list[tuple[int, int, int]]]] = {}
        for slot, snap, kept in saves:
            held, r = self._held[slot]
            if not 1 <= kept <= held.lengths[r]:
                raise ValueError(f"a snapshot after {kept} positions of a held row of "
                                 f"{held.lengths[r]} (state slot {slot})")
            picked.setdefault(id(held), (held, []))[1].append((r, snap, kept))
        for held, rows in picked.values():
            rows.sort()
            order = [r for r, _, _ in rows]
            part = held if order == list(range(len(held.slots))) else held.rows(order)
            self._advance(part, [kept for _, _, kept in rows], fla,
                          into=[snap for _, snap, _ in rows])

    def _advance(self, held: _Held, kept_list: list[int], fla: bool,
                 into: list[int] | None = None) -> None:
        """Advance held's slots by kept_list's positions of their rows; ``into``: write the
        states there instead (snapshot slots), the held slots left as they are."""
        n = len(held.slots)
        both = to_device(held.slots + kept_list + (into or []), torch.long, self.conv.device)
        slots, kept = both[:n], both[n : 2 * n]
        dst = both[2 * n :] if into is not None else slots
        window = gd.conv1d_window_after(self.conv.index_select(0, slots), held.mixed, kept)
        self.conv.index_copy_(0, dst, window.to(self.conv.dtype))
        states = self.recurrent.index_select(0, slots).float()
        if fla:  # grouped heads, one launch
            final = fla_gdn.fla_advance(held.k, held.v, held.g, held.beta, states, kept,
                                        self.recurrent.dtype)
            self.recurrent.index_copy_(0, dst, final.to(self.recurrent.dtype))
            return
        ratio = held.v.shape[2] // held.k.shape[2]  # each key head serves `ratio` value heads
        k = held.k.repeat_interleave(ratio, 2) if ratio > 1 else held.k
        gd.delta_rule_advance(k, held.v, held.g, held.beta, states, kept, self.recurrent.dtype)
        self.recurrent.index_copy_(0, dst, states.to(self.recurrent.dtype))

    def _drop(self, slots: list[int]) -> None:
        touched = {}
        for slot in slots:
            got = self._held.pop(slot, None)
            if got is not None:
                touched[id(got[0])] = got[0]
        self._compact(touched)

    def _compact(self, batches: dict[int, _Held]) -> None:
        """A batch some of whose rows are gone keeps only the rest: what is held stays at most
        one row per slot, whatever became of the others' requests."""
        for held in batches.values():
            left = [r for r, s in enumerate(held.slots)
                    if self._held.get(s, (None, -1))[0] is held]
            if left and len(left) < len(held.slots):
                kept = held.rows(left)
                for r, slot in enumerate(kept.slots):
                    self._held[slot] = (kept, r)

