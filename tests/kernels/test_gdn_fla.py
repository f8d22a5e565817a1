"""The Gated DeltaNet state backend on flash-linear-attention's fused recurrent decode,
against a stand-in for fla's kernel (written from fla's documented semantics: grouped key
heads, value head h reading key head h // (v_heads / k_heads), state [N, HV, K, V]): the
calls it gets carry q and k grouped, and the backend's output and states are the plain
torch path's. The plain path itself is what tests/kernels/test_gated_delta.py checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.kernels import gated_delta as gd
from helexa.kernels.backends.base import PrefillRow, StepPlan
from helexa.kernels.backends.gdn import GatedDeltaStates

KH, VH, DK, DV, CONV_K = 2, 6, 8, 4, 4  # a group of 3 value heads per key head


class StandInRecurrent:
    """fla's fused_recurrent_gated_delta_rule as documented, in torch; records each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
                 output_final_state: bool, use_qk_l2norm_in_kernel: bool = False,
                 use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                 dt_bias: torch.Tensor | None = None, use_beta_sigmoid_in_kernel: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"q": q.shape, "k": k.shape, "v": v.shape, "scale": scale,
                           "state": initial_state.shape, "final": output_final_state,
                           "in_kernel": (use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                         use_beta_sigmoid_in_kernel)})
        group = v.shape[2] // q.shape[2]
        state = initial_state.float().clone()
        if use_gate_in_kernel:  # fla's kernel: g = -exp(A_log) softplus(g + dt_bias)
            assert A_log is not None and dt_bias is not None
            g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias.float())
        if use_beta_sigmoid_in_kernel:
            beta = beta.float().sigmoid()
        out = []
        for t in range(q.shape[1]):  # each value head reads its group's key head
            qt, kt = q[:, t].float(), k[:, t].float()
            if use_qk_l2norm_in_kernel:  # x / sqrt(sum x^2 + 1e-6), then q's scale
                qt, kt = gd.l2norm(qt), gd.l2norm(kt)
            qt = qt.repeat_interleave(group, 1) * scale
            kt = kt.repeat_interleave(group, 1)
            out.append(gd.delta_rule_decode(qt, kt, v[:, t], g[:, t], beta[:, t], state))
        return torch.stack(out, 1).to(v.dtype), state


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandInRecurrent:
    fake = StandInRecurrent()
    monkeypatch.setattr(gd, "_fla_recurrent", fake)
    return fake


