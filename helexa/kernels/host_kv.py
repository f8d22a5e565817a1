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

from helexa.kernels.backends.base import to_device


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
    """Host twins of one rank's pool tensors and state tensors."""

    def __init__(self, blocks: list[torch.Tensor], states: list[torch.Tensor],
                 num_blocks: int, num_snapshots: int) -> None:
        self._blocks = [(t, _twin(t, num_blocks)) for t in blocks] if num_blocks else []
        self._states = [(t, _twin(t, num_snapshots)) for t in states] if num_snapshots else []
        self.nbytes = sum(h.nbytes for _, h in self._blocks + self._states)

    @torch.inference_mode()
    def apply(self, moves: Any) -> None:
        """Copy out (device -> host), then in (host -> device)."""
        _out(self._blocks, moves.blocks_out)
        _out(self._states, moves.states_out)
        _in(self._blocks, moves.blocks_in)
        _in(self._states, moves.states_in)


def _twin(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((n, *t.shape[1:]), dtype=t.dtype, device="cpu")


# The most bytes copied out to pinned memory before the host waits once for all of them
# (copy-out's staging: the host memory it holds at a time, beside the twins themselves).
STAGE_BYTES = 64 * 2**20


def _out(twins: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Device rows -> host twins: each tensor's rows gathered on the device and copied into
    pinned memory without waiting, the host waiting once per STAGE_BYTES of them, then
    scattered into the twins (a copy from the device into pageable memory would wait for
    the device to drain its queue once per tensor)."""
    if not pairs or not twins:
        return
    device = twins[0][0].device
    pin = device.type == "cuda"
    src = to_device([a for a, _ in pairs], torch.long, device)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def land() -> None:
        if pin:
            torch.cuda.current_stream(device).synchronize()
        for host, rows in staged:
            host.index_copy_(0, dst, rows)
        staged.clear()

    for dev, host in twins:
        rows = dev.index_select(0, src)
        out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
        staged.append((host, out.copy_(rows, non_blocking=pin)))
        if sum(r.nbytes for _, r in staged) >= STAGE_BYTES:
            land()
    land()


def _in(twins: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Host twins -> device rows: each tensor's rows gathered on the host into pinned memory
    and copied to the device without waiting (PyTorch's pinned allocator keeps a buffer
    until its copy has run)."""
    if not pairs or not twins:
        return
    device = twins[0][0].device
    pin = device.type == "cuda"
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst = to_device([b for _, b in pairs], torch.long, device)
    for dev, host in twins:
        rows = torch.empty((len(pairs), *host.shape[1:]), dtype=host.dtype, pin_memory=pin)
        torch.index_select(host, 0, src, out=rows)
        dev.index_copy_(0, dst, rows.to(device, non_blocking=pin))
