"""A tensor-parallel group's one choice per kernel kind (docs/architecture.md,
"Attention backends"): a Triton kernel proves itself at load on each rank's own card (helexa/kernels/
cuda Verdicts: int8g, int4_tiles, moe_routed), and a kind any rank's card refused is
refused on every rank, so that the ranks launch the same kernels and their CUDA graphs
capture the same work. Each worker rank's TpReady carries its refusals; once the group has
formed, before any step, rank 0 adopts them and sends every rank's (TpAgree), which each
rank adopts in turn: recorded with the refusing rank and its reason, logged as the
kernel's ``_fallback`` event, and in the backend line (status)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from helexa.kernels import cuda as cuda_kernels
from helexa.neuron.engine.tp_messages import TpAgree, TpRefused

if TYPE_CHECKING:
    from helexa.neuron.engine.tp_worker import TpWorkers


def _kernels() -> None:
    """Every kernel whose verdicts a group agrees on, registered (imported) here."""
    from helexa.kernels.cuda import int4_tiles, int8g, moe_routed  # noqa: F401


def own(runner: Any) -> list[TpRefused]:
    """The kinds this rank's card refused (its TpReady's)."""
    _kernels()
    return [TpRefused(runner.tp_rank, event, kind, why)
            for event, kind, why in cuda_kernels.refusals(runner.device)]


def adopt(runner: Any, refused: list[TpRefused]) -> int:
    """The other ranks' refusals, refused here too (each reason naming its rank); how many
    kinds that refused here."""
    _kernels()
    changed = sum(cuda_kernels.adopt(runner.device, r.kernel, r.kind,
                                     f"tensor-parallel rank {r.rank} refused it: {r.why}")
                  for r in refused if r.rank != runner.tp_rank)
    if changed:
        runner.backend.executor.agreed()  # what it describes, as now chosen
    return changed


def agree(tp: TpWorkers, runner: Any, ready: list[list[TpRefused]]) -> None:
    """Rank 0, once every rank's TpReady is in (``ready``: each worker's refusals): the
    group's refusals adopted here and sent to every rank, before any step."""
    refused = own(runner) + [r for rank in ready for r in rank]
    adopt(runner, refused)
    tp._send(TpAgree(refused))
