"""`helexa model init-tiny --arch qwen3_5 --vision`: a checkpoint transformers' own
Qwen3_5ForConditionalGeneration and its processor load whole, whose text weights are those
of the checkpoint without a tower."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support.vision import hf_inputs, hf_model, hf_processor, make_image

from helexa.cli import main as helexa_main
from helexa.fixtures.vision import IMAGE_PLACEHOLDER, VISION_TOKENS


@pytest.fixture(scope="module")
def vision_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def test_transformers_loads_the_tower_and_its_processor_expands_the_image(vision_dir):
    import transformers as tf

    _, info = tf.Qwen3_5ForConditionalGeneration.from_pretrained(vision_dir,
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    cfg = json.loads((vision_dir / "config.json").read_text())
    tok = hf_processor(str(vision_dir)).tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS] == [
        cfg["vision_start_token_id"], cfg["vision_end_token_id"], cfg["image_token_id"],
        cfg["video_token_id"]]
    assert max(cfg["image_token_id"], cfg["video_token_id"]) < cfg["text_config"]["vocab_size"]
    # 100 x 70 pixels resize to 96 x 64: a 6 x 4 grid of 16-pixel patches, 6 image tokens
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    inputs = hf_inputs(vision_dir, msgs, [make_image(100, 70)])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(cfg["image_token_id"]) == 6
    assert IMAGE_PLACEHOLDER in tok.apply_chat_template(msgs, tokenize=False)
    with torch.inference_mode():  # the tower runs: its output reaches the logits
        a = hf_model(str(vision_dir))(**inputs).logits[0, -1]
        other = hf_inputs(vision_dir, msgs, [make_image(100, 70, seed=1)])
        b = hf_model(str(vision_dir))(**other).logits[0, -1]
    assert not torch.allclose(a, b)


def test_the_text_weights_are_those_without_a_tower(vision_dir, tiny_checkpoint):
    plain = load_file(tiny_checkpoint("qwen3_5", head_dim=32) / "model.safetensors")
    with_tower = load_file(vision_dir / "model.safetensors")
    tower = {k for k in with_tower if k.startswith("model.visual.")}
    assert {"model.visual.patch_embed.proj.weight", "model.visual.pos_embed.weight",
            "model.visual.blocks.1.attn.qkv.weight", "model.visual.merger.linear_fc2.weight"} <= tower
    assert set(with_tower) - tower == set(plain)
    assert all(torch.equal(with_tower[k], plain[k]) for k in plain)


def test_cli_vision_flag(tmp_path):
    out = tmp_path / "v"
    assert helexa_main(["model", "init-tiny", str(out), "--arch", "qwen3_5", "--vision"]) == 0
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    assert json.loads((out / "config.json").read_text())["vision_config"]["depth"] == 2
    with pytest.raises(SystemExit):
        helexa_main(["model", "init-tiny", str(tmp_path / "d"), "--arch", "qwen3", "--vision"])
