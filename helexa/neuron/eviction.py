"""Room on a model's devices: how much memory each card has, and whom to evict for it.

Policy only (as helexa/router/selection.py): `evictions_for` reads the
resident models' footprints and says which to unload so a new one fits every
card it uses, or refuses with the arithmetic; `Residency` does the unloading.
A card's size is `server.device_memory_mb`, else what nvidia-smi reports (the
daemon never opens a CUDA context of its own).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable

from helexa.config.schema import NeuronConfig
from helexa.neuron.resident_model import ModelState, ResidentModel
from helexa.refusal import Refusal

MIB = 1024 * 1024


def evictions_for(new: ResidentModel, models: Iterable[ResidentModel],
                  cap_mb: int) -> list[ResidentModel]:
    """The least recently used idle models of equal or lower priority, sharing a card with
    `new`, to unload (oldest first) until `new` fits every card of `cap_mb` MiB; [] when it
    fits already. Refuses (overloaded) when no such choice makes room."""
    others = [m for m in models if m is not new]
    cap = cap_mb * MIB

    def used_on(dev: str) -> int:
        return sum(m.footprint_bytes for m in others
                   if m.state != ModelState.FAILED and dev in m.devices)

    short = {d: used_on(d) + new.footprint_bytes - cap for d in new.devices}
    if all(v <= 0 for v in short.values()):
        return []
    candidates = sorted(
        (m for m in others
         if m.state == ModelState.READY and not m.busy
         and m.entry.priority <= new.entry.priority and set(m.devices) & set(new.devices)),
        key=lambda m: m.last_used_unix_ms)
    chosen: list[ResidentModel] = []
    for m in candidates:
        if all(v <= 0 for v in short.values()):
            break
        chosen.append(m)
        for d in m.devices:
            if d in short:
                short[d] -= m.footprint_bytes
    if any(v > 0 for v in short.values()):
        need = new.footprint_bytes // MIB
        raise Refusal("overloaded",
                      f"not enough device memory for `{new.model_id}`: it needs {need} MiB "
                      f"per card of {cap_mb} MiB, and no idle model of priority "
                      f"<= {new.entry.priority} can make room")
    return chosen


def device_memory_mb(cfg: NeuronConfig, devices: list[str]) -> int | None:
    """MiB per card: server.device_memory_mb, else what nvidia-smi reports (smallest)."""
    if cfg.server.device_memory_mb is not None:
        return cfg.server.device_memory_mb
    sizes = [_cuda_memory_mb(d) for d in devices]
    return min(sizes) if sizes and None not in sizes else None  # type: ignore[type-var]


_CARD_MB: dict[str, int] = {}  # what nvidia-smi said, per card (a failure is asked again)


def _cuda_memory_mb(device: str) -> int | None:
    """Total memory of `cuda:N` from nvidia-smi (no CUDA context in the daemon), else None."""
    if not device.startswith("cuda"):
        return None
    card = nvidia_smi_card(device)
    if card not in _CARD_MB:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                                  "--format=csv,noheader,nounits", "-i", card],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                return None
            _CARD_MB[card] = int(out.stdout.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
    return _CARD_MB[card]


def nvidia_smi_card(device: str) -> str:
    """How nvidia-smi names CUDA's `cuda:N`: N counts the cards CUDA_VISIBLE_DEVICES lists
    (their indexes, UUIDs or bus ids, which ``-i`` takes too), which nvidia-smi ignores;
    with none listed, N itself (cards numbered in bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID
    numbers them: docs/operating.md)."""
    index = int(device.partition(":")[2] or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return visible[index] if index < len(visible) else str(index)
