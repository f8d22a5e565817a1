"""The vision tower's activation estimate (checkpoint/vision_shape.py
encoder_activation_bytes), which helexa plan and the pool probe hold in the headroom,
against the bytes a tower call really holds at once (tracked on CPU)."""

from __future__ import annotations

import pytest
import torch
from support.live_bytes import LiveBytes

from helexa.checkpoint.vision_shape import VisionShape
from helexa.neuron.models.vision import VisionTower


@pytest.mark.parametrize("side", [16, 32])
def test_a_tower_call_holds_no_more_than_the_estimate(side):
    # Qwen3.5's tower widths (hidden 1152, 16 heads, MLP 4304), one block, bf16; the
    # patches fp32 as pixel_patches gives them, alive through the call. Rotating q and k
    # made four fp32 copies at once where the estimate counts two (35% over it)
    v = VisionShape(depth=1, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    out_hidden_size=2048, patch_size=16, temporal_patch_size=2,
                    spatial_merge_size=2, in_channels=3, num_position_embeddings=2304,
                    hidden_act="gelu_pytorch_tanh", rope_theta=10000.0, image_token_id=1,
                    vision_start_token_id=2, vision_end_token_id=3, video_token_id=4)
    tower = VisionTower(v, dtype=torch.bfloat16, device="cpu")
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    with torch.inference_mode(), LiveBytes(tower) as live:
        patches = torch.randn(side * side, v.patch_dim)
        out = tower(patches, [(1, side, side)])
    assert out.shape == (side * side // 4, 2048)
    estimate = v.encoder_activation_bytes(side * side, 1, 2)
    assert live.peak <= estimate, (live.peak, estimate)
    assert live.peak > 0.7 * estimate  # and near it: the estimate is not slack
