"""Tensor parallelism on CUDA: all-reduce, residual add and RMSNorm in one kernel.

At tp > 1 every decoder layer's attention and MLP outputs are partial sums that the norm
after them reduces (helexa/neuron/models/layers.py, ``RMSNorm.add``): the plain path is an
NCCL all-reduce, an add and the norm, three launches and a round of NCCL's protocol per
norm, about 130 a step for a 64-layer model. Where FlashInfer's communication kernels can
run, :func:`install` gives every such norm FlashInfer's ``allreduce_fusion`` with the
``kARResidualRMSNorm`` pattern (TensorRT-LLM's one-shot / two-shot all-reduce over
peer-mapped symmetric buffers, the residual add and the norm in one kernel, graph
capturable), for steps of up to :func:`helexa.checkpoint.memory.fused_allreduce_rows`
rows: decode, verification and short prefill chunks. Longer steps keep NCCL, which is
near the link's bandwidth there.

Where it runs (every rank must agree, or a step would deadlock with one rank in NCCL and
another in the fused kernel): FlashInfer's ``comm`` module imports; tp is 2, 4 or 8; the
model's dtype is bf16 or fp16; every rank's GPU is compute capability 9.0 or 10.0 (the
ones vLLM enables this fusion on); every pair of the ranks' GPUs has peer access; every
card has the workspace's bytes free; and ``HELEXA_FUSED_ALLREDUCE`` is not ``0``. Each
rank decides locally, the group takes the minimum over ranks (two small collectives at
load), and if any rank cannot, none does and the reason is said (the load log, Watch and
``ctl status`` through the executor's ``describe``). Then every rank builds its part of
the workspace, which is itself a collective (FlashInfer's symmetric-memory rendezvous
and barriers): a rank whose part fails there may leave the group's collectives out of
step, which no agreement afterwards could mend, so that failure stops the load with
the reason and the switch. The workspace is counted in ``helexa plan`` (memory.py
allreduce_workspace_bytes).

FlashInfer's calls sit behind :class:`CommRuntime` so that CPU tests can stand in for them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from helexa.checkpoint.memory import format_bytes, fused_allreduce_workspace

log = structlog.get_logger(component="kernels")

ENV = "HELEXA_FUSED_ALLREDUCE"  # "0": NCCL's all-reduce, whatever the cards
WORLD_SIZES = (2, 4, 8)
CAPABILITIES = ((9, 0), (10, 0))
DTYPES = (torch.bfloat16, torch.float16)


class CommRuntime:
    """FlashInfer's communication calls and the CUDA facts the choice reads (a test stands
    in one that runs on CPU)."""

    def module(self) -> Any:
        """flashinfer.comm (ImportError, or any error its import raises, when absent)."""
        import flashinfer.comm as comm

        return comm

    def capability(self, device: torch.device) -> tuple[int, int]:
        major, minor = torch.cuda.get_device_capability(device)
        return major, minor

    def peer_access(self, a: int, b: int) -> bool:
        return bool(torch.cuda.can_device_access_peer(a, b))

    def free_bytes(self, device: torch.device) -> int:
        return int(torch.cuda.mem_get_info(device)[0])

    def workspace(self, comm: Any, *, rank: int, world: int, rows: int, hidden: int,
                  dtype: torch.dtype) -> Any:
        """One rank's part of the group's symmetric buffers (a collective over the group)."""
        return comm.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=world, rank=rank, max_token_num=rows,
            hidden_dim=hidden, dtype=dtype)


@dataclass
class FusedAddNorm:
    """``RMSNorm.fused``: (partial sums y, residual x, weight | None, eps) -> (norm(x + Σy),
    x + Σy) in one kernel, or None for a step of more rows than the workspace holds."""

    comm: Any
    workspace: Any
    rows: int
    ones: torch.Tensor  # the weight of a norm folded into the next matmul

    def __call__(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if y.shape[0] > self.rows:
            return None
        normed, summed = torch.empty_like(x), torch.empty_like(x)
        self.comm.allreduce_fusion(
            input=y.contiguous(), workspace=self.workspace,
            pattern=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
            residual_in=x.contiguous(), residual_out=summed, norm_out=normed,
            rms_gamma=self.ones if weight is None else weight, rms_eps=eps)
        return normed, summed


def _local_reason(runtime: CommRuntime, device: torch.device, world: int,
                  dtype: torch.dtype, peers: list[int], need: int) -> tuple[str, Any]:
    """Why this rank cannot run the fused kernel ("" when it can), and flashinfer.comm;
    ``need``: its workspace's bytes on this card."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0", None
    if world not in WORLD_SIZES:
        return f"tp {world} (FlashInfer's fused all-reduce serves tp 2, 4, 8)", None
    if dtype not in DTYPES:
        return f"{str(dtype).removeprefix('torch.')} (fused all-reduce: bf16, fp16)", None
    cap = runtime.capability(device)
    if cap not in CAPABILITIES:
        return (f"compute capability {cap[0]}.{cap[1]} (fused all-reduce enabled on 9.0 and "
                "10.0)"), None
    mine = device.index if device.index is not None else 0
    for other in peers:
        if other != mine and not runtime.peer_access(mine, other):
            return f"no peer access from GPU {mine} to GPU {other}", None
    free = runtime.free_bytes(device)
    if free < need:
        return (f"{format_bytes(free)} free on GPU {mine}, under the "
                f"{format_bytes(need)} workspace"), None
    try:
        return "", runtime.module()
    except Exception as e:  # noqa: BLE001 - any import failure: not available, said why
        return f"flashinfer.comm does not import ({type(e).__name__}: {e})", None


