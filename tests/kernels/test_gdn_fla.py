"""The Gated DeltaNet state backend on flash-linear-attention's fused recurrent decode,
against a stand-in for fla's kernel (written from fla's documented semantics: grouped key
heads, value head h reading key head h // (v_heads / k_heads), state [N, HV, K, V]): the
calls it gets carry q and k grouped, and the backend's output and states are the plain
torch path's. The plain path itself is what tests/kernels/test_gated_delta.py checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.fla import StandInChunked, StandInRecurrent

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.kernels import fla_gdn as fla
from helexa.kernels import fla_norm
from helexa.kernels import gated_delta as gd
from helexa.kernels.backends.base import PrefillRow, StepPlan
from helexa.kernels.backends.gdn import GatedDeltaStates

KH, VH, DK, DV, CONV_K = 2, 6, 8, 4, 4  # a group of 3 value heads per key head


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandInRecurrent:
    fake = StandInRecurrent()
    monkeypatch.setattr(fla, "_fla_recurrent", fake)
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
    got = fla.fla_decode(q, k, v, g, beta, states, torch.float32)
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
    states._fla_gated = fla_decode and fla.fla_gated_available()
    states._fla_verify = fla_decode
    return states


def _run_plans(states: GatedDeltaStates, plans: list[StepPlan], seed: int
               ) -> list[torch.Tensor]:
    """Each plan's outputs, from seeded inputs with (g, beta) gates."""
    gen = torch.Generator().manual_seed(seed)
    channels = _spec().conv_channels
    weight = torch.randn(channels, CONV_K, generator=gen)
    outs = []
    for plan in plans:
        rows = len(plan.decode_positions) + sum(r.end - r.start for r in plan.prefills)
        mixed = torch.randn(rows, channels, generator=gen)
        g = -torch.rand(rows, VH, generator=gen)
        beta = torch.rand(rows, VH, generator=gen)
        outs.append(states.forward(0, mixed, (g, beta), weight, states.plan(plan)))
    return outs


def _steps(states: GatedDeltaStates) -> list[torch.Tensor]:
    """A prefill of 5 tokens into slot 1, then a step decoding slot 1 beside a fresh
    prefill into slot 2, then two pure decode steps of both: each step's outputs."""
    return _run_plans(states, _plans(), 7) + [states.layers[0].recurrent.clone()]


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


def test_fla_chunked_prefill_takes_the_key_heads_grouped(stand_in, monkeypatch):
    """Prefill on fla's chunked kernel (fla-core 0.5 on) passes q and k as the checkpoint
    groups them, no repeat to the value heads; outputs and states are the torch path's."""
    chunked = StandInChunked()
    monkeypatch.setattr(fla, "_fla_chunk", chunked)
    plain = _steps(_states(False))
    states = _states(True)
    states._fla = True  # as allocate sets it on CUDA, fla installed, a 16-bit model
    fused = _steps(states)
    # step 1's prefill of 5 and step 2's of 3, one call each, q and k grouped
    assert [(c["q"], c["k"], c["v"]) for c in chunked.calls] == [
        ((1, 5, KH, DK), (1, 5, KH, DK), (1, 5, VH, DV)),
        ((1, 3, KH, DK), (1, 3, KH, DK), (1, 3, VH, DV))]
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 stand-in


def _mixed_plans() -> list[StepPlan]:
    """Prefills of 5 and 3 tokens into slots 1 and 2 (one step, side by side); then slot 1
    decoding beside fresh prefills into slots 0 and 3 with slot 2's verification row of 2
    between them (so the prefills' rows are not contiguous)."""
    empty = torch.empty(0)
    return [
        StepPlan(slot_mapping=empty, prefills=[PrefillRow(0, 5, 0, [], 1),
                                               PrefillRow(5, 8, 0, [], 2)]),
        StepPlan(slot_mapping=empty, decode_positions=[5], decode_tables=[[]],
                 decode_state_slots=[1],
                 prefills=[PrefillRow(1, 5, 0, [], 0), PrefillRow(5, 7, 3, [], 2, verify=True),
                           PrefillRow(7, 8, 0, [], 3)]),
    ]


