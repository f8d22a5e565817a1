"""Greedy decoding through ModelRunner matches transformers token for token."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support.greedy import greedy_generate

from helexa.neuron.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 64


def make_runner(model_dir: Path, *, block_size: int = 8, num_blocks: int = 256) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=block_size, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32",
                       device=os.environ.get("HELEXA_TEST_DEVICE", "cpu"))


def hf_saved_checkpoint(tmp: Path, arch: str, *, shard: bool = False, **cfg_kw) -> Path:
    """A checkpoint written by transformers' own save_pretrained (weights scaled off near-ties)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(1)
    cfg = cls[0](hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, vocab_size=512, initializer_range=0.15,
                 **cfg_kw)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # random norms too, so a skipped norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = tmp / f"hf-{arch}{'-sharded' if shard else ''}"
    model.save_pretrained(out, max_shard_size="100KB" if shard else "1GB")
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_init_tiny_greedy_matches_transformers(tiny_checkpoint, greedy_reference, prompt_picker, arch):
    model_dir = tiny_checkpoint(arch)
    prompt = prompt_picker(model_dir, 0, 23)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_save_pretrained_greedy_matches_transformers(tmp_path, greedy_reference, prompt_picker, arch):
    model_dir = hf_saved_checkpoint(tmp_path, arch)
    prompt = prompt_picker(model_dir, 1, 19)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


def test_sharded_checkpoint_with_index(tmp_path, greedy_reference, prompt_picker):
    model_dir = hf_saved_checkpoint(tmp_path, "qwen2", shard=True)
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    prompt = prompt_picker(model_dir, 2, 30)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


ROPE_CASES = [
    ("qwen2", {"rope_type": "linear", "factor": 2.0}, False),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, False),
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, False),
    ("llama", {"type": "linear", "factor": 4.0}, True),  # the old rope_scaling spelling
    ("qwen3", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}, True),
]


@pytest.mark.parametrize(("arch", "scaling", "legacy"), ROPE_CASES)
def test_rope_scaling_greedy_matches_transformers(tiny_checkpoint, greedy_reference, prompt_picker, arch,
                                                  scaling, legacy):
    model_dir = tiny_checkpoint(arch, rope_scaling=scaling, legacy_config=legacy)
    raw = json.loads((model_dir / "config.json").read_text())
    assert ("rope_scaling" in raw) == legacy
    prompt = prompt_picker(model_dir, 3, 40)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


def test_tied_embeddings(tiny_checkpoint, greedy_reference, prompt_picker):
    model_dir = tiny_checkpoint("qwen3", tie_word_embeddings=True)
    prompt = prompt_picker(model_dir, 4, 17)
    ours = greedy_generate(make_runner(model_dir), [prompt], NEW_TOKENS)[0]
    greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_batched_with_seven_others_of_different_lengths(tiny_checkpoint, greedy_reference, prompt_picker, arch):
    model_dir = tiny_checkpoint(arch)
    prompts = [prompt_picker(model_dir, 10 + i, 5 + 9 * i) for i in range(8)]
    budgets = [NEW_TOKENS - 5 * i for i in range(8)]  # rows finish at different steps
    outs = greedy_generate(make_runner(model_dir), prompts, budgets, shuffle_seed=7)
    for prompt, ours in zip(prompts, outs, strict=True):
        greedy_reference(model_dir, prompt, ours)


@pytest.mark.parametrize("shuffle", [3, None])  # scattered blocks (gathered) or consecutive (views)
def test_chunked_prefill_smaller_than_prompt(tiny_checkpoint, greedy_reference, prompt_picker,
                                             shuffle):
    model_dir = tiny_checkpoint("llama")
    prompts = [prompt_picker(model_dir, 20, 45), prompt_picker(model_dir, 21, 12),
               prompt_picker(model_dir, 22, 30)]
    outs = greedy_generate(make_runner(model_dir), prompts, NEW_TOKENS, prefill_chunk=7,
                           shuffle_seed=shuffle)
    for prompt, ours in zip(prompts, outs, strict=True):
        greedy_reference(model_dir, prompt, ours)
