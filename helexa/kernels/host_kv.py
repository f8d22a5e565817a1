"""The host tier's buffers on one rank and the copies between them and the device pool
(the bookkeeping is helexa/neuron/engine/host_tier.py's).

Every tensor of a layer's pool that has a block dimension first (K and V, or a quantised
pool's data and scales; helexa/kernels/paged_kv.py, the cuda backend's NHD pool) gets a host
twin of `num_blocks` blocks; every linear-attention state tensor (conv, recurrent, a slot
dimension first) one of `num_snapshots` slots. The twins are pageable memory, exactly
their size: on CUDA the rows each copy moves are staged in pinned buffers (which PyTorch's
pinned allocator rounds up to a power of two and keeps once freed: the twins pinned took up
to twice `host_cache_mb`, and a resized tier kept the old ones), so copies still run at
the link's speed without a wait per tensor. A step's copies run out first, then in
(host_tier.KvMoves).
"""

from __future__ import annotations

from typing import Any

import torch

from helexa.kernels.backends.base import copies_done_event, to_device


def block_tensors(pool: Any) -> list[torch.Tensor]:
    """A layer pool's tensors with the block dimension first, covering all its bytes."""
    if getattr(pool, "quantized", False):
        return [pool.k_data, pool.k_scale, pool.v_data, pool.v_scale]
    return [pool.k_cache, pool.v_cache]


def state_tensors(states: Any) -> list[torch.Tensor]:
    """The linear-attention states' tensors (GatedDeltaStates), slot dimension first."""
    if states is None:
        return []
    return [t for layer in states.layers for t in (layer.conv, layer.recurrent)]


class HostKv:
    """Host twins of one rank's pool tensors and state tensors.

    A copy out does not hold the host: its rows are gathered on the device and copied into
    pinned memory without waiting, and land in the twins later, in the order queued: once
    their copies have run (checked at the next ``apply``), before any copy in (which may
    read the same host rows), or when more than STAGE_BYTES wait (the oldest first). A
    copy from the device into pageable memory would wait for the device once per tensor;
    waiting once per copy-out still drained the step the engine's lookahead held in flight."""

    def __init__(self, blocks: list[torch.Tensor], states: list[torch.Tensor],
                 num_blocks: int, num_snapshots: int) -> None:
        self._blocks = [(t, _twin(t, num_blocks)) for t in blocks] if num_blocks else []
        self._states = [(t, _twin(t, num_snapshots)) for t in states] if num_snapshots else []
        self.nbytes = sum(h.nbytes for _, h in self._blocks + self._states)
        self._pending: list[_Staged] = []

    @torch.inference_mode()
    def apply(self, moves: Any) -> None:
        """Copy out (device -> host), then in (host -> device)."""
        self._land(all_of_them=False)
        self._out(self._blocks, moves.blocks_out)
        self._out(self._states, moves.states_out)
        if moves.blocks_in or moves.states_in:
            self._land(all_of_them=True)
        _in(self._blocks, moves.blocks_in)
        _in(self._states, moves.states_in)

    @property
    def pending_bytes(self) -> int:
        return sum(p.nbytes for p in self._pending)

    def _land(self, all_of_them: bool) -> None:
        """The pending copies out, oldest first: all of them, or those already copied, and
        then the oldest while more than STAGE_BYTES wait."""
        while self._pending and (all_of_them or self._pending[0].done()
                                 or self.pending_bytes >= STAGE_BYTES):
            self._pending.pop(0).land()

    def _out(self, twins: list[tuple[torch.Tensor, torch.Tensor]],
             pairs: list[tuple[int, int]]) -> None:
        """Device rows -> pinned memory, queued; landed in the twins later (the class's). A
        part of the rows at a time, at most half STAGE_BYTES of the widest tensor's: a long
        context's eviction gathered whole was that many bytes of the device's free memory
        per tensor (512 MiB for a 262K-token Qwen3.5-27B session), beside the step."""
        if not pairs or not twins:
            return
        device = twins[0][0].device
        pin = device.type == "cuda"
        step = max(1, STAGE_BYTES // 2 // max(max(1, dev[0].nbytes) for dev, _ in twins))
        for at in range(0, len(pairs), step):
            part = pairs[at:at + step]
            src = to_device([a for a, _ in part], torch.long, device)
            dst = torch.tensor([b for _, b in part], dtype=torch.long)
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []
            for dev, host in twins:
                rows = dev.index_select(0, src)
                out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
                staged.append((host, out.copy_(rows, non_blocking=pin)))
                if sum(r.nbytes for _, r in staged) >= STAGE_BYTES:
                    self._queue(staged, dst, device)
            if staged:
                self._queue(staged, dst, device)  # (and lands what is copied already)

    def _queue(self, staged: list[tuple[torch.Tensor, torch.Tensor]], dst: torch.Tensor,
               device: torch.device) -> None:
        self._pending.append(_Staged(list(staged), dst, copied_event(device)))
        staged.clear()
        self._land(all_of_them=False)


def _twin(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((n, *t.shape[1:]), dtype=t.dtype, device="cpu")


# The most bytes copied out to pinned memory and not yet landed in the twins (copy-out's
# staging: the host memory it holds at a time, beside the twins themselves); past it the
# host waits for the oldest. Copy-in stages as much at a time, then waits for it.
STAGE_BYTES = 64 * 2**20


def copied_event(device: torch.device) -> Any:
    """An event recorded after a copy-out's device-to-host copies (None off a GPU, where
    they are done when queued)."""
    event = copies_done_event(device)
    if event is not None:
        event.record()
    return event


class _Staged:
    """Copied-out rows in pinned memory, landed in their twins once the copies have run:
    (twin, rows) pairs, the twins' rows to write (dst) and the event after the copies."""

    def __init__(self, staged: list[tuple[torch.Tensor, torch.Tensor]], dst: torch.Tensor,
                 event: Any) -> None:
        self.staged, self.dst, self.event = staged, dst, event
        self.nbytes = sum(r.nbytes for _, r in staged)

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def land(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        for host, rows in self.staged:
            host.index_copy_(0, self.dst, rows)


def _in(twins: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Host twins -> device rows: each tensor's rows gathered on the host into pinned memory
    and copied to the device without waiting, in parts of at most half STAGE_BYTES. Past
    STAGE_BYTES queued the host waits for the oldest part to have run (its event): PyTorch's
    pinned allocator keeps each buffer until its copy has, and keeps the memory once freed,
    so a restore staged whole (a long context's blocks, every layer's) stayed pinned for
    the process's life; now the next parts reuse the buffers, the host gathering one while
    the one before it copies."""
    if not pairs or not twins:
        return
    device = twins[0][0].device
    pin = device.type == "cuda"
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst = to_device([b for _, b in pairs], torch.long, device)
    queued: list[tuple[Any, int]] = []  # each part's event and bytes, oldest first
    for dev, host in twins:
        step = max(1, STAGE_BYTES // 2 // max(1, host[0].nbytes))  # rows in a part
        for at in range(0, len(pairs), step):
            rows = torch.empty((min(step, len(pairs) - at), *host.shape[1:]), dtype=host.dtype,
                               pin_memory=pin)
            torch.index_select(host, 0, src[at:at + step], out=rows)
            dev.index_copy_(0, dst[at:at + step], rows.to(device, non_blocking=pin))
            if (event := copied_event(device)) is None:
                continue  # off a GPU the copy is done
            queued.append((event, rows.nbytes))
            while len(queued) > 1 and sum(n for _, n in queued) > STAGE_BYTES:
                queued.pop(0)[0].synchronize()  # the oldest part has reached the device