def _mixed_steps(states: GatedDeltaStates) -> list[torch.Tensor]:
    outs = _run_plans(states, _mixed_plans(), 17)
    layer = states.layers[0]
    return outs + [layer.conv.clone(), layer.recurrent.clone()]


@pytest.mark.parametrize("takes", ["chunk_indices", "cu_seqlens_cpu", "neither"])
def test_a_steps_prefills_run_in_one_fla_chunked_launch(stand_in, monkeypatch, takes):
    """Several prefills in one step are one call of fla's chunked kernel (their rows back to
    back, cu_seqlens their offsets, one state each; beside them the chunks' (sequence,
    chunk) pairs where fla takes them, else the offsets on the host where it takes those),
    also when a verification row lies between them; outputs, conv windows and states are
    the torch path's, a prefill at a time."""
    chunked = StandInChunked()
    monkeypatch.setattr(fla, "_fla_chunk", chunked)
    monkeypatch.setattr(fla, "_TAKES_CHUNK_INDICES", takes == "chunk_indices")
    monkeypatch.setattr(fla, "_TAKES_CU_CPU", takes != "neither")
    plain = _mixed_steps(_states(False))
    states = _states(True)
    states._fla = states._fla_varlen = True  # as allocate sets them on CUDA with fla
    fused = _mixed_steps(states)
    assert [(c["q"], c["cu"]) for c in chunked.calls] == [((1, 8, KH, DK), [0, 5, 8]),
                                                          ((1, 5, KH, DK), [0, 4, 5])]
    assert [c["cu_cpu"] for c in chunked.calls] == (
        [("cpu", [0, 5, 8]), ("cpu", [0, 4, 5])] if takes == "cu_seqlens_cpu" else [None] * 2)
    assert [c["chunks"] for c in chunked.calls] == (  # every prefill here is one chunk
        [[[0, 0], [1, 0]], [[0, 0], [1, 0]]] if takes == "chunk_indices" else [None] * 2)
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 stand-in


@pytest.mark.parametrize("prefills", [2, 3])
def test_a_steps_fla_offsets_start_at_16_byte_boundaries(prefills):
    """The step's prefill slots, cu_seqlens and chunk indices reach the device in one copy;
    each part starts 16-byte aligned, as the load probe's fresh tensors did: Triton builds
    a pointer's alignment into its kernel, so an offset 8 bytes in (slots of an odd count
    before it) would build fla's chunked kernels again at the first such serving step."""
    states = _states(True)
    states._fla = states._fla_varlen = True
    rows = [PrefillRow(70 * i, 70 * (i + 1), 0, [], i) for i in range(prefills)]
    meta = states.build(StepPlan(slot_mapping=torch.empty(0), prefills=rows))
    assert meta.prefill_slots.tolist() == list(range(prefills))
    assert meta.prefill_cu.tolist() == [70 * i for i in range(prefills + 1)]
    assert meta.prefill_chunks.tolist() == [[i, c] for i in range(prefills) for c in (0, 1)]
    assert [t.data_ptr() % 16 for t in (meta.prefill_slots, meta.prefill_cu,
                                         meta.prefill_chunks)] == [0, 0, 0]


def test_the_varlen_layout_names_every_chunk_of_every_sequence():
    # fla's chunk indices: each 64-token chunk's (sequence, chunk within it), in order
    cu, chunks = fla.varlen_layout([5, 130, 64, 1])
    assert cu == [0, 5, 135, 199, 200]
    assert chunks == [0, 0, 1, 0, 1, 1, 1, 2, 2, 0, 3, 0]


