"""One rank of tests/kernels/test_cuda_comm.py: a gloo group of two CPU processes runs
cuda_comm.install against a stand-in of FlashInfer's comm module and the CUDA facts, as
each rank of a GPU host would, and reports what it saw."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from helexa.kernels.backends import cuda_comm
from helexa.neuron.models.layers import RMSNorm

HIDDEN, ROWS = 64, 8


class _Workspace:
    def __init__(self) -> None:
        self.destroyed = False

    def destroy(self) -> None:
        self.destroyed = True


class StandInComm:
    """flashinfer.comm's two calls, done on the gloo group with the documented semantics:
    norm_out = rms_norm(residual_in + Σ input) × gamma, residual_out = residual_in + Σ input."""

    class AllReduceFusionPattern:
        kARResidualRMSNorm = 1

    def __init__(self) -> None:
        self.calls = 0
        self.workspaces: list[_Workspace] = []

    def allreduce_fusion(self, *, input: torch.Tensor, workspace: Any, pattern: int,
                         residual_in: torch.Tensor, residual_out: torch.Tensor,
                         norm_out: torch.Tensor, rms_gamma: torch.Tensor,
                         rms_eps: float) -> torch.Tensor:
        assert pattern == self.AllReduceFusionPattern.kARResidualRMSNorm
        assert workspace in self.workspaces and not workspace.destroyed
        for t in (input, residual_in, residual_out, norm_out):
            assert t.is_contiguous() and t.shape == input.shape  # as its _flatten_checked
        assert rms_gamma.shape == (input.shape[-1],)
        self.calls += 1
        total = input.clone()
        dist.all_reduce(total)
        residual_out.copy_(residual_in + total)
        xf = residual_out.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)
        norm_out.copy_(normed.to(input.dtype) * rms_gamma)
        return norm_out


class StandInRuntime(cuda_comm.CommRuntime):
    def __init__(self, capability: tuple[int, int] = (9, 0), fail_workspace: bool = False,
                 free: int = 1 << 40):
        self.comm = StandInComm()
        self.cap, self.fail, self.free = capability, fail_workspace, free

    def free_bytes(self, device: torch.device) -> int:
        return self.free

    def module(self) -> Any:
        return self.comm

    def capability(self, device: torch.device) -> tuple[int, int]:
        return self.cap

    def peer_access(self, a: int, b: int) -> bool:
        return True

    def workspace(self, comm: Any, *, rank: int, world: int, rows: int, hidden: int,
                  dtype: torch.dtype) -> Any:
        if self.fail:
            raise RuntimeError("symmetric memory rendezvous failed")
        ws = _Workspace()
        self.comm.workspaces.append(ws)
        return ws


def _norms(folded: bool) -> list[RMSNorm]:
    out = []
    for seed in range(2):
        norm = RMSNorm(HIDDEN, 1e-6, dtype=torch.bfloat16, reduce=True)
        g = torch.Generator().manual_seed(seed)
        norm.weight.data = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)
        norm.folded = folded and seed == 1  # a norm folded into its matmul: gamma of ones
        out.append(norm)
    return out


def _case(rank: int, runtime: StandInRuntime, steps: bool = True) -> dict[str, Any]:
    """``steps``: then run steps through the norms (not after a rank's load stopped)."""
    norms = _norms(folded=True)
    try:
        line = cuda_comm.install(norms, hidden=HIDDEN, dtype=torch.bfloat16,
                                 device=torch.device("cpu"), rows=ROWS, runtime=runtime)
    except RuntimeError as e:
        return {"error": str(e)}
    got: dict[str, Any] = {"line": line, "fused": [n.fused is not None for n in norms],
                           "destroyed": [w.destroyed for w in runtime.comm.workspaces]}
    if not steps:
        return got
    g = torch.Generator().manual_seed(100 + rank)  # each rank's own partial sums
    for rows in (3, ROWS, ROWS + 1):
        y = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(7)).to(
            torch.bfloat16)  # the residual stream: the same on every rank
        for i, norm in enumerate(norms):
            before = runtime.comm.calls
            h, s = norm.add(y.clone(), x)
            fused = norm.fused
            norm.fused = None
            h_ref, s_ref = norm.add(y.clone(), x)  # the plain path: all-reduce, add, norm
            norm.fused = fused
            got[f"rows{rows}_n{i}_kernel"] = runtime.comm.calls - before
            got[f"rows{rows}_n{i}_sum_err"] = (s.float() - s_ref.float()).abs().max().item()
            got[f"rows{rows}_n{i}_norm_err"] = (h.float() - h_ref.float()).abs().max().item()
    return got


def run_rank(rank: int, init_file: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results.put((rank, {
            "fused": _case(rank, StandInRuntime()),
            "capability": _case(rank, StandInRuntime(capability=(8, 9) if rank else (9, 0))),
            "memory": _case(rank, StandInRuntime(free=(1 << 10) if rank else 1 << 40)),
            "workspace": _case(rank, StandInRuntime(fail_workspace=rank == 1), steps=False),
        }))
    finally:
        dist.destroy_process_group()


class _Attention:
    """What CudaGraphExecutor reads of its attention backend at load (no graphs)."""

    graph_rows, heads, device = 0, 0, torch.device("cpu")


class _Model(torch.nn.Module):
    """What CudaGraphExecutor.prepare / grouped read of a loaded model."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(_norms(folded=False))
        self.cfg = type("Cfg", (), {"hidden_size": HIDDEN})()
        self.attention_layers = [type("Attn", (), {"num_heads": 4, "head_dim": 16})()]
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(4, HIDDEN, dtype=torch.bfloat16)


def run_rank_loading(rank: int, init_file: str, results: Any) -> None:
    """A rank's load as ModelRunner orders it: the executor prepared before the group
    exists (the ranks load apart), then grouped once every rank joined."""
    import os

    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor

    os.environ["HELEXA_CUDA_FUSED"] = "0"  # the norms' one-kernel forms: not this test's
    runtime = StandInRuntime()
    executor = CudaGraphExecutor(_Attention(), comm=runtime)  # type: ignore[arg-type]
    model = _Model()
    executor.prepare(model, [], max_num_seqs=ROWS, max_batched_tokens=64, tp_size=2)
    prepared = executor.allreduce
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        executor.grouped(model)
        results.put((rank, {"prepared": prepared, "grouped": executor.allreduce,
                            "fused": [n.fused is not None for n in model.norms]}))
    finally:
        dist.destroy_process_group()
