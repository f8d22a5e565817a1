"""`helexa plan`'s weight bytes for a quantised model agree with what a loaded engine holds."""

from __future__ import annotations

import pytest
from support.plan_bytes import plan_weights

from helexa.neuron.engine.model_runner import ModelRunner


@pytest.mark.parametrize(("kind", "dtype", "tied", "tp", "arch"), [
    ("none", "fp32", False, 1, "qwen3"), ("int8", "fp32", False, 1, "qwen3"),
    ("int4", "fp32", False, 1, "qwen3"), ("int4", "bf16", False, 1, "qwen3"),
    ("int8", "bf16", True, 1, "qwen3"), ("int4", "fp32", True, 1, "qwen3"),
    ("int4", "fp32", False, 2, "qwen3"),
    # routed experts quantised too (they were left float while the plan counted them
    # quantised: a 30B-A3B at int4 planned ~16 GB and held ~60)
    ("int8", "bf16", False, 1, "qwen3_5_moe"), ("int4", "bf16", False, 1, "qwen3_moe")])
def test_planned_weight_bytes_match_the_loaded_model(tiny_checkpoint, tmp_path, kind, dtype, tied,
                                                     tp, arch):
    model_dir = tiny_checkpoint(arch, tie_word_embeddings=tied)
    planned = plan_weights(tmp_path, model_dir, kind, 32, dtype, tp)
    run = ModelRunner(model_dir, num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                      quantize=kind, quant_group_size=32, tp_size=tp, num_state_slots=1)
    try:  # rank 0's bytes: every card holds the same share here
        assert abs(run.weight_bytes - planned) <= 0.02 * planned, (run.weight_bytes, planned)
    finally:
        run.close()


def test_int4_plan_frees_room_for_kv(tmp_path, tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    full = plan_weights(tmp_path, model_dir, "none", 32, "fp32")
    assert plan_weights(tmp_path, model_dir, "int4", 32, "fp32") < full / 4
    assert plan_weights(tmp_path, model_dir, "int8", 32, "fp32") < full / 3.5


CT_FORMATS = {"ct4": (4, False, 32), "ct8": (8, True, None), "ct8-group": (8, True, 16),
              "ct8-asym": (8, False, 32), "ct8-asym-channel": (8, False, None)}


@pytest.mark.parametrize(("fmt", "dtype", "tp"), [
    ("ct4", "fp32", 1), ("ct8", "fp32", 1), ("gptq-act-order", "fp32", 1), ("awq", "fp32", 1),
    ("ct8-group", "bf16", 1), ("ct8-asym", "fp32", 1), ("ct8-asym-channel", "bf16", 1),
    ("ct8-asym", "bf16", 2), ("gptq8-act-order", "fp32", 1), ("gptq8-sym", "bf16", 1),
    ("gptq8-asym", "fp32", 2)])
def test_planned_bytes_of_checkpoints_quantised_in_the_file(tiny_checkpoint, tmp_path, fmt,
                                                            dtype, tp):
    from support.ct_reference import ct_checkpoint
    from support.gptq_reference import awq_checkpoint, gptq_checkpoint

    src = tiny_checkpoint("qwen3")
    if fmt.startswith("ct"):
        pytest.importorskip("compressed_tensors")
        model_dir, _ = ct_checkpoint(src, tmp_path / "q", tmp_path / "r", *CT_FORMATS[fmt])
    elif fmt == "awq":
        model_dir, _ = awq_checkpoint(src, tmp_path / "q", tmp_path / "r", 32)
    else:
        bits = 8 if fmt.startswith("gptq8") else 4
        model_dir, _ = gptq_checkpoint(src, tmp_path / "q", tmp_path / "r", 32,
                                       fmt.endswith("act-order"), fmt.endswith("-sym"), bits)
    planned = plan_weights(tmp_path, model_dir, "none", 128, dtype, tp)
    run = ModelRunner(model_dir, num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, tp_size=tp,
                      dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    try:  # rank 0's bytes
        assert abs(run.weight_bytes - planned) <= 0.02 * planned, (run.weight_bytes, planned)
    finally:
        run.close()
