"""`helexa plan`'s weight bytes for a GGUF file agree with what a loaded engine holds."""

from __future__ import annotations

import pytest
from support.plan_bytes import plan_weights

from helexa.neuron.engine.model_runner import ModelRunner


@pytest.mark.parametrize(("dtype", "tp", "tied"), [("fp32", 1, False), ("bf16", 1, True),
                                                   ("fp32", 2, False)])
def test_planned_bytes_of_a_gguf_file(tiny_checkpoint, tmp_path, dtype, tp, tied):
    # every tensor type on its op: int4 (Q4_K), grouped int8 (Q8_0, Q6_K, Q5_K, mixed fused
    # layers), float (F16, BF16), a grouped int8 embedding, planned from the file alone
    from support.gguf_reference import write_gguf
    from test_gguf import TINY, type_of

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
    ("qwen3_next", "fp32", 2),  # its in_proj_qkvz split from the file's two tensors
    # MoE stacks at tp 2: the split qwen3_moe's batch of 8 (test_gguf_hybrid) runs
    pytest.param("qwen3_moe", "bf16", 2, marks=pytest.mark.slow)])
def test_planned_bytes_of_a_hybrid_gguf_file(tiny_checkpoint, tmp_path, family, dtype, tp):
    # linear-attention layers (mixed, all-Q6_K and float in_proj; the value-head split
    # of conv, A and dt), quantised and float expert stacks, shared experts, routers
    from support.gguf_hybrid_reference import write_hybrid_gguf
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
    from support.gguf_reference import write_gguf

    from helexa.plan import PlanError

    write_gguf(tiny_checkpoint("qwen3"), tmp_path / "model.gguf", lambda name: "Q8_0")
    with pytest.raises(PlanError, match="keeps its own quantisation"):
        plan_weights(tmp_path, tmp_path / "model.gguf", "int8", 32, "fp32")


@pytest.mark.parametrize(("dtype", "tp"), [("fp32", 1), ("bf16", 2)])
def test_planned_bytes_count_the_mmproj_beside_a_gguf_file(tiny_checkpoint, tmp_path, dtype, tp):
    # the vision tower of llama.cpp's mmproj file, loaded float, on top of the text GGUF's
    from support.gguf_hybrid_reference import write_hybrid_gguf
    from support.mmproj_reference import write_mmproj

    src = tiny_checkpoint("qwen3_5", vision=True)
    write_hybrid_gguf(src, tmp_path / "model.gguf", lambda name: "Q8_0")
    text_only = plan_weights(tmp_path, tmp_path / "model.gguf", "none", 128, dtype, tp)
    write_mmproj(src, tmp_path / "mmproj-model-f16.gguf", "F16")
    planned = plan_weights(tmp_path, tmp_path / "model.gguf", "none", 128, dtype, tp)
    run = ModelRunner(tmp_path / "model.gguf", num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, tp_size=tp, num_state_slots=1,
                      dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    try:
        assert run.model.visual is not None
        tower = sum(p.numel() * p.element_size() for p in run.model.visual.parameters())
        assert planned - text_only == tower  # every tower parameter, as this rank holds it
        assert abs(run.weight_bytes - planned) <= 0.02 * planned, (run.weight_bytes, planned)
    finally:
        run.close()
