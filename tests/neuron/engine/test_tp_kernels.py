"""A tensor-parallel group's one kernel a kind (helexa/neuron/engine/tp_kernels.py), on
CPU over gloo as real processes: a kind one rank's card refused at load is refused on every
rank, the reason naming that rank, before any step runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import structlog
import torch
from support.pool_meter import INT8_KIND, RefusingMeters

from helexa.kernels.backends.executor import StepExecutor
from helexa.kernels.cuda import int8g
from helexa.neuron.engine import tp_kernels
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.engine.tp_messages import TpRefused

WHY = "the Triton kernel is off by 0.5 (relative; 0.01 allowed)"
EVENT = "kernels.cuda_grouped_matmul_fallback"


@pytest.mark.parametrize("refuser", [0, 1])
def test_tp2_a_kernel_kind_one_rank_refused_is_refused_on_every_rank(
        tiny_checkpoint, monkeypatch, capfd, refuser):
    """One rank's card refuses a grouped int8 kind (its probe failed there): the other
    rank, whose card would have run the kernel, records it refused too, logged as the
    kernel's fallback with a reason naming the refusing rank and its reason. Without the
    agreement the two ranks would launch different kernels, and capture different graphs."""
    monkeypatch.setattr(int8g._verdicts, "_by_kind", {})  # this process's verdicts: rank 0's
    script = RefusingMeters(free={0: [900 * 2**20], 1: [900 * 2**20]}, refuse={refuser: WHY})
    key = (torch.device("cpu"), *INT8_KIND)
    with structlog.testing.capture_logs() as logs:
        runner = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=96, block_size=8,
                             max_num_seqs=4, max_batched_tokens=256, tp_size=2,
                             memory_meter=script, context=64)
    runner.close()  # the worker's log lines written
    agreed = f"tensor-parallel rank {refuser} refused it: {WHY}"
    if refuser == 1:  # rank 0 (this process) adopts rank 1's refusal
        assert int8g._verdicts.get(key) == agreed
        assert [e["reason"] for e in logs if e["event"] == EVENT] == [agreed]
        return
    assert int8g._verdicts.get(key) == WHY  # its own
    worker = [json.loads(line) for line in capfd.readouterr().err.splitlines()
              if line.startswith("{") and EVENT in line]
    assert [e["reason"] for e in worker] == [agreed]  # rank 1 adopted rank 0's



def _rank0(executor: object) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), tp_rank=0,
                           backend=SimpleNamespace(executor=executor))


def test_the_backend_line_names_the_rank_that_refused(monkeypatch):
    """What status shows (the executor's describe): a kind this card proved, then refused
    by the group for another rank's card, says which rank and why."""
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor

    monkeypatch.setattr(int8g._verdicts, "_by_kind", {})
    monkeypatch.setenv("HELEXA_TRITON_INT8G", "1")
    ex = CudaGraphExecutor(SimpleNamespace(device=torch.device("cpu"), graph_rows=0,  # type: ignore[arg-type]
                                           torch_path=""))
    ex._kinds = (True, False, False)  # prepare found grouped int8 layers
    int8g._verdicts.record((torch.device("cpu"), *INT8_KIND), "")  # proved on this card
    ex.agreed()
    if int8g.unavailable():
        pytest.skip(f"the int8 kernel cannot be built here: {int8g.unavailable()}")
    assert ex.describe() == "no graphs; grouped int8 decode: Triton kernel"
    refused = TpRefused(1, "kernels.cuda_grouped_matmul", ["torch.bfloat16", 32, False], WHY)
    assert tp_kernels.adopt(_rank0(ex), [refused]) == 1
    assert ex.describe() == ("no graphs; grouped int8 decode: dequantised tiles "
                             f"(tensor-parallel rank 1 refused it: {WHY})")
    assert tp_kernels.adopt(_rank0(ex), [refused]) == 0  # refused already: said once


def test_a_moe_stack_proved_here_steps_back_when_the_group_refuses_its_kind(monkeypatch):
    """A MoE block's stacks proved at load read their experts in place only while their
    kind stands: refused by the group (another rank's card), the executor drops them, and
    the block's steps take the gathered copies, as that rank's do, sized as copies (the
    form's choice counts the three reads and writes a copy costs, not the kernel's one)."""
    from helexa.kernels import moe_experts
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor
    from helexa.kernels.cuda import moe_routed

    monkeypatch.setattr(moe_routed._verdicts, "_by_kind", {})
    stack = moe_routed.Stack("float", torch.zeros(8, 4, 3), n=4, k=3)
    experts = moe_routed.FloatExperts(None)
    experts.stacks = {"w13": stack, "w2": stack}
    moe_routed._verdicts.record(moe_routed._key(stack), "")  # proved on this card
    ex = CudaGraphExecutor(SimpleNamespace(device=torch.device("cpu"), graph_rows=0,  # type: ignore[arg-type]
                                           torch_path=""))
    ex._kinds, ex._experts = (False, False, True), [experts]  # as prepare leaves them
    ex.agreed()
    assert experts.stacks  # standing: nothing refused yet

    copies = []
    real = moe_experts.choose_form

    def spy(*a, **kw):
        copies.append(a[5])
        return real(*a, **kw)
    monkeypatch.setattr(moe_experts, "choose_form", spy)

    def step():  # a two-row decode step of 2 choices over 8 experts
        return moe_experts.run_experts(torch.zeros(2, 3), torch.zeros(8, 6, 3),
                                       torch.zeros(8, 3, 3), torch.zeros(2, 2, dtype=torch.long),
                                       torch.ones(2, 2), experts)
    step()
    refused = TpRefused(1, "kernels.cuda_moe_routed", ["float", 1, False, 0], WHY)
    assert tp_kernels.adopt(_rank0(ex), [refused]) == 1
    assert experts.stacks == {}
    assert experts(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.long),
                   torch.ones(1, 1)) is None  # the gathered copies serve
    step()
    assert copies == [1, 3]


class GraphsExecutor(StepExecutor):
    """Rank 0's executor as far as its graphs go: sizes to capture until the group says
    some rank's graphs cannot run (group_graphs), then none."""

    def __init__(self) -> None:
        self.told: list[str] = []
        self.ran = 0

    def graph_sizes(self) -> list[int]:
        return [] if any(self.told) else [2, 1]

    def group_graphs(self, refused: str) -> None:
        self.told.append(refused)

    def run(self, *args, **kw):  # type: ignore[no-untyped-def]
        self.ran += 1
        return super().run(*args, **kw)


@pytest.mark.parametrize("refuses", [False, True])
def test_tp2_graphs_run_on_every_rank_or_none(tiny_checkpoint, refuses):
    """Before rank 0 captures over a pool it asks every rank whether its graphs can run
    over its own (a quantised pool's Triton kernels may be refused on one card): where one
    cannot, rank 0 is told which and why and captures none, so every step runs eagerly on
    every rank; where all can, it captures as before."""
    why = "quantised KV: torch path, eager"
    script = RefusingMeters(free={0: [900 * 2**20], 1: [900 * 2**20]},
                            no_graphs={1: why} if refuses else {})
    runner = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=96, block_size=8,
                         max_num_seqs=4, max_batched_tokens=256, tp_size=2,
                         memory_meter=script, context=64)
    try:
        ex = runner.backend.executor = GraphsExecutor()
        runner._capture_graphs()
        assert ex.told == [f"tensor-parallel rank 1: {why}" if refuses else ""]
        assert ex.ran == (0 if refuses else 2)  # the capture steps, run on both ranks
    finally:
        runner.close()
