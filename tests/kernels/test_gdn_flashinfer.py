"""The Gated DeltaNet state backend on FlashInfer's pool decode, against a stand-in for its
kernel written from FlashInfer 0.6.13's documented semantics and the checks its launcher
makes (gdn_decode.gated_delta_rule_decode_pretranspose: q, k [B, 1, H, K] and v [B, 1, HV, V]
16-bit, A_log fp32, a bf16 pool [slots, HV, V, K] with K contiguous, int32 slot indices,
each row's state read from and written back to its slot). No GPU runs here: the kernel
itself is what bench/gpu_check.sh's hybrid decode runs, and the load probe proves it on the
device against the torch forms before any request does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.fi_gdn import StandInGdnDecode

from helexa.checkpoint.layer_memory import LinearAttentionSpec
from helexa.kernels import flashinfer_gdn as fig
from helexa.kernels import gated_delta as gd
from helexa.kernels.backends.base import PrefillRow, StepPlan
from helexa.kernels.backends.gdn import GatedDeltaStates

KH, VH, D, CONV_K = 2, 4, 128, 4  # FlashInfer's bf16-state kernels take heads of 128 x 128
BF16 = torch.bfloat16
UNAVAILABLE = fig.fi_pool_unavailable  # the real checks, before a test stands them in


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandInGdnDecode:
    """The stand-in as FlashInfer's module, and the device checks passed (CPU here)."""
    fake = StandInGdnDecode()
    monkeypatch.setattr(fig, "_fi_gdn", fake)
    monkeypatch.setattr(fig, "fi_pool_unavailable", lambda *a: "")
    return fake


def _spec() -> LinearAttentionSpec:
    return LinearAttentionSpec(key_heads=KH, value_heads=VH, key_dim=D, value_dim=D,
                               conv_channels=2 * KH * D + VH * D, conv_kernel=CONV_K,
                               dtype="bf16")


def _plans() -> list[StepPlan]:
    """A prefill of 5 tokens into slot 1; slot 1 decoding beside a fresh prefill into slot 2;
    then two pure decode steps of both, in two orders."""
    e = torch.empty(0)
    return [
        StepPlan(slot_mapping=e, prefills=[PrefillRow(0, 5, 0, [], 1)]),
        StepPlan(slot_mapping=e, decode_positions=[5], decode_tables=[[]],
                 decode_state_slots=[1], prefills=[PrefillRow(1, 4, 0, [], 2)]),
        StepPlan(slot_mapping=e, decode_positions=[6, 3], decode_tables=[[], []],
                 decode_state_slots=[1, 2]),
        StepPlan(slot_mapping=e, decode_positions=[4, 7], decode_tables=[[], []],
                 decode_state_slots=[2, 1]),
    ]


def _run(states: GatedDeltaStates) -> list[torch.Tensor]:
    """Each step's outputs (fp32) with raw gates, as the model layer passes them, then every
    slot's state as the torch forms read it."""
    gen = torch.Generator().manual_seed(3)
    channels = _spec().conv_channels
    weight = (torch.randn(channels, CONV_K, generator=gen) * 0.5).to(BF16)
    a_log = torch.randn(VH, generator=gen).to(BF16)
    dt_bias = torch.randn(VH, generator=gen).to(BF16)
    outs = []
    for plan in _plans():
        rows = len(plan.decode_positions) + sum(r.end - r.start for r in plan.prefills)
        mixed = torch.randn(rows, channels, generator=gen).to(BF16)
        raw = gd.GateInputs(torch.randn(rows, VH, generator=gen).to(BF16),
                            torch.randn(rows, VH, generator=gen).to(BF16), a_log, dt_bias)
        outs.append(states.forward(0, mixed, raw, weight, states.plan(plan)).float())
    return outs + [states.layers[0].recurrent.float()]


def _states() -> GatedDeltaStates:
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([_spec()], 4)
    return states