def _decode_inputs(b: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = gd.l2norm(torch.randn(b, KH, DK, generator=gen)) * DK ** -0.5
    k = gd.l2norm(torch.randn(b, KH, DK, generator=gen))
    v = torch.randn(b, VH, DV, generator=gen)
    g = -torch.rand(b, VH, generator=gen)
    beta = torch.rand(b, VH, generator=gen)
    states = torch.randn(b, VH, DK, DV, generator=gen)
    return [q, k, v, g, beta, states]


def test_fla_decode_passes_grouped_heads_and_matches_the_torch_step(stand_in):
    q, k, v, g, beta, states = _decode_inputs(3)
    want_states = states.clone()
    want = gd.delta_rule_decode(q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g,
                                beta, want_states)
    got = gd.fla_decode(q, k, v, g, beta, states, torch.float32)
    assert stand_in.calls == [{"q": (3, 1, KH, DK), "k": (3, 1, KH, DK), "v": (3, 1, VH, DV),
                               "scale": 1.0, "state": (3, VH, DK, DV), "final": True,
                               "in_kernel": (False, False, False)}]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32, the same sums
    torch.testing.assert_close(states, want_states, rtol=1e-6, atol=1e-6)


def _spec() -> LinearAttentionSpec:
    return LinearAttentionSpec(key_heads=KH, value_heads=VH, key_dim=DK, value_dim=DV,
                               conv_channels=2 * KH * DK + VH * DV, conv_kernel=CONV_K,
                               dtype="fp32")


def _states(fla_decode: bool) -> GatedDeltaStates:
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    states._fla_decode = fla_decode  # as allocate sets it on CUDA with fla installed
    states._fla_gated = fla_decode and gd.fla_gated_available()
    return states


def _steps(states: GatedDeltaStates) -> list[torch.Tensor]:
    """A prefill of 5 tokens into slot 1, then a step decoding slot 1 beside a fresh
    prefill into slot 2, then two pure decode steps of both: each step's outputs."""
    gen = torch.Generator().manual_seed(7)
    channels = _spec().conv_channels
    weight = torch.randn(channels, CONV_K, generator=gen)
    outs = []
    for plan, rows in zip(_plans(), [5, 4, 2, 2], strict=True):
        mixed = torch.randn(rows, channels, generator=gen)
        g = -torch.rand(rows, VH, generator=gen)
        beta = torch.rand(rows, VH, generator=gen)
        outs.append(states.forward(0, mixed, (g, beta), weight, states.plan(plan)))
    return outs + [states.layers[0].recurrent.clone()]


def _plans() -> list[StepPlan]:
    return [
        StepPlan(slot_mapping=torch.empty(0), prefills=[PrefillRow(0, 5, 0, [], 1)]),
        StepPlan(slot_mapping=torch.empty(0), decode_positions=[5], decode_tables=[[]],
                 decode_state_slots=[1], prefills=[PrefillRow(1, 4, 0, [], 2)]),
        StepPlan(slot_mapping=torch.empty(0), decode_positions=[6, 3], decode_tables=[[], []],
                 decode_state_slots=[1, 2]),
        StepPlan(slot_mapping=torch.empty(0), decode_positions=[7, 4], decode_tables=[[], []],
                 decode_state_slots=[1, 2]),
    ]


def _gated_steps(states: GatedDeltaStates) -> list[torch.Tensor]:
    """_steps' plans with raw gate inputs (as the model layer passes them)."""
    gen = torch.Generator().manual_seed(11)
    channels = _spec().conv_channels
    weight = torch.randn(channels, CONV_K, generator=gen)
    a_log, dt_bias = torch.randn(VH, generator=gen), torch.randn(VH, generator=gen)
    outs = []
    for plan in _plans():
        rows = len(plan.decode_positions) + sum(r.end - r.start for r in plan.prefills)
        mixed = torch.randn(rows, channels, generator=gen)
        raw = gd.GateInputs(torch.randn(rows, VH, generator=gen),
                            torch.randn(rows, VH, generator=gen), a_log, dt_bias)
        outs.append(states.forward(0, mixed, raw, weight, states.plan(plan)))
    return outs + [states.layers[0].recurrent.clone()]


def test_a_pure_decode_step_with_raw_gates_runs_norms_and_gates_in_the_kernel(stand_in):
    plain, fused = _gated_steps(_states(False)), _gated_steps(_states(True))
    # step 2 mixes a decode row with a prefill: the gates are taken in torch and the
    # grouped kernel runs as before; steps 3 and 4 (decode alone) hand fla the raw inputs
    assert [c["in_kernel"] for c in stand_in.calls] == [(False, False, False),
                                                        (True, True, True), (True, True, True)]
    assert all(c["scale"] == DK ** -0.5 for c in stand_in.calls[1:])
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32


def test_the_backend_on_fla_decode_gives_the_torch_paths_outputs_and_states(stand_in):
    plain, fused = _steps(_states(False)), _steps(_states(True))
    # two decode rows in step 2, two in each of steps 3 and 4: one fla call per decode step
    assert len(stand_in.calls) == 3
    assert all(c["q"][2] == KH and c["v"][2] == VH for c in stand_in.calls)
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # fp32


def test_the_plain_path_never_calls_fla(stand_in):
    _steps(_states(False))
    assert stand_in.calls == []
    assert "torch decode" in _states(False).describe()
    assert "fla fused decode" in _states(True).describe()


def test_fla_decode_is_chosen_only_on_cuda_with_fla_installed(stand_in, monkeypatch):
    assert not gd.fla_decode_available(torch.device("cpu"))
    assert gd.fla_decode_available(torch.device("cuda"))
    monkeypatch.setattr(gd, "_fla_recurrent", None)
    assert not gd.fla_decode_available(torch.device("cuda"))


@pytest.mark.skipif(not gd.fla_decode_available(torch.device("cuda")),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_decode_matches_the_torch_step(dtype):
    q, k, v, g, beta, states = (x.cuda() for x in _decode_inputs(4, seed=5))
    want_states = states.clone()
    want = gd.delta_rule_decode(q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g,
                                beta, want_states)
    got = gd.fla_decode(q, k, v, g, beta, states, dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 inputs: 8 bits of mantissa
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(states, want_states, rtol=tol, atol=tol)


@pytest.mark.skipif(not gd.fla_decode_available(torch.device("cuda")),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_gated_decode_matches_the_torch_step(dtype):
    """fla's kernel with the L2 norms, q's scale and the gates inside it, against the torch
    forms of each (gd.l2norm, gd.gates) and the torch rule."""
    gen = torch.Generator().manual_seed(9)
    b = 4
    q, k = (torch.randn(b, KH, DK, generator=gen) * 3 for _ in range(2))
    v = torch.randn(b, VH, DV, generator=gen)
    raw = gd.GateInputs(*(torch.randn(*s, generator=gen) for s in ((b, VH), (b, VH), (VH,),
                                                                   (VH,))))
    states = torch.randn(b, VH, DK, DV, generator=gen)
    g, beta = gd.gates(raw)
    want_states = states.clone()
    want = gd.delta_rule_decode((gd.l2norm(q) * DK ** -0.5).repeat_interleave(3, 1),
                                gd.l2norm(k).repeat_interleave(3, 1), v, g, beta, want_states)
    cuda = gd.GateInputs(*(x.cuda() for x in raw))
    got, final = gd.fla_decode_gated(q.cuda().to(dtype), k.cuda().to(dtype),
                                     v.cuda().to(dtype), cuda, states.cuda())
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 inputs: 8 bits of mantissa
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(final.cpu(), want_states, rtol=tol, atol=tol)


def test_the_load_probe_proves_the_gated_kernel_or_turns_it_off(stand_in, monkeypatch):
    """At allocate (CUDA with fla) the gated decode is run once against the torch forms: a
    kernel that agrees stays on; one that computes something else is turned off, the
    reason logged, and the model's decode steps compute the gates in torch."""
    assert gd.probe_fla_gated(torch.device("cpu"), KH, VH, DK, DV, torch.float32) == (True, "")
    monkeypatch.setattr(gd, "fla_decode_available", lambda device: True)
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert states._fla_gated and "norms and gates in the kernel" in states.describe()

    def no_gates(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:  # raw a, b taken as g, beta
        kw.update(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
        return StandInRecurrent()(**kw)

    monkeypatch.setattr(gd, "_fla_recurrent", no_gates)
    monkeypatch.setattr(gd, "fla_gated_available", lambda: True)
    ok, why = gd.probe_fla_gated(torch.device("cpu"), KH, VH, DK, DV, torch.float32)
    assert not ok and "fla's gated decode is off by" in why
    states.allocate([_spec()], 4)
    assert states._fla_decode and not states._fla_gated
