"""A Gated DeltaNet layer's state after a speculative verification row and its rollback is
the state that running only the accepted tokens leaves, in fp32 and in bf16; held rows of
requests that end, or skip a step, neither leak into other requests nor grow."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels.backends.base import PrefillRow, StepPlan
from helexa.kernels.backends.gdn import GatedDeltaStates
from helexa.neuron.formats.loader import load_model
from helexa.neuron.models.gated_deltanet import GatedDeltaNet


@dataclass
class Seq:  # the fields of SeqInput that the state backend's plan reads
    token_ids: list[int]
    num_computed: int
    state_slot: int
    need_logits: bool = True
    num_logits: int = 1


def step_plan(seqs: list[Seq]) -> StepPlan:
    """The StepPlan the model runner lays seqs out as (one-token rows first), as far as the
    state backend reads it."""
    step = StepPlan(slot_mapping=torch.empty(0, dtype=torch.long))
    for s in seqs:
        if len(s.token_ids) == 1:
            step.decode_positions.append(s.num_computed)
            step.decode_tables.append([])
            step.decode_state_slots.append(s.state_slot)
    at = step.num_decode
    for s in seqs:
        if (n := len(s.token_ids)) > 1:
            step.prefills.append(PrefillRow(at, at + n, s.num_computed, [], s.state_slot,
                                            verify=s.need_logits and s.num_logits > 1))
            at += n
    return step


@dataclass
class Alone:
    """One linear-attention layer with a state backend of its own."""

    layer: GatedDeltaNet
    states: GatedDeltaStates


def row_by_row(linear):
    """The projection one row at a time: what it gives a row is then the same whatever the
    row count (a matmul of 1 row and of 5 may round differently, in fp32 by ~1e-7), so
    what is compared below is exactly what the state and its rollback do."""
    def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([F.linear(x[i:i + 1], linear.weight, bias) for i in range(len(x))])
    return run


def layer_of(model_dir, slots: int = 4) -> Alone:
    layer = load_model(model_dir).linear_layers[0]
    layer.in_proj.kernel = row_by_row(layer.in_proj)
    layer.out_proj.kernel = row_by_row(layer.out_proj)
    states = GatedDeltaStates(torch.device("cpu"))
    states.allocate([layer.state_spec], slots)
    return Alone(layer, states)


def step(alone: Alone, seqs: list[Seq], x: torch.Tensor) -> torch.Tensor:
    """One step of the layer alone; x [rows, hidden] laid out as the model runner does."""
    meta = alone.states.plan(step_plan(seqs))
    with torch.inference_mode():
        return alone.layer(x, meta)


def slot_state(alone: Alone, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = alone.states.layers[0]
    return state.conv[slot].clone(), state.recurrent[slot].clone()


def prefilled(model_dir, prompts: dict[int, torch.Tensor]) -> Alone:
    """A layer whose slots hold these prompts' states (slot -> hidden rows), from nothing."""
    layer = layer_of(model_dir)
    for slot, x in prompts.items():
        step(layer, [Seq([0] * len(x), 0, slot)], x)
    return layer