def test_pure_decode_steps_run_flashinfers_kernel_on_the_slots_in_place(stand_in, monkeypatch):
    fused = _states()
    assert fused._fi_pool and "FlashInfer pool decode" in fused.describe()
    pool = fused.layers[0].pool
    assert pool is not None and pool.shape == (5, VH, D, D) and pool.is_contiguous()  # + scratch
    assert fused.layers[0].recurrent.data_ptr() == pool.data_ptr()  # one storage, two views
    stand_in.calls.clear()  # the load probe's call
    got = _run(fused)
    # the two pure decode steps reach the kernel; the prefill and the mixed step do not
    assert stand_in.calls == [{"rows": 2, "scale": D ** -0.5, "l2norm": True}] * 2
    monkeypatch.setattr(fig, "fi_pool_unavailable", UNAVAILABLE)
    plain_states = GatedDeltaStates(torch.device("cpu"))
    plain_states.allocate([_spec()], 4)  # not on CUDA: the torch forms, K-major states
    assert not plain_states._fi_pool and plain_states.layers[0].pool is None
    want = _run(plain_states)
    for g, w in zip(got, want, strict=True):  # bf16 states and inputs: rounding apart
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_gates_at_an_unaligned_offset_of_the_projection_reach_the_kernel_aligned(stand_in):
    """At batch 1, a and b are contiguous views into the layer's projection output; with 2
    value heads a starts 4 bytes past b (at 24 heads, 48), off the 32-byte alignment the
    kernel declares. Such a view is copied; an aligned one is passed as it is."""
    proj = torch.randn(1, 3 * D + 2 * VH + 2, dtype=BF16)  # [q | k | v ... | b | a] of one row
    b, a = proj[:, 3 * D:3 * D + VH], proj[:, 3 * D + VH:3 * D + 2 * VH]
    assert a.is_contiguous() and a.data_ptr() % 32 != 0
    q = torch.randn(1, KH, D, dtype=BF16)
    raw = gd.GateInputs(a, b, torch.randn(VH, dtype=BF16), torch.randn(VH, dtype=BF16))
    pool = torch.zeros(2, VH, D, D, dtype=BF16)
    o = fig.fi_decode_pool(q, q.clone(), torch.randn(1, VH, D, dtype=BF16), raw,
                          raw.A_log.float(), pool, torch.tensor([1], dtype=torch.int32))
    assert o.shape == (1, VH, D) and stand_in.calls == [{"rows": 1, "scale": D ** -0.5,
                                                          "l2norm": True}]
    aligned = torch.empty(64, dtype=BF16)[:16].view(1, 16)
    assert fig._aligned(aligned) is aligned and fig._aligned(a) is not a
    # a row of one at an aligned offset of a wider projection: the same bytes, no copy, with
    # a fresh tensor's strides (its batch stride is the projection's width)
    row = torch.randn(1, 3 * D, dtype=BF16).as_strided((1, KH, D), (3 * D, D, 1))[:, None]
    assert row.is_contiguous() and row.stride(0) == 3 * D
    got = fig._aligned(row)
    assert got.data_ptr() == row.data_ptr() and got.stride() == (KH * D, KH * D, D, 1)
    assert torch.equal(got, row)


def test_the_load_probe_proves_the_kernel_or_leaves_it_off(stand_in, monkeypatch):
    """A kernel that writes a slot it was not given is caught at load: the states stay
    K-major, the decode runs the other kernels, and the reason is said."""
    assert fig.probe_fi_pool(torch.device("cpu"), KH, VH, D, D, BF16) == ""
    broken = StandInGdnDecode(wrong_slot=True)
    monkeypatch.setattr(fig, "_fi_gdn", broken)
    why = fig.probe_fi_pool(torch.device("cpu"), KH, VH, D, D, BF16)
    assert why == "FlashInfer's pool decode wrote a slot it was not given"
    states = _states()
    assert not states._fi_pool and states.layers[0].pool is None
    assert "FlashInfer" not in states.describe()
    _run(states)
    assert len(broken.calls) == 2  # the two probes' calls, none since


def test_a_kernel_that_raises_at_the_probe_is_left_off(stand_in, monkeypatch):
    def fails(**kw: Any) -> Any:
        raise AssertionError("K and V must be 128")

    monkeypatch.setattr(stand_in, "gated_delta_rule_decode_pretranspose", fails)
    why = fig.probe_fi_pool(torch.device("cpu"), KH, VH, D, D, BF16)
    assert why == "FlashInfer's pool decode failed (AssertionError: K and V must be 128)"
    assert not _states()._fi_pool


@pytest.mark.parametrize(("device", "dtype", "dims", "why"), [
    ("cpu", BF16, (128, 128), "not a CUDA device"),
    ("cuda", torch.float16, (128, 128), "its kernels keep bf16 states, the model's are float16"),
    ("cuda", BF16, (64, 128), "its kernels take heads of 128 x 128, these are 64 x 128"),
])
def test_what_the_pool_kernel_cannot_serve_is_named(monkeypatch, device, dtype, dims, why):
    monkeypatch.setattr(fig, "_fi_gdn", StandInGdnDecode())
    assert fig.fi_pool_unavailable(torch.device(device), dtype, *dims) == why


