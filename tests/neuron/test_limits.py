"""The context check and the limits a model runs under (base config + profile)."""

from __future__ import annotations

import grpc
import msgspec
import pytest

from helexa.config.schema import NeuronConfig
from helexa.neuron.grpc_status import status_of
from helexa.neuron.limits import ModelLimits, check_context, effective_kv_dtype, effective_limits
from helexa.refusal import Refusal

LIMITS = ModelLimits(context=100, input=99, output=60)


def test_a_prompt_that_fits_with_its_output_passes() -> None:
    check_context(40, 60, LIMITS)
    check_context(99, None, LIMITS)


@pytest.mark.parametrize("prompt, max_tokens", [(100, None), (150, None), (41, 60), (99, 2)])
def test_too_long_is_context_length_exceeded_stating_both_numbers(prompt: int,
                                                                  max_tokens: int | None) -> None:
    with pytest.raises(Refusal) as e:
        check_context(prompt, max_tokens, LIMITS)
    assert e.value.code == "context_length_exceeded"
    assert status_of(e.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "100" in e.value.message and str(prompt) in e.value.message


def test_max_tokens_over_the_output_limit_is_refused_naming_the_param() -> None:
    with pytest.raises(Refusal) as e:
        check_context(10, 61, LIMITS)
    assert e.value.code == "invalid_request_error" and "max_tokens" in e.value.message


def test_profile_overrides_only_what_it_sets() -> None:
    cfg = msgspec.convert({
        "admission": {"max_in_flight": 8, "max_queue_depth": 5},
        "engine": {"max_slots": 4},
        "kv": {"kv_dtype": "fp16"},
        "profiles": {"batch": {"max_in_flight": 32, "kv_dtype": "int8"}, "plain": {}},
    }, NeuronConfig)
    base = effective_limits(cfg)
    assert (base.max_in_flight, base.max_queue_depth, base.max_slots) == (8, 5, 4)
    batch = effective_limits(cfg, "batch")
    assert (batch.max_in_flight, batch.max_queue_depth, batch.max_slots) == (32, 5, 4)
    assert effective_kv_dtype(cfg, "batch") == "int8"
    assert effective_kv_dtype(cfg, "plain") == "fp16"
    assert effective_kv_dtype(cfg) == "fp16"


def test_limits_past_what_a_model_is_built_for_run_at_its_figures_until_rebuilt() -> None:
    """Limits asking for more decode rows or step tokens than the runner is built for, or
    (a hybrid) more requests in flight than its state slots, run at its figures and say
    so: until the re-plan that follows (a reload's) is done, or for good where none can
    (an engine that cannot re-plan); within them nothing changes."""
    from types import SimpleNamespace

    from helexa.neuron.engine import messages
    from helexa.neuron.limits import within_ceilings

    model = SimpleNamespace(model_id="m", step_ceilings=(8, 2048), num_state_slots=4)
    asked = messages.Limits(max_slots=16, max_batched_tokens=4096, prefill_chunk_tokens=512,
                            max_in_flight=32)
    got, notes = within_ceilings(asked, model)
    assert (got.max_slots, got.max_batched_tokens, got.prefill_chunk_tokens,
            got.max_in_flight) == (8, 2048, 512, 4)
    assert notes == [
        "max_slots: 16 is more than the 8 this model is built for; 8 runs (reload the "
        "model to raise it)",
        "max_batched_tokens: 4096 is more than the 2048 this model is built for; 2048 runs "
        "(reload the model to raise it)",
        "max_in_flight: 32 is more than the 4 linear-attention state slots this model "
        "holds; 4 run at once (its pool holds no more beside one request of its context)"]
    _, notes = within_ceilings(asked, model, replan=True)  # a reload re-plans its pool next
    assert notes[-1].endswith("4 run at once until its pool is re-planned for more "
                              "(model.switched)")
    assert notes[0] == ("max_slots: 16 is more than the 8 this model is built for; 8 runs "
                        "until it is rebuilt for more (model.switched)")
    inside = messages.Limits(max_slots=8, max_batched_tokens=1024, max_in_flight=4)
    assert within_ceilings(inside, model) == (inside, [])
    dense = SimpleNamespace(model_id="d", step_ceilings=(0, 0), num_state_slots=0)
    assert within_ceilings(asked, dense) == (asked, [])  # unknown ceilings: nothing cut
