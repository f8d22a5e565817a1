"""AWQ checkpoints (GEMM layout, 4 bits, zero points): unpacked bit-exactly against a
reference written from the format's spec, decoded as transformers decodes the weights."""

from __future__ import annotations

import pytest
import torch
from support.gptq_reference import awq_checkpoint, dequantize, pack_awq, quantize
from support.greedy import greedy_generate

from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.gptq import dequantize_gptq, unpack_awq

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_packing_known_vector():
    # column j holds j + 1; nibble i takes column ORDER[i] = 0,2,4,6,1,3,5,7
    word = pack_awq(torch.arange(1, 9).view(1, 8))
    assert word.item() == 0x86427531 - 2**32
    assert unpack_awq(word).flatten().tolist() == list(range(1, 9))


def test_unpacking_is_bit_exact():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(9))
    g_idx = torch.arange(128) // 64
    q, zeros, scales = quantize(w, 64, g_idx, sym=False)
    ref = dequantize(q, zeros, scales, g_idx)
    got = dequantize_gptq(unpack_awq(pack_awq(q)), unpack_awq(pack_awq(zeros)), scales, g_idx)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_matches_transformers_on_dequantised_weights(tiny_checkpoint, tmp_path,
                                                            greedy_reference, prompt_picker, tp):
    model_dir, ref = awq_checkpoint(tiny_checkpoint("qwen2"), tmp_path / "awq", tmp_path / "ref", 32)
    prompts = [prompt_picker(ref, 60 + i, 6 + 5 * i) for i in range(8 if tp == 1 else 3)]
    run = ModelRunner(model_dir, num_blocks=256, block_size=8, max_num_seqs=8,
                      max_batched_tokens=512, dtype="float32", tp_size=tp)
    try:
        outs = greedy_generate(run, prompts, 40, shuffle_seed=6)
    finally:
        run.close()
    for prompt, got in zip(prompts, outs, strict=True):
        greedy_reference(ref, prompt, got)