def test_without_flashinfer_or_its_cute_kernels_the_pool_decode_is_off(monkeypatch):
    monkeypatch.setattr(fig, "_fi_gdn", None)
    monkeypatch.setattr(fig, "_fi_gdn_tried", False)  # the import is tried (none here)
    assert fig.fi_pool_unavailable(torch.device("cuda"), BF16, 128, 128) == \
        "FlashInfer is not installed"
    monkeypatch.setattr(fig, "_fi_gdn", StandInGdnDecode())
    monkeypatch.setenv(fig.FI_GDN_ENV, "0")  # the switch the GPU check's side-by-side run sets
    assert fig.fi_pool_unavailable(torch.device("cuda"), BF16, 128, 128) == \
        "HELEXA_FLASHINFER_GDN=0"
    monkeypatch.delenv(fig.FI_GDN_ENV)

    class NoCute:
        _GDN_DECODE_BF16_STATE_AVAILABLE = False

    monkeypatch.setattr(fig, "_fi_gdn", NoCute())
    assert "did not import" in fig.fi_pool_unavailable(torch.device("cuda"), BF16, 128, 128)


@pytest.mark.skipif(fig.fi_pool_unavailable(torch.device("cuda"), BF16, D, D) != "",
                    reason="needs FlashInfer's GDN kernels on a Hopper-class GPU")
def test_flashinfers_pool_kernel_matches_the_torch_step():
    assert fig.probe_fi_pool(torch.device("cuda"), KH, VH, D, D, BF16) == ""


def test_the_kernel_is_built_for_every_decode_batch_when_the_pool_is_allocated(stand_in):
    """FlashInfer compiles its kernel per batch size and pool shape on first use: allocate
    runs it once for each size a step of 1..decode_rows rows runs at (1, 2, 4, then
    multiples of 8) over the real pool, so no decode step waits for a compile mid-serving,
    and 64 slots build 11 kernels, not 64."""
    assert [fig.fi_rows(n) for n in range(1, 18)] == [1, 2, 4, 4, *[8] * 4, *[16] * 8, 24]
    states = GatedDeltaStates(torch.device("cpu"))
    stand_in.calls.clear()
    states.allocate([_spec()], 4, decode_rows=3)
    built = [c["rows"] for c in stand_in.calls]
    assert built[-3:] == [1, 2, 4]  # after the probe's own call on its small pool
    stand_in.calls.clear()
    states.allocate([_spec()], 2, decode_rows=8)  # never more rows than slots
    assert [c["rows"] for c in stand_in.calls][-2:] == [1, 2]
    stand_in.calls.clear()
    states.allocate([_spec()], 64, decode_rows=64)
    assert [c["rows"] for c in stand_in.calls][1:] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert not states.layers[0].pool.any()  # zeroed after: no request holds a slot yet


def test_a_decode_step_pads_to_a_built_size_on_the_scratch_slot(stand_in, monkeypatch):
    """A step of 5 decode rows runs the kernel at 8: the 3 padding rows are zeros on the
    pool's scratch slot (its last, which no request holds). Outputs and every real slot's
    state are the torch path's, an idle slot is untouched, and the scratch stays finite."""
    e = torch.empty(0)
    slots = [5, 0, 1, 3, 4]
    plans = [StepPlan(slot_mapping=e, prefills=[PrefillRow(3 * i, 3 * i + 3, 0, [], s)
                                                for i, s in enumerate(slots)]),
             StepPlan(slot_mapping=e, decode_positions=[3] * 5, decode_tables=[[]] * 5,
                      decode_state_slots=slots)]

    def run(states: GatedDeltaStates) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(8)
        channels = _spec().conv_channels
        weight = (torch.randn(channels, CONV_K, generator=gen) * 0.5).to(BF16)
        a_log, dt_bias = (torch.randn(VH, generator=gen).to(BF16) for _ in range(2))
        outs = []
        for plan in plans:
            rows = len(plan.decode_positions) + sum(r.end - r.start for r in plan.prefills)
            raw = gd.GateInputs(torch.randn(rows, VH, generator=gen).to(BF16),
                                torch.randn(rows, VH, generator=gen).to(BF16), a_log, dt_bias)
            mixed = torch.randn(rows, channels, generator=gen).to(BF16)
            outs.append(states.forward(0, mixed, raw, weight, states.plan(plan)).float())
        return outs + [states.layers[0].recurrent.float()]

    fused = GatedDeltaStates(torch.device("cpu"))
    fused.allocate([_spec()], 6)
    stand_in.calls.clear()
    got = run(fused)
    assert [c["rows"] for c in stand_in.calls] == [8]
    pool = fused.layers[0].pool
    assert pool is not None and pool.shape[0] == 7 and fused.layers[0].scratch == 6
    assert not pool[2].any() and torch.isfinite(pool[6].float()).all()
    monkeypatch.setattr(fig, "fi_pool_unavailable", UNAVAILABLE)
    plain = GatedDeltaStates(torch.device("cpu"))
    plain.allocate([_spec()], 6)
    for g, w in zip(got, run(plain), strict=True):  # bf16 states and inputs: rounding apart
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
