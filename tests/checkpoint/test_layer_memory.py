"""Each layer kind states its memory once (helexa/checkpoint/layer_memory.py): what the plan
states from config.json is what the model's own layers state, and the engine allocates
exactly what they state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helexa.checkpoint.layer_memory import AttentionSpec, LinearAttentionSpec, layer_specs
from helexa.checkpoint.shape import read_model_shape

HYBRID = (Path(__file__).resolve().parents[2] / "asset" / "models" / "Qwen" / "Qwen3.5-27B"
          / "config.json")


@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_states_each_layer_as_the_model_code_does(tp: int):
    from helexa.neuron.models.config import load_model_config
    from helexa.neuron.models.hybrid import HybridForCausalLM

    _, mc = load_model_config(HYBRID.parent)
    model = HybridForCausalLM(mc, tp_rank=0, tp_size=tp, dtype=torch.bfloat16, device="meta")
    own = ([AttentionSpec(a.num_kv_heads, a.head_dim, "bf16") for a in model.attention_layers]
           + [layer.state_spec for layer in model.linear_layers])
    assert layer_specs(read_model_shape(HYBRID), tp, "bf16", "bf16") == own


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_runner_allocates_what_the_layers_state(tiny_checkpoint, kv_dtype: str):
    from helexa.neuron.engine.model_runner import ModelRunner

    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    blocks, block_size, slots = 12, 8, 3
    runner = ModelRunner(model_dir, num_blocks=blocks, block_size=block_size, kv_dtype=kv_dtype,
                         max_num_seqs=4, max_batched_tokens=64, num_state_slots=slots,
                         backend="torch")
    specs = layer_specs(read_model_shape(model_dir / "config.json"), 1, kv_dtype,
                        mtp_layers=runner.mtp_kv_layers)
    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    linear = [s for s in specs if isinstance(s, LinearAttentionSpec)]
    assert runner.mtp_kv_layers == 1 and len(attention) == len(runner.kv_pools)
    assert [kv.nbytes for kv in runner.kv_pools] == [
        s.bytes_per_token * blocks * block_size for s in attention]
    assert runner.linear_states is not None
    assert [s.nbytes for s in runner.linear_states.layers] == [
        spec.fixed_bytes_per_request * slots for spec in linear]
    assert runner.fixed_bytes_per_request == sum(s.fixed_bytes_per_request for s in linear)
