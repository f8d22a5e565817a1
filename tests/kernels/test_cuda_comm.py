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


def test_a_failed_workspace_on_one_rank_keeps_every_rank_on_nccl(ranks):
    assert ranks[1]["workspace"]["line"] == (
        "tp all-reduce: NCCL (FlashInfer's workspace failed (RuntimeError: symmetric memory "
        "rendezvous failed))")
    assert ranks[0]["workspace"]["line"] == (
        "tp all-reduce: NCCL (another rank's workspace failed (its log says why))")
    assert ranks[0]["workspace"]["destroyed"] == [True]  # the rank that built one frees it
    for rank in (0, 1):
        assert ranks[rank]["workspace"]["fused"] == [False, False]


def test_the_fused_all_reduce_is_installed_once_the_ranks_group_exists(tmp_path):
    """The executor is prepared while each rank loads apart (no group yet: asking the other
    ranks then raised on every CUDA load at tp > 1); its fused all-reduce is installed by
    ``grouped``, which every rank runs once all joined."""
    got = _two_ranks(tp_comm.run_rank_loading, str(tmp_path / "init"))
    for rank in (0, 1):
        assert got[rank]["prepared"] == ""
        assert got[rank]["grouped"].startswith("tp all-reduce: fused with add + RMSNorm")
        assert got[rank]["fused"] == [True, True]