def test_a_varlen_kernel_that_disagrees_leaves_prefills_one_launch_each(stand_in, monkeypatch):
    """At allocate the several-sequence form of fla's chunked kernel is proved on its own:
    one that runs the sequences as one (ignoring cu_seqlens, so state leaks from one
    request into the next) is left off, the reason logged, and each prefill is one call."""
    from helexa.kernels.backends import gdn

    def one_sequence(q, k, v, g, beta, **kw):
        kw.pop("cu_seqlens", None)
        kw.pop("cu_seqlens_cpu", None)
        state = kw.pop("initial_state")
        o, s = StandInChunked()(q, k, v, g, beta, initial_state=state[:1], **kw)
        return o, s.expand(state.shape[0], *s.shape[1:])

    plain = _mixed_steps(_states(False))
    monkeypatch.setattr(fla, "fla_available", lambda device, dtype: True)
    monkeypatch.setattr(fla, "_fla_chunk", one_sequence)
    warned: list[str] = []
    monkeypatch.setattr(gdn.log, "warning", lambda event, **kw: warned.append(kw["reason"]))
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert states._fla and not states._fla_varlen
    assert any("fla's chunked prefill kernel over several sequences is off by" in w
               for w in warned), warned
    chunked = StandInChunked()
    monkeypatch.setattr(fla, "_fla_chunk", chunked)
    fused = _mixed_steps(states)
    assert [c["cu"] for c in chunked.calls] == [None] * 4  # each prefill its own call
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _verify_plans() -> list[StepPlan]:
    """Prefills of 5 and 3 tokens into slots 1 and 2; then verification rows of 4 and 2
    tokens (padded together); then decode rows after 2 of 4 and 2 of 2 stood; then slot 2
    decoding beside a verification row of 3 for slot 1."""
    empty = torch.empty(0)
    return [
        StepPlan(slot_mapping=empty, prefills=[PrefillRow(0, 5, 0, [], 1),
                                               PrefillRow(5, 8, 0, [], 2)]),
        StepPlan(slot_mapping=empty, prefills=[PrefillRow(0, 4, 5, [], 1, verify=True),
                                               PrefillRow(4, 6, 3, [], 2, verify=True)]),
        StepPlan(slot_mapping=empty, decode_positions=[7, 5], decode_tables=[[], []],
                 decode_state_slots=[1, 2]),
        StepPlan(slot_mapping=empty, decode_positions=[6], decode_tables=[[]],
                 decode_state_slots=[2], prefills=[PrefillRow(1, 4, 8, [], 1, verify=True)]),
    ]


def _verify_steps(states: GatedDeltaStates) -> list[torch.Tensor]:
    """_verify_plans' outputs, then slot 1 settled after 1 of its last row's 3 tokens, and
    both slots' conv windows and states."""
    outs = _run_plans(states, _verify_plans(), 13)
    states.settle({1: 9})
    layer = states.layers[0]
    return outs + [layer.conv.clone(), layer.recurrent.clone()]


def test_verification_rows_and_their_settling_run_in_one_fla_launch_each(stand_in):
    """Speculative verification on fla: each step's verification rows, padded together,
    are one call of the kernel (grouped heads, no final state: the rows are held), and
    settling them is one more (the final state after the positions that stood); outputs,
    windows and states are the torch path's, token by token."""
    plain, fused = _verify_steps(_states(False)), _verify_steps(_states(True))
    calls = [(c["q"], c["final"]) for c in stand_in.calls]
    assert calls == [((2, 4, KH, DK), False),  # step 2: both verification rows
                     ((2, 4, KH, DK), True),  # step 3: both settled (2 and 2 stood) ...
                     ((2, 1, KH, DK), True),  # ... then its two decode rows
                     ((1, 1, KH, DK), True),  # step 4: slot 2's decode row
                     ((1, 3, KH, DK), False),  # ... and slot 1's verification row
                     ((1, 3, KH, DK), True)]  # the explicit settle (1 of 3 stood)
    assert all(c["v"][2] == VH for c in stand_in.calls)
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32


@pytest.mark.parametrize("fla_verify", [False, True])
def test_a_snapshot_inside_a_held_row_is_the_state_its_settling_reaches(stand_in, fla_verify):
    """A prefix snapshot at a block boundary inside a verification row (save_held, once
    the engine judged its drafts) is the state the row's slot reaches when that many of its
    positions stand, exactly; the slot and the row it holds stay as they were."""
    states = _states(fla_verify)
    plans = _verify_plans()[:2]  # slots 1 and 2: prefills, then rows of 4 and 2 held
    gen = torch.Generator().manual_seed(13)
    weight = torch.randn(_spec().conv_channels, CONV_K, generator=gen)
    layer = states.layers[0]
    before = None
    for plan in plans:
        rows = sum(r.end - r.start for r in plan.prefills)
        meta = states.plan(plan)
        before = (layer.conv.clone(), layer.recurrent.clone())
        states.forward(0, torch.randn(rows, _spec().conv_channels, generator=gen),
                       (-torch.rand(rows, VH, generator=gen), torch.rand(rows, VH, generator=gen)),
                       weight, meta)
        states.end_step(meta)
    states.save_held([(1, 3, 2), (2, 0, 1)])  # into the free slots 3 and 0
    assert before is not None
    for x, was in zip((layer.conv, layer.recurrent), before, strict=True):
        assert torch.equal(x[1:3], was[1:3])  # the held slots: as before the rows
    states.settle({1: 5 + 2, 2: 3 + 1})
    for x in (layer.conv, layer.recurrent):
        assert torch.equal(x[3], x[1]) and torch.equal(x[0], x[2])
    assert len(stand_in.calls) == (3 if fla_verify else 0)  # the rows, saves, settling


