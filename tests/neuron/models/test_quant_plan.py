"""`helexa plan`'s weight bytes for a quantised model agree with what a loaded engine holds."""

from __future__ import annotations

import pytest

from helexa.config.schema import load_neuron_config
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.plan import plan_model


def plan_weights(tmp_path, model_dir, kind: str, group: int, dtype: str, tp: int = 1) -> int:
    path = tmp_path / "n.toml"
    path.write_text(f"""
[kv]
kv_budget_mb = 1
[[models]]
id = "tiny"
path = "{model_dir}"
dtype = "{dtype}"
quantize = "{kind}"
quant_group_size = {group}
tp = {tp}
""")
    cfg = load_neuron_config(path)
    return plan_model(cfg, cfg.models[0], path).weight_bytes_per_card


@pytest.mark.parametrize(("kind", "dtype", "tied", "tp"), [
    ("none", "fp32", False, 1), ("int8", "fp32", False, 1), ("int4", "fp32", False, 1),
    ("int4", "bf16", False, 1), ("int8", "bf16", True, 1), ("int4", "fp32", True, 1),
    ("int4", "fp32", False, 2)])
def test_planned_weight_bytes_match_the_loaded_model(tiny_checkpoint, tmp_path, kind, dtype, tied,
                                                     tp):
    model_dir = tiny_checkpoint("qwen3", tie_word_embeddings=tied)
    planned = plan_weights(tmp_path, model_dir, kind, 32, dtype, tp)
    run = ModelRunner(model_dir, num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                      quantize=kind, quant_group_size=32, tp_size=tp)
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
    from ct_reference import ct_checkpoint
    from gptq_reference import awq_checkpoint, gptq_checkpoint

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


@pytest.mark.parametrize(("dtype", "tp", "tied"), [("fp32", 1, False), ("bf16", 1, True),
                                                   ("fp32", 2, False)])
def test_planned_bytes_of_a_gguf_file(tiny_checkpoint, tmp_path, dtype, tp, tied):
    # every tensor type on its op: int4 (Q4_K), grouped int8 (Q8_0, Q6_K, Q5_K, mixed fused
    # layers), float (F16, BF16), a grouped int8 embedding, planned from the file alone
    from gguf_reference import write_gguf
    from test_quant_gguf import TINY, type_of

    src = tiny_checkpoint("qwen3", **TINY, tie_word_embeddings=tied)
    write_gguf(src, tmp_path / "model.gguf", type_of)
    planned = plan_weights(tmp_path, tmp_path / "model.gguf", "none", 128, dtype, tp)
    run = ModelRunner(tmp_path / "model.gguf", num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, tp_size=tp,
                      dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    try:
        assert abs(run.weight_bytes - planned) <= 0.02 * planned, (run.weight_bytes, planned)
    finally:
        run.close()


@pytest.mark.parametrize(("family", "dtype", "tp"), [
    ("qwen3_5", "fp32", 1), ("qwen3_5", "bf16", 2), ("qwen3_5_moe", "bf16", 1),
    ("qwen3_next", "fp32", 2), ("qwen3_moe", "bf16", 2)])
def test_planned_bytes_of_a_hybrid_gguf_file(tiny_checkpoint, tmp_path, family, dtype, tp):
    # linear-attention layers (mixed, all-Q6_K and float in_proj; the value-head split
    # of conv, A and dt), quantised and float expert stacks, shared experts, routers
    from gguf_hybrid_reference import write_hybrid_gguf
    from test_gguf_hybrid import TINY, type_of

    write_hybrid_gguf(tiny_checkpoint(family, **TINY), tmp_path / "model.gguf", type_of)
    planned = plan_weights(tmp_path, tmp_path / "model.gguf", "none", 128, dtype, tp)
    run = ModelRunner(tmp_path / "model.gguf", num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, tp_size=tp, num_state_slots=1,
                      dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    try:
        assert abs(run.weight_bytes - planned) <= 0.02 * planned, (run.weight_bytes, planned)
    finally:
        run.close()


def test_quantize_on_a_gguf_file_is_refused(tiny_checkpoint, tmp_path):
    from gguf_reference import write_gguf

    from helexa.plan import PlanError

    write_gguf(tiny_checkpoint("qwen3"), tmp_path / "model.gguf", lambda name: "Q8_0")
    with pytest.raises(PlanError, match="keeps its own quantisation"):
        plan_weights(tmp_path, tmp_path / "model.gguf", "int8", 32, "fp32")
