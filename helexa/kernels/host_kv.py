"""The host tier's buffers on one rank and the copies between them and the device pool
(the bookkeeping is helexa/neuron/engine/host_tier.py's).

Every tensor of a layer's pool that has a block dimension first (K and V, or a quantised
pool's data and scales; helexa/kernels/paged_kv.py, the cuda backend's NHD pool) gets a host
twin of `num_blocks` blocks; every linear-attention state tensor (conv, recurrent, a slot
dimension first) one of `num_snapshots` slots. On CUDA the twins are pinned, so copies run
at the link's speed. A step's copies run out first, then in (host_tier.KvMoves).
"""

from __future__ import annotations

from typing import Any

import torch


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
        pin = any(t.device.type == "cuda" for t in blocks + states)
        self._blocks = [(t, _twin(t, num_blocks, pin)) for t in blocks] if num_blocks else []
        self._states = [(t, _twin(t, num_snapshots, pin)) for t in states] \
            if num_snapshots else []
        self.nbytes = sum(h.nbytes for _, h in self._blocks + self._states)

    @torch.inference_mode()
    def apply(self, moves: Any) -> None:
        """Copy out (device -> host), then in (host -> device)."""
        _out(self._blocks, moves.blocks_out)
        _out(self._states, moves.states_out)
        _in(self._blocks, moves.blocks_in)
        _in(self._states, moves.states_in)


def _twin(t: torch.Tensor, n: int, pin: bool) -> torch.Tensor:
    host = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device="cpu")
    return host.pin_memory() if pin else host


def _index(pairs: list[tuple[int, int]], which: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([p[which] for p in pairs], dtype=torch.long, device=device)


def _out(twins: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    if not pairs or not twins:
        return
    src = _index(pairs, 0, twins[0][0].device)
    dst = _index(pairs, 1, torch.device("cpu"))
    for dev, host in twins:
        host.index_copy_(0, dst, dev.index_select(0, src).to("cpu"))


def _in(twins: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    if not pairs or not twins:
        return
    device = twins[0][0].device
    src = _index(pairs, 0, torch.device("cpu"))
    dst = _index(pairs, 1, device)
    for dev, host in twins:
        rows = host.index_select(0, src)
        dev.index_copy_(0, dst, rows.to(device, non_blocking=rows.is_pinned()))
