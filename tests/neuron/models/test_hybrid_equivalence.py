"""The hybrid (Gated DeltaNet + attention) and MoE families decode greedily as
transformers does, token for token, on checkpoints transformers' save_pretrained wrote:
alone, batched with seven others, in chunks smaller than the prompt over a shuffled
pool, and at tensor parallel 2 over gloo."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.greedy import greedy_generate

from helexa.neuron.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 64
FAMILIES = ["qwen3_5", "qwen3_next", "qwen3_moe", "qwen3_5_moe"]
# The batched and TP runs of the families that combine both (linear attention and
# experts) are the slowest; beast's family (qwen3_5) and qwen3_moe keep them in the
# default run, `make slow` runs them all.
HEAVY = [f if f in ("qwen3_5", "qwen3_moe") else pytest.param(f, marks=pytest.mark.slow)
         for f in FAMILIES]
DEVICE = os.environ.get("HELEXA_TEST_DEVICE", "cpu")
_COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=96, vocab_size=512, initializer_range=0.15)
_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def save_family(out: Path, family: str) -> Path:
    """A random checkpoint of `family` written by transformers' own save_pretrained."""
    import transformers as tf

    torch.manual_seed(3)
    if family == "qwen3_5":  # the multimodal wrapper: text under model.language_model, a vision tower
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=dict(**_COMMON, **_LINEAR), vision_config=_VISION))
    elif family == "qwen3_5_moe":
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(**_COMMON, **_LINEAR, **_MOE, shared_expert_intermediate_size=48),
            vision_config=_VISION))
    elif family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            **_COMMON, **_LINEAR, **_MOE, shared_expert_intermediate_size=48,
            mlp_only_layers=[1]))
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_COMMON, **_MOE, norm_topk_prob=True,
                                                         decoder_sparse_step=2))
    with torch.no_grad():  # random norms, so a skipped norm or a missed (1 + w) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.eval().save_pretrained(out / family)
    return out / family


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = save_family(root, family)
        return made[family]
    return get


def make_runner(model_dir: Path, *, tp: int = 1, num_blocks: int = 256) -> ModelRunner:
    devices = [DEVICE] * tp if DEVICE == "cpu" else [f"cuda:{i}" for i in range(tp)]
    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", device=devices[0],
                       devices=devices, tp_size=tp, num_state_slots=8)


@pytest.mark.parametrize("family", FAMILIES)
def test_alone_matches_transformers(family_dir, greedy_reference, prompt_picker, family):
    model_dir = family_dir(family)
    prompt = prompt_picker(model_dir, 0, 29)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize("family", HEAVY)
def test_with_seven_batch_mates_chunked_over_a_shuffled_pool(family_dir, greedy_reference,
                                                             prompt_picker, family):
    # Different lengths and budgets (rows finish at different steps and their state slots
    # are reused by nobody mid-run); prefill in chunks of 7, smaller than most prompts,
    # some rows decoding while others still prefill; blocks drawn from a shuffled pool.
    model_dir = family_dir(family)
    prompts = [prompt_picker(model_dir, 10 + i, 3 + 9 * i) for i in range(8)]
    budgets = [NEW_TOKENS - 5 * i for i in range(8)]
    outs = greedy_generate(make_runner(model_dir), prompts, budgets, prefill_chunk=7,
                           shuffle_seed=11)
    for prompt, ours in zip(prompts, outs, strict=True):
        greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize("family", HEAVY)
def test_tp2_matches_transformers(family_dir, greedy_reference, prompt_picker, family):
    model_dir = family_dir(family)
    prompts = [prompt_picker(model_dir, 30, 21), prompt_picker(model_dir, 31, 9)]
    two = make_runner(model_dir, tp=2)
    try:
        outs = greedy_generate(two, prompts, NEW_TOKENS, prefill_chunk=8, shuffle_seed=2)
    finally:
        two.close()
    for prompt, ours in zip(prompts, outs, strict=True):
        greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize(("family", "drop"), [
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_ba.weight"),
    ("qwen3_5", "model.language_model.layers.1.linear_attn.in_proj_z.weight"),
    ("qwen3_moe", "model.layers.1.mlp.experts.5.up_proj.weight"),
])
def test_a_missing_tensor_is_named(family_dir, tmp_path, family, drop):
    from safetensors.torch import load_file, save_file

    from helexa.neuron.formats.tensor_map import MissingTensor

    src = family_dir(family)
    out = tmp_path / family
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match=drop.rsplit(".", 2)[-2]):
        make_runner(out)


def test_vision_skipped_with_one_line_and_mtp_kept(family_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = family_dir("qwen3_5")
    out = tmp_path / "with-mtp"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    runner = make_runner(out)
    logged = capsys.readouterr()
    lines = [ln for ln in (logged.out + logged.err).splitlines() if "vision" in ln]
    assert len(lines) == 1 and "model.vision_skipped" in lines[0], lines
    assert torch.equal(runner.model.extra_tensors["mtp.fc.weight"], tensors["mtp.fc.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_init_tiny_matches_transformers(tiny_checkpoint, greedy_reference, prompt_picker, family):
    model_dir = tiny_checkpoint(family, num_layers=4)
    prompt = prompt_picker(model_dir, 40, 17)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)