def hidden(n: int, dtype: str, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)).to(
        getattr(torch, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_state_after_rollback_is_the_state_of_only_the_accepted_tokens(
        tiny_checkpoint, arch: str, dtype: str):
    model_dir = tiny_checkpoint(arch, dtype=dtype)
    prompt, row = hidden(9, dtype, 1), hidden(5, dtype, 2)  # row: last token + 4 drafts
    for kept in range(1, 6):  # 1: every draft rejected; 5: every one accepted
        plain = prefilled(model_dir, {1: prompt})
        outs = [step(plain, [Seq([0], 9 + t, 1)], row[t:t + 1]) for t in range(kept)]
        spec = prefilled(model_dir, {1: prompt})
        before = slot_state(spec, 1)
        out = step(spec, [Seq([0] * 5, 9, 1, num_logits=5)], row)
        for got, was in zip(slot_state(spec, 1), before, strict=True):
            assert torch.equal(got, was)  # the row leaves the slot alone, holding its inputs
        # and decodes as decode does (one row against one-token steps: equal up to the
        # summation order the CPU's kernels choose for each shape)
        torch.testing.assert_close(out[:kept], torch.cat(outs))
        spec.states.settle({1: 9 + kept})  # the request's next step: 9 + kept computed
        for got, want in zip(slot_state(spec, 1), slot_state(plain, 1), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, kept=kept: f"kept {kept}: {m}")
        assert spec.states.held_bytes == 0


def test_rows_of_one_step_settle_apart_and_ended_requests_leave_nothing(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    prompts = {0: hidden(7, "float32", 3), 2: hidden(12, "float32", 4), 3: hidden(5, "float32", 5)}
    rows = {0: hidden(4, "float32", 6), 2: hidden(5, "float32", 7), 3: hidden(2, "float32", 8)}
    spec = prefilled(model_dir, prompts)
    seqs = [Seq([0] * len(rows[s]), len(prompts[s]), s, num_logits=len(rows[s])) for s in rows]
    step(spec, seqs, torch.cat(list(rows.values())))
    held = spec.states.held_bytes
    assert held > 0
    # Next step: slot 0 kept 2 of its 4, slot 2 was cut from the step by the token budget,
    # slot 3's request ended and a new one starts in that slot.
    fresh = hidden(3, "float32", 9)
    step(spec, [Seq([0], 9, 0), Seq([0] * 3, 0, 3)], torch.cat([rows[0][2:3], fresh]))
    assert 0 < spec.states.held_bytes < held / 2  # slot 2's row alone, compacted
    spec.states.settle({2: 12 + 5})  # a step later: all 5 of slot 2's stood
    assert spec.states.held_bytes == 0
    plain = prefilled(model_dir, prompts)
    step(plain, [Seq([0], 7, 0)], rows[0][:1])
    step(plain, [Seq([0], 8, 0)], rows[0][1:2])
    step(plain, [Seq([0], 9, 0)], rows[0][2:3])
    for t in range(5):
        step(plain, [Seq([0], 12 + t, 2)], rows[2][t:t + 1])
    step(plain, [Seq([0] * 3, 0, 3)], fresh)
    for slot in (0, 2, 3):
        for got, want in zip(slot_state(spec, slot), slot_state(plain, slot), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, slot=slot: f"slot {slot}: {m}")


def test_held_rows_listed_in_another_order_settle_each_by_its_own_count(tiny_checkpoint):
    """The requests' next step may list them in another order than their verification step
    (the runner lays decode rows first): each slot still advances by its own kept count."""
    model_dir = tiny_checkpoint("qwen3_5")
    prompts = {1: hidden(6, "float32", 1), 2: hidden(9, "float32", 2)}
    rows = {1: hidden(4, "float32", 3), 2: hidden(4, "float32", 4)}
    spec = prefilled(model_dir, prompts)
    step(spec, [Seq([0] * 4, 6, 1, num_logits=4), Seq([0] * 4, 9, 2, num_logits=4)],
         torch.cat([rows[1], rows[2]]))
    spec.states.settle({2: 9 + 3, 1: 6 + 1})  # slot 2 kept 3, slot 1 kept 1; 2 listed first
    plain = prefilled(model_dir, prompts)
    step(plain, [Seq([0], 6, 1)], rows[1][:1])
    for t in range(3):
        step(plain, [Seq([0], 9 + t, 2)], rows[2][t:t + 1])
    for slot in (1, 2):
        for got, want in zip(slot_state(spec, slot), slot_state(plain, slot), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, slot=slot: f"slot {slot}: {m}")


def test_one_layer_serves_two_state_backends_each_with_its_own_slots(tiny_checkpoint):
    """The layer keeps no state: two state backends over the same layer (two runners of one
    model, say) each hold what their own steps left."""
    model_dir = tiny_checkpoint("qwen3_5")
    first, second = hidden(6, "float32", 1), hidden(9, "float32", 2)
    a = prefilled(model_dir, {1: first})
    b = Alone(a.layer, GatedDeltaStates(torch.device("cpu")))
    b.states.allocate([a.layer.state_spec], 4)
    step(b, [Seq([0] * len(second), 0, 1)], second)
    step(a, [Seq([0], 6, 1)], hidden(1, "float32", 3))
    alone_a, alone_b = prefilled(model_dir, {1: first}), prefilled(model_dir, {1: second})
    step(alone_a, [Seq([0], 6, 1)], hidden(1, "float32", 3))
    for mine, alone in ((a, alone_a), (b, alone_b)):
        for got, want in zip(slot_state(mine, 1), slot_state(alone, 1), strict=True):
            assert torch.equal(got, want)


def test_a_step_resuming_outside_the_held_row_is_refused(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    spec = prefilled(model_dir, {1: hidden(6, "float32", 1)})
    step(spec, [Seq([0] * 3, 6, 1, num_logits=3)], hidden(3, "float32", 2))
    with pytest.raises(ValueError, match="holds a verification of positions 6..8, but its "
                                         "request continues at position 10"):
        spec.states.settle({1: 10})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_held_row_takes_what_helexa_plan_sets_aside(tiny_checkpoint, dtype: str):
    from helexa.checkpoint.memory import held_bytes_per_request
    from helexa.checkpoint.shape import read_model_shape

    model_dir = tiny_checkpoint("qwen3_next", dtype=dtype)
    shape = read_model_shape(model_dir / "config.json")
    spec = prefilled(model_dir, {1: hidden(6, dtype, 1), 2: hidden(4, dtype, 2)})
    k = 4  # two rows of k + 1 positions
    step(spec, [Seq([0] * (k + 1), 6, 1, num_logits=k + 1),
                Seq([0] * (k + 1), 4, 2, num_logits=k + 1)], hidden(2 * k + 2, dtype, 3))
    per_layer = spec.states.held_bytes // 2
    assert per_layer * shape.linear_attention_layers == held_bytes_per_request(shape, 1, k)
