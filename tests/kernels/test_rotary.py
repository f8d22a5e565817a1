"""Rotary frequencies and rotation agree with transformers for every rope type we accept."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels.rotary import RotaryTable, apply_rotary, apply_rotary_reference, rope_inv_freq

CASES = [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 512}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16,
              "mscale": 1.0, "mscale_all_dim": 0.5}),
]


@pytest.mark.parametrize(("rope_type", "params"), CASES)
def test_inv_freq_matches_transformers(rope_type, params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": rope_type, "rope_theta": 50000.0, **params}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                      max_position_embeddings=2048, rope_parameters=rope)
    if rope_type == "default":
        ref = 1.0 / (50000.0 ** (torch.arange(0, 32, 2).float() / 32))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    ours, scale = rope_inv_freq(rope_type, 50000.0, 32, params)
    torch.testing.assert_close(ours, ref.float())
    assert scale == pytest.approx(ref_scale)


def test_table_rotation_matches_reference():
    table = RotaryTable("yarn", 10000.0, 16, {"factor": 2.0, "original_max_position_embeddings": 64},
                        dtype=torch.float32, device="cpu", initial_len=8)
    positions = torch.tensor([0, 3, 7, 100, 2500])
    table.ensure(2501)  # grows past its initial length
    x = torch.randn(5, 6, 16)
    cos, sin = table.cos_sin(positions)
    inv_freq, scale = rope_inv_freq("yarn", 10000.0, 16, {"factor": 2.0,
                                                        "original_max_position_embeddings": 64})
    torch.testing.assert_close(apply_rotary(x, cos.unsqueeze(1), sin.unsqueeze(1)),
                               apply_rotary_reference(x, positions, inv_freq, scale))