def _all_agree(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def install(norms: list[Any], *, hidden: int, dtype: torch.dtype, device: torch.device,
            rows: int, runtime: CommRuntime | None = None) -> str:
    """Give each of ``norms`` (the model's RMSNorms whose add reduces) the fused kernel where
    every rank of the default group can run it; every rank calls this at load, in the same
    order. Returns the line ``describe`` shows: what runs, and why not fused."""
    runtime = runtime or CommRuntime()
    rank, world = dist.get_rank(), dist.get_world_size()
    index = torch.tensor([device.index if device.index is not None else 0], dtype=torch.int32,
                         device=device)
    gathered = [torch.zeros_like(index) for _ in range(world)]
    dist.all_gather(gathered, index)
    peers = [int(t.item()) for t in gathered]
    need = fused_allreduce_workspace(hidden, world, rows)
    reason, comm = _local_reason(runtime, device, world, dtype, peers, need)
    if not _all_agree(not reason, device):
        why = reason or "another rank cannot (its log says why)"
        log.info("kernels.tp_allreduce", fused=False, reason=why)
        return f"tp all-reduce: NCCL ({why})"
    try:  # a collective of FlashInfer's own: its failure is the group's (module docstring)
        workspace = runtime.workspace(comm, rank=rank, world=world, rows=rows, hidden=hidden,
                                      dtype=dtype)
    except Exception as e:
        raise RuntimeError(
            f"FlashInfer's fused all-reduce workspace failed on rank {rank} "
            f"({type(e).__name__}: {e}); the group's collectives may be out of step, so the "
            f"load stops: {ENV}=0 runs NCCL's all-reduce instead") from e
    op: Callable[..., Any] = FusedAddNorm(comm, workspace, rows,
                                          torch.ones(hidden, dtype=dtype, device=device))
    for norm in norms:  # steps over ``rows``: NCCL, then the norm's add kernel if it has one
        norm.fused = op
    log.info("kernels.tp_allreduce", fused=True, rows=rows, norms=len(norms))
    return f"tp all-reduce: fused with add + RMSNorm (FlashInfer) for steps of <= {rows} rows"
