"""The fused all-reduce + add + RMSNorm's choice across ranks (cuda_comm.install), on CPU:
two gloo ranks stand in FlashInfer's comm module and the CUDA facts (tests/support/tp_comm.py).
Every rank must take the same path, or a step deadlocks: where one rank cannot (its GPU,
its workspace), none does and each says why; where all can, steps up to the workspace's
rows run the one kernel and agree with the plain path, and longer steps run the plain path.
No GPU runs here: what the fused kernel saves is unmeasured."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch
from support import tp_comm


def _two_ranks(target: Any, init: str) -> dict[int, dict[str, Any]]:
    """Run ``target(rank, init, results)`` in two spawned ranks: what each reported."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, init, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _two_ranks(tp_comm.run_rank, str(tmp_path_factory.mktemp("comm") / "init"))


def test_where_every_rank_can_the_norms_run_the_fused_kernel(ranks):
    for rank in (0, 1):
        got = ranks[rank]["fused"]
        assert got["line"] == ("tp all-reduce: fused with add + RMSNorm (FlashInfer) for steps "
                               f"of <= {tp_comm.ROWS} rows")
        assert got["fused"] == [True, True]
        for n in (0, 1):  # a norm with its weight, and one folded into its matmul
            for rows in (3, tp_comm.ROWS):
                assert got[f"rows{rows}_n{n}_kernel"] == 1
                assert got[f"rows{rows}_n{n}_sum_err"] == 0
                assert got[f"rows{rows}_n{n}_norm_err"] <= 0.02  # a bf16 ulp near 2
            assert got[f"rows{tp_comm.ROWS + 1}_n{n}_kernel"] == 0  # past the workspace: NCCL


def test_one_rank_on_an_unserved_gpu_keeps_every_rank_on_nccl(ranks):
    assert ranks[1]["capability"]["line"] == (
        "tp all-reduce: NCCL (compute capability 8.9 (fused all-reduce enabled on 9.0 and "
        "10.0))")
    assert ranks[0]["capability"]["line"] == (
        "tp all-reduce: NCCL (another rank cannot (its log says why))")
    for rank in (0, 1):
        got = ranks[rank]["capability"]
        assert got["fused"] == [False, False] and got["destroyed"] == []
        assert got["rows3_n0_kernel"] == 0


def test_a_card_short_of_the_workspace_keeps_every_rank_on_nccl(ranks):
    # rank 1 has 1 KiB free, under the workspace (4 x 2 ranks x ROWS rows x HIDDEN x 2 B)
    from helexa.checkpoint.memory import format_bytes, fused_allreduce_workspace

    need = format_bytes(fused_allreduce_workspace(tp_comm.HIDDEN, 2, tp_comm.ROWS))
    assert ranks[1]["memory"]["line"] == (
        f"tp all-reduce: NCCL (1.0 KiB free on GPU 0, under the {need} workspace)")
    assert ranks[0]["memory"]["line"] == (
        "tp all-reduce: NCCL (another rank cannot (its log says why))")
    for rank in (0, 1):
        assert ranks[rank]["memory"]["fused"] == [False, False]


def test_a_workspace_failing_on_one_rank_stops_the_load_naming_the_switch(ranks):
    """FlashInfer's workspace is a collective of its own: a rank failing inside it may leave
    the group's collectives out of step, so its load stops (the model fails; the other
    ranks' waits end with it) rather than agree on NCCL over mismatched collectives."""
    assert ranks[1]["workspace"]["error"] == (
        "FlashInfer's fused all-reduce workspace failed on rank 1 (RuntimeError: symmetric "
        "memory rendezvous failed); the group's collectives may be out of step, so the load "
        "stops: HELEXA_FUSED_ALLREDUCE=0 runs NCCL's all-reduce instead")


def test_the_switch_keeps_nccl(monkeypatch):
    from helexa.kernels.backends import cuda_comm

    monkeypatch.setenv(cuda_comm.ENV, "0")
    why, comm = cuda_comm._local_reason(tp_comm.StandInRuntime(), torch.device("cpu"), 2,
                                        torch.bfloat16, [0, 1], 1)
    assert (why, comm) == ("HELEXA_FUSED_ALLREDUCE=0", None)


def test_the_fused_all_reduce_is_installed_once_the_ranks_group_exists(tmp_path):
    """The executor is prepared while each rank loads apart (no group yet: asking the other
    ranks then raised on every CUDA load at tp > 1); its fused all-reduce is installed by
    ``grouped``, which every rank runs once all joined."""
    got = _two_ranks(tp_comm.run_rank_loading, str(tmp_path / "init"))
    for rank in (0, 1):
        assert got[rank]["prepared"] == ""
        assert got[rank]["grouped"].startswith("tp all-reduce: fused with add + RMSNorm")
        assert got[rank]["fused"] == [True, True]
