"""helexa/checkpoint/step_memory.py: what a CUDA card holds in the activation headroom
beside the graphs and the all-reduce workspace, each term worked by hand for a shape, and
the step's activation estimate against the bytes a real step holds at once on CPU (a
dense model's here; a hybrid's on fla's own kernels in Triton's interpreter, in a process
of its own: tests/support/fla_step_memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.live_bytes import LiveBytes

from helexa.checkpoint.shape import read_model_shape
from helexa.checkpoint.step_memory import (
    NCCL_MARGIN_BYTES,
    activation_need,
    fla_chunk_bytes,
    flashinfer_eager_bytes,
    layer_token_bytes,
    rope_positions,
    rope_table_bytes,
    step_activations,
)
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.engine.seq_input import SeqInput

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "asset" / "models" / "Qwen"
DENSE, HYBRID = ASSET / "Qwen3-8B" / "config.json", ASSET / "Qwen3.5-27B" / "config.json"
FLA = Path(sys.prefix) / "fla"
MIB = 2**20


def test_the_dense_8bs_step_worked_by_hand():
    shape = read_model_shape(DENSE)  # hidden 4,096, MLP 12,288, 32 heads of 128, 8 KV
    # the input, the stream and the layer before's output (3 x 8 KiB), the stream after the
    # add and its normed output (2 x 8 KiB), gate/up (48 KiB) and SiLU-and-mul (24 KiB)
    assert layer_token_bytes(shape, 1, 2)["dense MLP"] == 2 * (5 * 4096 + 3 * 12_288)
    # at tp 2 the MLP's share halves, the stream does not
    assert layer_token_bytes(shape, 2, 2)["dense MLP"] == 2 * (5 * 4096 + 3 * 6144)
    step = step_activations(shape, 1, 8192, 2, logits_rows=8)
    assert step.layer == "dense MLP" and step.states == 0
    # + ids, positions and slots (3 x 8 B) and the torch rotation's cos and sin (2 x 128 x 2)
    assert step.per_token == 2 * (5 * 4096 + 3 * 12_288) + 24 + 512
    # 8 rows' logits: the rows gathered (4,096 x 2), the head's output (151,936 x 2), fp32
    assert step.logits == 8 * (4096 * 2 + 151_936 * 2 + 151_936 * 4)
    assert step.total == 8192 * step.per_token + step.logits  # 0.9 GB
    # at tp 2 the head's slices are gathered and joined before the fp32 copy
    assert step_activations(shape, 2, 8192, 2, 8).logits == 8 * (
        4096 * 2 + 151_936 * 4 + 2 * (75_968 + 2 * 75_968 + 151_936))


def test_a_gated_deltanet_layer_of_the_27b_at_tp2_worked_by_hand():
    shape = read_model_shape(HYBRID)  # hidden 5,120; 16 key, 48 value heads of 128
    # fla-core 0.6.0's chunk intermediates a token and value head: g's cumulative sum
    # (fp32), A (64), w (128), u, v_new and o (3 x 128) and h's 128 x 128 a 64-token chunk
    assert fla_chunk_bytes(128, 128, 2) == 4 + 2 * (64 + 128 + 384) + 2 * 128 * 128 // 64 == 1668
    # per card 8 key and 24 value heads: conv channels 2 x 1,024 + 3,072 = 5,120
    own = (2 * (5120 + 3072 + 48)  # in_proj's [q | k | v], z, b, a
           + 2 * 2 * 5120  # the conv's output and its buffer
           + 4 * (2 * 1024 + 48 + 3072)  # q, k normalised, g, beta and o in fp32
           + 2 * (2 * 1024 + 3072 + 24)  # fla's inputs
           + 24 * 1668)  # fla's intermediates
    held = 3 * 5120 * 2  # input, stream, the layer before's output
    assert layer_token_bytes(shape, 2, 2)["Gated DeltaNet"] == held + own == 138_672
    step = step_activations(shape, 2, 8192, 2, logits_rows=8, sequences=8)
    assert step.layer == "Gated DeltaNet"  # over the MLP (dense, 17,408 wide) and attention
    # 8 sequences' states: gathered (bf16), in fp32 for fla, and fla's final one (fp32)
    assert step.states == 8 * 24 * 128 * 128 * (2 + 4 + 4)
    assert 1.1 * 2**30 < step.total < 1.2 * 2**30


def test_an_moe_prefill_and_its_sync_free_steps():
    """A prefill chunk runs the looped form (one expert's rows, at most every token); CUDA's
    eager steps of up to 256 rows run a sync-free form whose [E, N, 2I] and [E, N, H]
    products (moe_experts.experts_masked) are counted at min(256, N) rows."""
    moe = replace(read_model_shape(DENSE), num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, hidden_size=2048, intermediate_size=6144)
    kinds = layer_token_bytes(moe, 1, 2)
    assert "dense MLP" not in kinds  # intermediate_size is not an MLP of an MoE model here
    # the stream (5 x 2,048 x 2), the output, the router's fp32 probabilities over 128
    # experts and the top 8's weights and ids, one expert's row, gate/up, SiLU and product
    assert kinds["MoE MLP"] == 2 * 5 * 2048 + 2 * 2048 + 4 * 128 + 12 * 8 + 2 * (
        3 * 2048 + 4 * 768)
    step = step_activations(moe, 1, 8192, 2, logits_rows=8)
    assert step.sync_free_rows == 256
    assert step.sync_free == 128 * 256 * (3 * 768 + 2048) * 2  # the masked form's, 285 MB
    # up to 5 rows (3 x 5 x 8 <= 128) gather: each (row, choice)'s gate/up copy, 3 MiB
    assert step_activations(moe, 1, 5, 2, 1).sync_free == 5 * 8 * 2 * 768 * 2048 * 2
    assert step.total == 8192 * step.per_token + step.logits  # the prefill is larger here
    small = step_activations(moe, 1, 300, 2, logits_rows=8)  # but not in a 300-token step
    assert small.total == 256 * small.per_token + small.sync_free + small.logits
    assert step_activations(moe, 1, 100, 2, 8).sync_free == 128 * 100 * (3 * 768 + 2048) * 2
    assert step_activations(moe, 1, 8192, 2, 8, cuda=False).sync_free == 0  # CPU loops


def test_flashinfer_the_rotary_table_and_the_nccl_margin():
    hybrid, dense = read_model_shape(HYBRID), read_model_shape(DENSE)
    # one float workspace (256 MiB: a group of 6 at head_dim 256 splits into less) and
    # the prefill and decode wrappers' int workspaces; a torch-path pool runs no decode one
    assert flashinfer_eager_bytes(hybrid, 2, True) == (256 + 2 * 8) * MIB
    assert flashinfer_eager_bytes(hybrid, 2, False) == (256 + 8) * MIB
    # 262,144 positions x 64 rotary dims (a quarter of 256) x (cos, sin in bf16 + fp32 table)
    assert hybrid.rotary_dim == 64 and dense.rotary_dim == 0
    assert rope_table_bytes(hybrid, 262_144, 2) == 262_144 * 64 * 8 == 128 * MIB
    assert rope_table_bytes(dense, 40_960, 2) == 40_960 * 128 * 8
    assert rope_table_bytes(dense, 40_960, 4) == 40_960 * 128 * 8  # fp32: no FlashInfer table
    # graphs freeze the table at the model's reach; without, it doubles up to the context
    assert rope_positions(dense, 40_960, 32_768, graphs=True) == 40_960
    assert rope_positions(dense, 40_960, 32_768, graphs=False) == 32_768
    assert rope_positions(dense, 40_960, 20_000, graphs=False) == 32_768
    kw = {"tokens": 2048, "logits_rows": 8, "sequences": 8, "positions": 40_960, "graphs": 0,
          "allreduce": 0, "encoder": 0, "cache": 0, "flashinfer_pool": True}
    one, two = activation_need(dense, 1, 2, **kw), activation_need(dense, 2, 2, **kw)
    assert (one.comm, two.comm) == (0, NCCL_MARGIN_BYTES)  # the margin only at tp > 1
    assert one.total == (one.step.total + one.flashinfer + one.rope)


def _pool_tensors(runner: ModelRunner) -> list[torch.Tensor]:
    owners = [*runner.kv_pools, *(runner.linear_states.layers if runner.linear_states else [])]
    return [t for o in owners for t in vars(o).values() if isinstance(t, torch.Tensor)]


def test_a_dense_prefill_holds_what_the_estimate_counts(tiny_checkpoint):
    """A 512-token prefill of a bf16 Qwen3 (hidden 256, MLP 1,024) on CPU: the tensors it
    holds at once (the KV pool aside, which is not the step's) against the estimate, whose
    torch forms (the stream's add and norm) are the CPU's; within 2% of it, not over."""
    path = tiny_checkpoint("qwen3", hidden_size=256, intermediate_size=1024, dtype="bfloat16")
    n = 512
    runner = ModelRunner(path, num_blocks=n // 16 + 2, block_size=16, max_num_seqs=1,
                         max_batched_tokens=n, backend="torch")
    step = [SeqInput([(7 * i) % 500 + 1 for i in range(n)], 0, list(range(n // 16)), True)]
    with torch.inference_mode(), LiveBytes(runner.model) as live:
        live.held |= {t.untyped_storage().data_ptr() for t in _pool_tensors(runner)}
        runner.execute(step)
    estimate = step_activations(read_model_shape(path / "config.json"), 1, n, 2, 1).total
    assert 0.98 * estimate <= live.peak <= estimate, (live.peak, estimate)


def test_a_hybrid_prefill_on_fla_holds_what_the_estimate_counts():
    """A qwen3_5 whose Gated DeltaNet layers (6 value heads of 64) outweigh its MLP and
    attention, one 128-token prefill on fla's chunked kernel: its peak against the
    estimate, fla's intermediates included (within 5%, not over)."""
    if not (FLA / ".installed").exists():
        pytest.skip(f"fla-core is not installed in {FLA} (make setup installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(FLA), str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-P", "-W", "ignore",
                           str(ROOT / "tests/support/fla_step_memory.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "fla chunked prefill" in got["backend"] and got["layer"] == "Gated DeltaNet"
    assert 0.95 * got["estimate"] <= got["peak"] <= got["estimate"], got


def test_sampling_counts_where_it_peaks_above_the_text_step():
    """A step's logits sampled after its forward: the fp32 logits and the sampler's 50 B a
    logit (measured on CPU) for the rows that want them; it counts where it is larger than
    the text step (many rows over a big vocabulary beside a short prefill)."""
    from helexa.checkpoint.step_memory import SAMPLING_BYTES_PER_LOGIT

    dense = read_model_shape(DENSE)  # 151,936-token vocabulary
    kw = {"positions": 40_960, "graphs": 0, "allreduce": 0, "encoder": 0, "cache": 0,
          "flashinfer_pool": True, "sequences": 8}
    long = activation_need(dense, 1, 2, tokens=8192, logits_rows=8, **kw)
    assert long.sampling == 8 * 151_936 * (4 + SAMPLING_BYTES_PER_LOGIT)
    assert long.total == long.step.total + long.flashinfer + long.rope  # the step is larger
    wide = activation_need(dense, 1, 2, tokens=256, logits_rows=256, **kw)
    assert wide.sampling == 256 * 151_936 * 54 > wide.step.total  # 2.1 GB: it counts
    assert wide.total == wide.sampling + wide.flashinfer + wide.rope
    few = activation_need(dense, 1, 2, tokens=4, logits_rows=256, **kw)
    assert few.sampling == 4 * 151_936 * 54  # no more rows than the step's tokens
