"""The Gated DeltaNet state backend: linear attention's own metadata, state and kernels
(as vLLM's ``v1/attention/backends/gdn_attn.py`` beside its attention backends).

A hybrid model's linear-attention layer declares its state (its LinearAttentionSpec,
helexa/checkpoint/layer_memory.py) and calls one op, :func:`gated_delta`, with its
in-projection's conv inputs and its gates; it keeps no state and does no bookkeeping.
:class:`GatedDeltaStates`, one per model runner, owns everything else:

- ``allocate`` carves each layer's state into per-request slots (helexa/kernels/linear_state.py);
- per step, ``plan`` builds :class:`GdnMetadata` from the runner's StepPlan (which slot
  each row reads and writes: decode rows, prefill chunks, speculative verification rows)
  and, before anything reads a slot, clears the fresh ones, copies prefix snapshots into
  the ones that resume from a prefix-cache hit, and settles the held ones (the rollback
  of rejected drafts, docs/speculation.md); the runner hands the metadata to the model's
  forward, then ``end_step`` copies the states the step keeps as snapshots (snapshot
  slots are carved beside the request slots, the same shape: docs/architecture.md), and
  ``save_held``, once the engine has judged a verification row's drafts, the state after
  its accepted positions up to a block boundary;
- per layer, ``forward`` runs the causal conv1d and the gated delta rule over the slots,
  choosing the kernel: on CUDA with flash-linear-attention installed, its fused recurrent
  decode (q and k passed grouped, as the layer has them) and, for 16-bit models, its
  chunked prefill (a step's prefills in one launch of each kernel: fla's ``cu_seqlens``);
  else helexa/kernels/gated_delta.py's torch forms (the reference, each key head repeated
  to its value heads, a prefill at a time); a step's prefills share one convolution
  (gated_delta.conv1d_prefill_varlen) whichever rule runs; a verification row runs token
  by token as decode (on fla, every row's tokens in one launch) and is held, its slot
  left as it was, until the next step settles it (one launch again on fla). A step of
  decode rows alone runs, where ``allocate`` proved it on the device, FlashInfer's pool
  decode: one kernel reads and writes each row's state in its slot (the states then
  V-major: LinearState.pool).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import structlog
import torch

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.kernels import fla_gdn as fla
from helexa.kernels import fla_norm
from helexa.kernels import flashinfer_gdn as fig
from helexa.kernels import gated_delta as gd
from helexa.kernels.backends import spans as sp
from helexa.kernels.backends.base import StepPlan, to_device
from helexa.kernels.cuda import conv_decode as cuda_conv
from helexa.kernels.linear_state import TORCH_DTYPES, LinearState, VerifyRows, pair_indices

log = structlog.get_logger(component="kernels")


@dataclass
class GdnMetadata:
    """Which state slot each row of a step uses: decode rows first, then longer rows."""

    backend: GatedDeltaStates
    decode_slots: torch.Tensor  # [num decode rows] int64
    decode_slots32: torch.Tensor | None = None  # the same, int32: FlashInfer's pool decode
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, slot)
    # the prefills' slots on the device (their conv runs as one); with two or more on fla,
    # their offsets (0, then the running sums of their lengths) and fla's chunk indices on
    # the device and the offsets on the host (their rule runs as one too)
    prefill_slots: torch.Tensor | None = None
    prefill_cu: torch.Tensor | None = None
    prefill_chunks: torch.Tensor | None = None
    prefill_cu_host: torch.Tensor | None = None
    fresh_slots: list[int] = field(default_factory=list)  # requests starting at token 0
    verify: VerifyRows | None = None
    resume: dict[int, int] = field(default_factory=dict)  # slot -> num_computed, others' rows
    restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, state slot)
    saves: list[tuple[int, int]] = field(default_factory=list)  # (state slot, snapshot)


class GatedDeltaStates:
    """One model runner's linear-attention states and kernels (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.specs: list[LinearAttentionSpec] = []
        self.layers: list[LinearState] = []
        self._fla = False
        self._fla_varlen = False  # a step's prefills in one launch (fla's cu_seqlens)
        self._fla_decode = False
        self._fla_gated = False  # pure decode steps: norms and gates in fla's kernel too
        self._fla_verify = False  # verification rows and their settling: one fla launch each
        self._fi_pool = False  # pure decode steps: FlashInfer's kernel, states in place
        self._conv_decode = gd.conv1d_decode_slots  # decode rows' conv: Triton's one launch
        self._a_log: dict[int, torch.Tensor] = {}  # each layer's A_log in fp32 (FlashInfer's)

    def describe(self) -> str:
        decode = ("FlashInfer pool decode (states in place)" if self._fi_pool else
                  f"{'fla fused' if self._fla_decode else 'torch'} decode"
                  f"{' (norms and gates in the kernel)' if self._fla_gated else ''}")
        verify = "fla, one launch" if self._fla_verify else "torch, token by token"
        conv = "Triton, one launch" if self._conv_decode is not gd.conv1d_decode_slots else "torch"
        prefill = ("fla chunked prefill (a step's prefills in one launch)" if self._fla_varlen
                   else f"{'fla' if self._fla else 'torch'} chunked prefill")
        return (f"gated delta rule: {prefill}, {decode}, "
                f"verification rows {verify}; conv1d decode {conv}")

    def allocate(self, specs: list[LinearAttentionSpec], num_slots: int,
                 decode_rows: int = 0) -> None:
        """Drop the old states, then give each layer (as its spec states) num_slots slots;
        FlashInfer's pool decode, where it runs, built now for decode steps of 1..decode_rows
        rows (the most a step decodes: the runner's max_num_seqs)."""
        self.layers = []
        self.specs = list(specs)
        self._a_log = {}
        self._fi_pool = bool(specs) and self._fi_pool_proved(specs[0])
        self.layers = [LinearState(s, num_slots, self.device, v_major=self._fi_pool)
                       for s in self.specs]
        if self._fi_pool and decode_rows:
            start, rows = time.perf_counter(), min(decode_rows, num_slots)
            pool = self.layers[0].pool
            assert pool is not None
            sizes = fig.warm_fi_pool(pool, specs[0].key_heads, specs[0].key_dim, rows,
                                     num_slots)
            log.info("kernels.flashinfer_gdn_built", rows=rows, sizes=sizes,
                     secs=round(time.perf_counter() - start, 1))
        self._fla = bool(specs) and fla.fla_available(self.device, TORCH_DTYPES[specs[0].dtype])
        self._fla_decode = bool(specs) and fla.fla_decode_available(self.device)
        # each kernel proved at load, as the first step runs: a failing one must not fail a step
        self._fla = self._fla and self._fla_proved(fla.probe_fla_chunked, specs[0])
        self._fla_varlen = self._fla and self._fla_proved(fla.probe_fla_varlen, specs[0])
        self._fla_decode = self._fla_decode and self._fla_proved(fla.probe_fla_decode, specs[0])
        self._fla_gated = (self._fla_decode and fla.fla_gated_available()
                           and self._fla_proved(fla.probe_fla_gated, specs[0]))
        self._fla_verify = self._fla_decode and self._fla_proved(fla.probe_fla_steps, specs[0])
        if specs:  # the gated norm runs wherever it imported, whatever decode runs
            s = specs[0]
            self._fla_said(fla_norm.probe_fla_norm(self.device, s.value_heads, s.value_dim,
                                                   TORCH_DTYPES[s.dtype]))
        self._conv_decode = gd.conv1d_decode_slots
        if specs:
            s = specs[0]
            self._conv_decode, why = cuda_conv.chosen(self.device, s.conv_channels,
                                                      s.conv_kernel, TORCH_DTYPES[s.dtype])
            if why:
                log.warning("kernels.cuda_conv_fallback", reason=why)

    def _fla_proved(self, probe: Callable[..., str], s: LinearAttentionSpec) -> bool:
        """An fla ``probe`` (helexa/kernels/fla_gdn.py) agrees at these layers' sizes."""
        return self._fla_said(probe(self.device, s.key_heads, s.value_heads, s.key_dim,
                                    s.value_dim, TORCH_DTYPES[s.dtype]))

    @staticmethod
    def _fla_said(why: str) -> bool:
        """A probe's verdict: True where it agreed; else its reason logged (the torch form
        runs) and False."""
        if why:
            log.warning("kernels.fla_fallback", reason=why)
        return not why

    def _fi_pool_proved(self, s: LinearAttentionSpec) -> bool:
        """FlashInfer's pool decode serves these layers and agrees with the torch forms on
        one small step at their sizes (else the reason is logged and the others run)."""
        dtype = TORCH_DTYPES[s.dtype]
        if fig.fi_pool_unavailable(self.device, dtype, s.key_dim, s.value_dim):
            return False  # not this device or model: nothing to say
        why = fig.probe_fi_pool(self.device, s.key_heads, s.value_heads, s.key_dim,
                               s.value_dim, dtype)
        if why:
            log.warning("kernels.flashinfer_gdn_fallback", reason=why)
        return not why

    @property
    def bytes_per_slot(self) -> int:
        """One request's state across all layers (this rank's share)."""
        return sum(state.bytes_per_slot for state in self.layers)

    @property
    def held_bytes(self) -> int:
        """Bytes the held verification rows take, all layers."""
        return sum(state.held_bytes for state in self.layers)

    def settle(self, resume: dict[int, int]) -> None:
        """Advance each held slot whose request continues (slot -> its num_computed) by the
        positions of its verification row that stood (plan does this for a step's rows)."""
        for state in self.layers:
            state.settle(resume, fla=self._fla_verify)

    # ---- per step ------------------------------------------------------------------------

    def plan(self, step: StepPlan) -> GdnMetadata:
        """This step's metadata; fresh slots cleared and held rows settled on every layer."""
        meta = self.build(step)
        # the fresh slots and the restores on the device once, for every layer
        on_device = (to_device(meta.fresh_slots, torch.long, self.device)
                     if meta.fresh_slots else None,
                     pair_indices(meta.restores, self.device) if meta.restores else None)
        for state in self.layers:
            state.begin_step(meta.fresh_slots, meta.resume, meta.restores, fla=self._fla_verify,
                             on_device=on_device)
        return meta

    def end_step(self, meta: GdnMetadata) -> None:
        """After a step's forward: copy the states the step asked to keep into their snapshot
        slots (a prefix-cache snapshot at a block boundary)."""
        if meta.saves:
            both = pair_indices(meta.saves, self.device)  # once, for every layer
            for state in self.layers:
                state.copy(meta.saves, both)

    def save_held(self, saves: list[tuple[int, int, int]]) -> None:
        """Once the engine knows a verification row's accepted drafts: (state slot, snapshot
        slot, positions) the state after that many of the row's held positions, a block
        boundary the accepted ones reach, into the snapshot slot (LinearState.save_held);
        the row stays held for the next step to settle (docs/architecture.md, "Hybrid
        models: linear-attention state")."""
        for state in self.layers:
            state.save_held(saves, fla=self._fla_verify)

    def build(self, step: StepPlan) -> GdnMetadata:
        """The slots of a step laid out flat as StepPlan says: one-token rows first (in
        order), then each longer sequence's tokens; a verification row (PrefillRow.verify)
        is padded with the others to [rows, longest] for the kernels."""
        rows = [(pos, slot) for pos, slot in zip(step.decode_positions, step.decode_state_slots,
                                                 strict=True)]
        rows += [(r.num_computed, r.state_slot) for r in step.prefills]
        if any(slot < 0 for _, slot in rows):
            raise ValueError("a hybrid model's sequence needs a state slot (SeqInput.state_slot)")
        dev = self.device
        restored = {slot for _, slot in step.state_restores}  # start from a snapshot instead
        meta = GdnMetadata(backend=self, decode_slots=to_device(
            step.decode_state_slots, torch.long, dev),
            fresh_slots=[slot for computed, slot in rows if computed == 0],
            resume={slot: computed for computed, slot in rows
                    if computed and slot not in restored},
            restores=list(step.state_restores), saves=list(step.state_saves))
        if self._fi_pool:
            meta.decode_slots32 = meta.decode_slots.to(torch.int32)
        verify = [r for r in step.prefills if r.verify]
        meta.prefills = [(r.start, r.end, r.state_slot) for r in step.prefills if not r.verify]
        if meta.prefills:  # one conv for all of them (and on fla, for two or more, one rule)
            slots = [slot for _, _, slot in meta.prefills]
            cu, chunks = (fla.varlen_layout(sp.lengths(meta.prefills))
                          if self._fla_varlen and len(slots) > 1 else ([], []))
            # one copy, no wait; each part at a 16-byte boundary, as fla's kernels were
            # built for at load (Triton builds a pointer's alignment into its kernel)
            parts = [xs + [0] * (len(xs) % 2) for xs in (slots, cu, chunks)]
            got = to_device([x for xs in parts for x in xs], torch.long, dev)
            at = list(accumulate([0] + [len(xs) for xs in parts]))
            meta.prefill_slots = got[:len(slots)]
            if cu:
                meta.prefill_cu = got[at[1]:at[1] + len(cu)]
                meta.prefill_chunks = got[at[2]:at[2] + len(chunks)].view(-1, 2)
                meta.prefill_cu_host = torch.tensor(cu)
        if verify:
            lengths = [r.end - r.start for r in verify]
            longest = max(lengths)
            # [B, T]: each row's flat rows, a short row repeating its last; valid positions
            index = [r.start + min(t, n - 1) for r, n in zip(verify, lengths, strict=True)
                     for t in range(longest)]
            # the real positions of [B, T] flattened (a bool mask as an index would make the
            # device count them for the host: a wait), and their flat rows
            valid = [b * longest + t for b, n in enumerate(lengths) for t in range(n)]
            flat = [index[i] for i in valid]
            slots = [r.state_slot for r in verify]
            # one copy from pinned memory that does not wait (one from a Python list would
            # hold the host until the device ran everything queued: a host sync)
            got = to_device(index + valid + flat + slots, torch.long, dev)
            cut = list(accumulate([0, len(index), len(valid), len(flat), len(slots)]))
            meta.verify = VerifyRows(
                index=got[cut[0]:cut[1]].view(len(verify), longest),
                valid=got[cut[1]:cut[2]],
                flat=got[cut[2]:cut[3]], slots=got[cut[3]:cut[4]], slot_ids=slots,
                starts=[r.num_computed for r in verify], lengths=lengths)
        return meta

    def forward(self, layer: int, mixed: torch.Tensor,
                gate: tuple[torch.Tensor, torch.Tensor] | gd.GateInputs,
                conv_weight: torch.Tensor, meta: GdnMetadata) -> torch.Tensor:
        """Linear layer ``layer`` over its slots: mixed [N, channels] conv inputs ([q | k | v]),
        gate the (g, beta) [N, v_heads] fp32 gates or their raw inputs (gd.GateInputs),
        conv_weight [channels, K] -> o [N, v_heads, v_dim] fp32 (in the model's dtype from
        FlashInfer's pool decode). q and k are L2-normalised (q scaled by k_dim^-0.5) after
        the conv. A step of decode rows alone with raw gates runs FlashInfer's pool kernel
        (flashinfer_gdn.fi_decode_pool: the states read and written in their slots) where proved
        at load, else fla's kernel with the norms and gates inside it (fla.fla_decode_gated)."""
        spec, state = self.specs[layer], self.layers[layer]
        n = mixed.shape[0]
        kh, vh, dk, dv = spec.key_heads, spec.value_heads, spec.key_dim, spec.value_dim
        nd = meta.decode_slots.numel()
        if nd == n:  # decode rows alone: the conv's output is the whole step's
            conv = self._conv_decode(mixed, conv_weight, state.conv, meta.decode_slots)
        else:
            conv = torch.empty_like(mixed)
            if nd:
                conv[:nd] = self._conv_decode(mixed[:nd], conv_weight, state.conv,
                                                   meta.decode_slots)
        if meta.prefill_slots is not None:  # the prefills: one conv over them all
            out, after = gd.conv1d_prefill_varlen(
                sp.rows(mixed, meta.prefills), conv_weight,
                state.conv.index_select(0, meta.prefill_slots), sp.lengths(meta.prefills))
            sp.put(conv, meta.prefills, out)
            state.conv.index_copy_(0, meta.prefill_slots, after.to(state.conv.dtype))
        rows = meta.verify  # token by token as decode, the slots left as they are (held)
        if rows is not None:
            mixed_rows = mixed[rows.index]  # [B, T, channels]
            windows = state.conv.index_select(0, rows.slots)
            steps = gd.conv1d_steps_unfolded if self._fla_verify else gd.conv1d_steps
            conv[rows.flat] = steps(mixed_rows, conv_weight, windows).flatten(0, 1)[rows.valid]
        q, k, v = conv.split([kh * dk, kh * dk, vh * dv], dim=-1)
        pure_decode = (isinstance(gate, gd.GateInputs) and nd == n and not meta.prefills
                       and rows is None)
        if pure_decode and self._fi_pool and meta.decode_slots32 is not None:
            assert isinstance(gate, gd.GateInputs) and state.pool is not None
            return fig.fi_decode_pool(q.reshape(n, kh, dk), k.reshape(n, kh, dk),
                                     v.reshape(n, vh, dv), gate, self._a_log32(layer, gate),
                                     state.pool, meta.decode_slots32, state.scratch)
        if pure_decode and self._fla_gated:
            assert isinstance(gate, gd.GateInputs)
            states = state.recurrent.index_select(0, meta.decode_slots)
            o, final = fla.fla_decode_gated(q.reshape(n, kh, dk), k.reshape(n, kh, dk),
                                            v.reshape(n, vh, dv), gate, states)
            state.recurrent.index_copy_(0, meta.decode_slots, final.to(state.recurrent.dtype))
            return o
        g, beta = gd.gates(gate) if isinstance(gate, gd.GateInputs) else gate
        q = gd.l2norm(q.reshape(n, kh, dk).float()) * dk ** -0.5
        k = key_heads = gd.l2norm(k.reshape(n, kh, dk).float())
        grouped_q = q
        if vh > kh and ((nd and not self._fla_decode) or (meta.prefills and not self._fla)
                        or (rows is not None and not self._fla_verify)):
            # the torch forms take a key head per value head: each key head serves
            # vh / kh consecutive value heads (fla's kernels take them grouped)
            q, k = q.repeat_interleave(vh // kh, 1), k.repeat_interleave(vh // kh, 1)
        v = v.reshape(n, vh, dv)
        o = torch.empty(n, vh, dv, dtype=torch.float32, device=mixed.device)
        if nd:
            states = state.recurrent.index_select(0, meta.decode_slots).float()
            if self._fla_decode:  # one fused launch, the heads grouped as they are
                o[:nd] = fla.fla_decode(grouped_q[:nd], key_heads[:nd], v[:nd], g[:nd],
                                        beta[:nd], states, mixed.dtype)
            else:
                o[:nd] = gd.delta_rule_decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states)
            state.recurrent.index_copy_(0, meta.decode_slots, states.to(state.recurrent.dtype))
        varlen = meta.prefill_cu is not None
        if varlen:  # every prefill in one launch of each of fla's kernels
            assert meta.prefill_slots is not None and meta.prefill_cu is not None
            assert meta.prefill_cu_host is not None and meta.prefill_chunks is not None
            got, finals = fla.fla_chunked_varlen(
                *(sp.rows(x, meta.prefills) for x in (grouped_q, key_heads, v, g, beta)),
                state.recurrent.index_select(0, meta.prefill_slots), meta.prefill_cu,
                meta.prefill_cu_host, meta.prefill_chunks, mixed.dtype)
            sp.put(o, meta.prefills, got)
            state.recurrent.index_copy_(0, meta.prefill_slots,
                                        finals.to(state.recurrent.dtype))
        for start, end, slot in () if varlen else meta.prefills:
            rest = (v[start:end], g[start:end], beta[start:end], state.recurrent[slot])
            o[start:end], final = (
                fla.fla_chunked(grouped_q[start:end], key_heads[start:end], *rest, mixed.dtype)
                if self._fla else gd.delta_rule_chunked(q[start:end], k[start:end], *rest))
            state.recurrent[slot] = final.to(state.recurrent.dtype)
        if rows is not None:
            states = state.recurrent.index_select(0, rows.slots).float()
            at = rows.index
            if self._fla_verify:  # every row's tokens in one launch
                got = fla.fla_steps(grouped_q[at], key_heads[at], v[at], g[at], beta[at],
                                    states, mixed.dtype)
            else:
                got = gd.delta_rule_steps(q[at], k[at], v[at], g[at], beta[at], states,
                                          state.recurrent.dtype)
            o[rows.flat] = got.flatten(0, 1)[rows.valid]
            state.hold(rows, mixed_rows, key_heads[at], v[at], g[at], beta[at])
        return o

    def _a_log32(self, layer: int, gate: gd.GateInputs) -> torch.Tensor:
        """The layer's A_log in fp32, made once (a step captured in a CUDA graph reads the
        copy the warm-up step made: the weights never change under a loaded model)."""
        got = self._a_log.get(layer)
        if got is None:
            got = self._a_log[layer] = gate.A_log.detach().float().contiguous()
        return got


def gated_delta(mixed: torch.Tensor, gate: tuple[torch.Tensor, torch.Tensor] | gd.GateInputs,
                conv_weight: torch.Tensor, layer: int, meta: GdnMetadata) -> torch.Tensor:
    """The one op a Gated DeltaNet layer calls (its index among the model's linear-attention
    layers: ``layer``): see GatedDeltaStates.forward."""
    return meta.backend.forward(layer, mixed, gate, conv_weight, meta)