def test_rejected_positions_leave_the_fla_advance_where_it_stood(stand_in):
    """fla_advance's masked positions (g = beta = 0) change nothing: the state after kept
    tokens of a longer row is that of a row of only those tokens."""
    gen = torch.Generator().manual_seed(3)
    k = gd.l2norm(torch.randn(2, 5, KH, DK, generator=gen))
    v = torch.randn(2, 5, VH, DV, generator=gen)
    g, beta = -torch.rand(2, 5, VH, generator=gen), torch.rand(2, 5, VH, generator=gen)
    states = torch.randn(2, VH, DK, DV, generator=gen)
    before = states.clone()
    got = fla.fla_advance(k, v, g, beta, states, torch.tensor([2, 5]), torch.float32)
    for row, kept in ((0, 2), (1, 5)):
        want = states[row : row + 1].clone()
        at = slice(row, row + 1)
        for t in range(kept):  # the torch rule, a token at a time, each key head repeated
            gd.delta_rule_decode(k[at, t].repeat_interleave(3, 1),
                                 k[at, t].repeat_interleave(3, 1), v[at, t], g[at, t],
                                 beta[at, t], want)
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(states, before)  # read, not written


def test_a_verification_kernel_that_disagrees_is_turned_off_at_load(stand_in, monkeypatch):
    """At allocate (CUDA with fla) fla's verification and settling run once against the
    torch forms: a kernel that agrees serves verification rows; one that computes something
    else (here: a row's tokens each read the state before the row) is turned off with its
    reason, and verification rows run the torch forms, the tokens the same."""
    monkeypatch.setattr(fla, "fla_decode_available", lambda device: True)
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert states._fla_verify and "verification rows fla, one launch" in states.describe()

    def stale(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if kw["q"].shape[1] == 1:
            return StandInRecurrent()(**kw)
        outs = [StandInRecurrent()(**{**kw, **{n: kw[n][:, t : t + 1] for n in
                                               ("q", "k", "v", "g", "beta")}})
                for t in range(kw["q"].shape[1])]
        return torch.cat([o for o, _ in outs], 1), outs[-1][1]

    monkeypatch.setattr(fla, "_fla_recurrent", stale)
    assert "fla's verification kernel is off by" in fla.probe_fla_steps(
        torch.device("cpu"), KH, VH, DK, DV, torch.float32)
    states.allocate([_spec()], 4)
    assert states._fla_decode and not states._fla_verify
    assert "verification rows torch, token by token" in states.describe()
    plain = _verify_steps(_states(False))
    for got, want in zip(_verify_steps(states), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_one_pass_conv_gives_the_token_by_token_outputs():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 40, generator=gen)
    weight = torch.randn(40, CONV_K, generator=gen)
    windows = torch.randn(3, 40, CONV_K - 1, generator=gen)
    want = gd.conv1d_steps(x, weight, windows.clone())
    torch.testing.assert_close(gd.conv1d_steps_unfolded(x, weight, windows), want,
                               rtol=1e-6, atol=1e-6)


def test_the_plain_path_never_calls_fla(stand_in):
    _steps(_states(False))
    assert stand_in.calls == []
    assert "torch decode" in _states(False).describe()
    assert "fla fused decode" in _states(True).describe()


def test_fla_decode_is_chosen_only_on_cuda_with_fla_installed(stand_in, monkeypatch):
    assert not fla.fla_decode_available(torch.device("cpu"))
    assert fla.fla_decode_available(torch.device("cuda"))
    monkeypatch.setattr(fla, "_fla_recurrent", None)
    assert not fla.fla_decode_available(torch.device("cuda"))


@pytest.mark.skipif(not fla.fla_decode_available(torch.device("cuda")),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_decode_matches_the_torch_step(dtype):
    q, k, v, g, beta, states = (x.cuda() for x in _decode_inputs(4, seed=5))
    want_states = states.clone()
    want = gd.delta_rule_decode(q.repeat_interleave(3, 1), k.repeat_interleave(3, 1), v, g,
                                beta, want_states)
    got = fla.fla_decode(q, k, v, g, beta, states, dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 inputs: 8 bits of mantissa
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(states, want_states, rtol=tol, atol=tol)


@pytest.mark.skipif(not fla.fla_available(torch.device("cuda"), torch.bfloat16),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
@pytest.mark.parametrize("heads", [(KH, VH, DK, DV), (16, 32, 128, 128)])  # ours, Qwen3.5's
def test_fla_kernel_runs_a_steps_prefills_in_one_launch(heads):
    """fla's chunked kernel over several sequences back to back (cu_seqlens), each from its
    own state, against delta_rule_chunked a sequence at a time: the load probe's check,
    which must pass on a GPU for a step's prefills to share one launch."""
    assert fla.probe_fla_varlen(torch.device("cuda"), *heads, torch.bfloat16) == ""


@pytest.mark.skipif(not fla.fla_decode_available(torch.device("cuda")),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(KH, VH, DK, DV), (16, 32, 128, 128)])  # ours, Qwen3.5's
def test_fla_kernel_verification_and_settling_match_the_torch_steps(dtype, heads):
    """fla's kernel over rows of several tokens (fla_steps) and its masked advance
    (fla_advance) against delta_rule_steps / delta_rule_advance: the load probe's check,
    which must pass on a GPU that serves speculation on fla."""
    assert fla.probe_fla_steps(torch.device("cuda"), *heads, dtype) == ""


@pytest.mark.skipif(not fla.fla_decode_available(torch.device("cuda")),
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
    got, final = fla.fla_decode_gated(q.cuda().to(dtype), k.cuda().to(dtype),
                                     v.cuda().to(dtype), cuda, states.cuda())
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 inputs: 8 bits of mantissa
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(final.cpu(), want_states, rtol=tol, atol=tol)


def test_the_load_probe_proves_the_gated_kernel_or_turns_it_off(stand_in, monkeypatch):
    """At allocate (CUDA with fla) the gated decode is run once against the torch forms: a
    kernel that agrees stays on; one that computes something else is turned off, the
    reason logged, and the model's decode steps compute the gates in torch."""
    assert fla.probe_fla_gated(torch.device("cpu"), KH, VH, DK, DV, torch.float32) == ""
    monkeypatch.setattr(fla, "fla_decode_available", lambda device: True)
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert states._fla_gated and "norms and gates in the kernel" in states.describe()

    def no_gates(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:  # raw a, b taken as g, beta
        kw.update(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False)
        return StandInRecurrent()(**kw)

    monkeypatch.setattr(fla, "_fla_recurrent", no_gates)
    monkeypatch.setattr(fla, "fla_gated_available", lambda: True)
    why = fla.probe_fla_gated(torch.device("cpu"), KH, VH, DK, DV, torch.float32)
    assert "fla's gated decode is off by" in why  # not "": the gates run in torch
    states.allocate([_spec()], 4)
    assert states._fla_decode and not states._fla_gated


def test_the_prefill_and_decode_kernels_are_proved_at_load_or_left_off(stand_in, monkeypatch):
    """At allocate (CUDA with fla) the chunked prefill and the decode kernel each run once
    against the torch forms. An fla whose chunked kernel takes no grouped heads (as before
    0.5) or whose decode disagrees is left off, the reason logged, and the torch forms
    serve the same outputs and states: a failing kernel never fails a request's step."""
    monkeypatch.setattr(fla, "fla_decode_available", lambda device: True)
    monkeypatch.setattr(fla, "fla_available", lambda device, dtype: True)
    monkeypatch.setattr(fla, "_fla_chunk", StandInChunked())
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert states._fla and states._fla_decode

    def one_head_count(q, k, v, *args, **kw):  # fla 0.4's chunked kernel: H == HV only
        if q.shape[2] != v.shape[2]:
            raise AssertionError("q, k and v must have the same number of heads")
        return StandInChunked()(q, k, v, *args, **kw)

    def no_decay(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:  # a kernel ignoring g
        return StandInRecurrent()(**{**kw, "g": torch.zeros_like(kw["g"])})

    monkeypatch.setattr(fla, "_fla_chunk", one_head_count)
    monkeypatch.setattr(fla, "_fla_recurrent", no_decay)
    from helexa.kernels.backends import gdn
    warned = []
    monkeypatch.setattr(gdn.log, "warning", lambda event, **kw: warned.append(kw["reason"]))
    states.allocate([_spec()], 4)
    assert not states._fla and not states._fla_decode and not states._fla_verify
    assert any("fla's chunked prefill kernel failed (AssertionError: q, k and v must have"
               in w for w in warned), warned
    assert any("fla's decode kernel is off by" in w for w in warned), warned
    plain = _steps(_states(False))
    for got, want in zip(_steps(states), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_gated_norm_is_proved_at_load_even_where_no_fla_decode_runs(monkeypatch):
    """fla's gated RMSNorm runs wherever it imported (every hybrid layer, every step), so
    allocate proves it whatever the decode kernels' probes said: with fla's recurrent
    kernel absent, a norm that raises is switched off, its reason logged, and the layer's
    norm is the torch form."""
    from helexa.kernels.backends import gdn

    def broken(*args: Any, **kw: Any) -> torch.Tensor:
        raise RuntimeError("triton: out of resources")

    monkeypatch.setattr(fla, "_fla_recurrent", None)  # no fla decode, no gated probe
    monkeypatch.setattr(fla_norm, "_fla_norm_gated", broken)
    monkeypatch.setattr(fla_norm, "fla_norm_available",
                        lambda device: fla_norm._fla_norm_gated is not None)
    warned: list[str] = []
    monkeypatch.setattr(gdn.log, "warning", lambda event, **kw: warned.append(kw["reason"]))
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    assert not states._fla_decode and fla_norm._fla_norm_gated is None
    assert warned == ["fla's gated norm failed (RuntimeError: triton: out of resources)"]
    # a norm that agrees stays on
    monkeypatch.setattr(fla_norm, "_fla_norm_gated", lambda o, z, w, b, activation, eps:
                        (fla_norm._gated_rms_norm_torch(o, z, w, eps, torch.float32)))
    warned.clear()
    states.allocate([_spec()], 4)
    assert fla_norm._fla_norm_gated is not None and warned == []


def test_a_long_prefills_norm_runs_in_parts_of_the_bucket_the_probe_tuned(monkeypatch):
    """fla's gated norm tunes itself afresh (9 builds timed on the card) for each 65,536
    rows of its input, a token's value heads its rows: a long prefill's norm runs in parts
    of at most that many, each the bucket the load's probe tuned; the same output."""
    calls: list[int] = []

    def norm(o, z, w, b, activation, eps):
        calls.append(o.shape[0] * o.shape[1])  # the rows fla's kernel sees
        return fla_norm._gated_rms_norm_torch(o, z, w, eps, torch.float32)

    monkeypatch.setattr(fla_norm, "_fla_norm_gated", norm)
    monkeypatch.setattr(fla_norm, "fla_norm_available", lambda device: True)
    monkeypatch.setattr(fla_norm, "FLA_NORM_ROWS", 60)  # 10 tokens of 6 value heads
    gen = torch.Generator().manual_seed(0)
    o = torch.randn(25, VH, DV, generator=gen)
    z = torch.randn(25, VH * DV, generator=gen)
    w = torch.randn(DV, generator=gen)
    got = fla_norm.gated_rms_norm(o, z, w, 1e-6, torch.float32)
    assert calls == [60, 60, 30]
    torch.testing.assert_close(got, fla_norm._gated_rms_norm_torch(o, z, w, 1e-6, torch.float32))
    calls.clear()
    fla_norm.gated_rms_norm(o[:10], z[:10], w, 1e-6, torch.float32)  # one part: one call
    assert calls == [60]
