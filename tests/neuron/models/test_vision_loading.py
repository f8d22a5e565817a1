"""Loading a vision-language Qwen3.5: the tower comes with config.json's vision_config and
the checkpoint's model.visual.* tensors; without its preprocessor_config.json or without
any of its tensors the model loads text only; half a tower is a missing-tensor error
naming what is missing; M-RoPE's layout is read from the text model's rope parameters."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from helexa.neuron.formats.base import open_checkpoint
from helexa.neuron.formats.loader import load_model
from helexa.neuron.formats.tensor_map import MissingTensor
from helexa.neuron.models.config import UnsupportedArchitecture, parse_model_config


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_config_reads_the_tower_and_the_mrope_section(vl_dir):
    ckpt = open_checkpoint(vl_dir)
    raw, cfg = ckpt.raw, ckpt.config
    assert cfg.vision is not None and cfg.vision.depth == 2 and cfg.vision.out_hidden_size == 64
    assert cfg.vision.image_token_id == raw["image_token_id"]
    assert cfg.mrope_section == (2, 1, 1)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(UnsupportedArchitecture, match="mrope_interleaved"):
        parse_model_config(bad)


def test_without_a_preprocessor_config_or_tower_tensors_it_loads_text_only(vl_dir, tmp_path):
    no_proc = _copy(vl_dir, tmp_path / "no-proc")
    (no_proc / "preprocessor_config.json").unlink()
    assert open_checkpoint(no_proc).config.vision is None
    assert load_model(no_proc).visual is None
    no_tower = _copy(vl_dir, tmp_path / "no-tower")
    t = load_file(str(no_tower / "model.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("model.visual.")},
              str(no_tower / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(no_tower).visual is None
    assert load_model(vl_dir).visual is not None


def test_half_a_tower_is_a_missing_tensor(vl_dir, tmp_path):
    half = _copy(vl_dir, tmp_path / "half")
    t = load_file(str(half / "model.safetensors"))
    del t["model.visual.blocks.1.mlp.linear_fc2.weight"]
    save_file(t, str(half / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match="model.visual.blocks.1.mlp.linear_fc2.weight"):
        load_model(half)


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_plan_counts_the_tower_the_loaded_model_holds(vl_dir, tiny_checkpoint, tmp_path, kind):
    from helexa.config.schema import load_neuron_config
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.plan import plan_model

    def planned(model_dir) -> int:
        path = tmp_path / "n.toml"
        path.write_text(f'[kv]\nkv_budget_mb = 1\n[[models]]\nid = "m"\npath = "{model_dir}"\n'
                        f'quantize = "{kind}"\nquant_group_size = 32\n')
        cfg = load_neuron_config(path)
        return plan_model(cfg, cfg.models[0], path).weight_bytes_per_card

    text_only = tiny_checkpoint("qwen3_5", head_dim=32)
    run = ModelRunner(vl_dir, num_blocks=8, block_size=8, max_num_seqs=1, max_batched_tokens=64,
                      quantize=kind, quant_group_size=32, num_state_slots=1)
    tower = sum(p.numel() * p.element_size() for p in run.model.visual.parameters())
    assert abs(run.weight_bytes - planned(vl_dir)) <= 0.02 * planned(vl_dir)
    assert planned(vl_dir) - planned(text_only) == pytest.approx(tower, rel=0.01)
    assert run.model.visual.blocks[0].attn.qkv.quant is None  # the tower stays float


def test_plan_sets_the_encoders_activations_aside(vl_dir, tmp_path):
    """Derived from device memory, the pool leaves room for one tower call over the largest
    image the processor makes where the headroom is less: a larger max_pixels buys a
    smaller pool, by the estimate."""
    from helexa.checkpoint.vision_shape import max_image_patches
    from helexa.config.schema import load_neuron_config
    from helexa.plan import plan_model

    def plan(model_dir, headroom_mb: int = 0):
        path = tmp_path / "n.toml"
        path.write_text(f'[server]\ndevice_memory_mb = 4096\n[kv]\n'
                        f'activation_headroom_mb = {headroom_mb}\n'
                        f'[[models]]\nid = "m"\npath = "{model_dir}"\n')
        cfg = load_neuron_config(path)
        return plan_model(cfg, cfg.models[0], path)

    big = _copy(vl_dir, tmp_path / "big")
    proc = json.loads((big / "preprocessor_config.json").read_text())
    proc["size"]["longest_edge"] *= 4
    (big / "preprocessor_config.json").write_text(json.dumps(proc))
    p, q = plan(vl_dir), plan(big)
    shape = p.shape.vision
    assert max_image_patches(big, shape) == 4 * max_image_patches(vl_dir, shape)
    patches = max_image_patches(vl_dir, shape)
    encoder = shape.encoder_activation_bytes(patches, 1, 4)  # fp32
    cache = shape.embedding_cache_bytes(patches, 4)  # two of the largest image's embeddings
    assert p.kv_budget_bytes - q.kv_budget_bytes == 3 * encoder + 3 * cache
    assert (f"the vision encoder's {-(-encoder // 2**20):,} MiB" in p.budget_source
            and f"its embedding cache's {-(-cache // 2**20):,} MiB" in p.budget_source)
    # a headroom above the encoder's already holds it: the tower's activations are freed
    # before the text model's peak in the same step; the cache stays beside either
    roomy = plan(vl_dir, headroom_mb=4 * -(-encoder // 2**20) + 1)
    assert roomy.kv_budget_bytes - plan(big, headroom_mb=4 * -(-encoder // 2**20) + 1
                                        ).kv_budget_bytes == 3 * cache
