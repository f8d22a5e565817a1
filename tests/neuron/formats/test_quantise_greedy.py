"""Greedy decoding of a model quantised at load matches transformers running the same
weights dequantised, alone and in a batch of 8 (TP = 2: tests/neuron/engine/test_tp_quant.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.greedy import greedy_generate
from support.quant_reference import dequantized_checkpoint

from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.quantise import QuantSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 48
GROUP = 32  # the tiny models' hidden size is 64


def runner(model_dir: Path, kind: str, **kw) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=256, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", quantize=kind,
                       quant_group_size=GROUP, device=os.environ.get("HELEXA_TEST_DEVICE", "cpu"),
                       **kw)


@pytest.fixture(scope="module")
def reference_dirs(tiny_checkpoint, tmp_path_factory):
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(arch: str, kind: str, **kw) -> tuple[Path, Path]:
        key = (arch, kind + repr(sorted(kw.items())))
        if key not in made:
            src = tiny_checkpoint(arch, **kw)
            dst = tmp_path_factory.mktemp(f"deq-{arch}-{kind}")
            made[key] = (src, dequantized_checkpoint(src, dst, QuantSpec(kind, GROUP)))
        return made[key]

    return get


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_quantized_greedy_matches_dequantized_reference(reference_dirs, greedy_reference,
                                                        prompt_picker, arch, kind):
    # qwen3_moe: the routed experts quantised as linears of their own (the reference
    # dequantises every expert's projections), run on the quantised stacks' op
    src, ref = reference_dirs(arch, kind)
    prompt = prompt_picker(ref, 0, 21)
    run = runner(src, kind)
    if arch == "qwen3_moe":
        mlp = run.model.model.layers[0].mlp
        assert mlp.experts_kernel is not None and mlp.w13.numel() == mlp.w2.numel() == 0
    ours = greedy_generate(run, [prompt], NEW_TOKENS)[0]
    greedy_reference(ref, prompt, ours)


def test_quantized_experts_at_tp2_keep_whole_row_scales(reference_dirs, greedy_reference,
                                                        prompt_picker):
    # int8 at tp = 2 (real rank processes over gloo): each expert's down projection is split
    # by its inputs, and each rank's row scales come from the whole rows, as the reference's
    src, ref = reference_dirs("qwen3_moe", "int8")
    prompt = prompt_picker(ref, 3, 19)
    run = runner(src, "int8", tp_size=2)
    try:
        ours = greedy_generate(run, [prompt], NEW_TOKENS)[0]
    finally:
        run.close()
    greedy_reference(ref, prompt, ours)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_batch_of_eight(reference_dirs, greedy_reference, prompt_picker, kind, tp):
    # tp = 2: real rank processes over gloo; row-parallel int8 rows keep their whole-row scale,
    # int4 groups (32) fit each rank's 32 o_proj / 64 down_proj input columns.
    src, ref = reference_dirs("qwen2", kind)
    prompts = [prompt_picker(ref, 10 + i, 5 + 7 * i) for i in range(8)]
    budgets = [NEW_TOKENS - 4 * i for i in range(8)]
    run = runner(src, kind, tp_size=tp)
    try:
        outs = greedy_generate(run, prompts, budgets, shuffle_seed=5)
        alone = greedy_generate(run, prompts[:1], NEW_TOKENS)[0] if tp == 2 else None
    finally:
        run.close()
    for prompt, ours in zip(prompts, outs, strict=True):
        greedy_reference(ref, prompt, ours)
    if alone is not None:
        greedy_reference(ref, prompts[0], alone)


def test_tied_embeddings_int8(reference_dirs, greedy_reference, prompt_picker):
    src, ref = reference_dirs("qwen3", "int8", tie_word_embeddings=True)
    prompt = prompt_picker(ref, 4, 17)
    ours = greedy_generate(runner(src, "int8"), [prompt], NEW_TOKENS)[0]
    greedy_reference(ref, prompt, ours)
