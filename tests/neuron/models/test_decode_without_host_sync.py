"""A decode step's forward makes no host sync outside attention, dense, hybrid and MoE (its
experts in the form CUDA decode uses): what a CUDA graph captures at load must not stop
for the host. Attention is stood in by a sync-free op here, as FlashInfer's is on CUDA
(the torch backend's CPU attention reads lengths on the host and is never captured)."""

from __future__ import annotations

import pytest
import torch
from support.host_sync import NoHostSync

from helexa.kernels import moe_experts
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("form", ["gathered", "masked"])
def test_a_decode_forward_makes_no_host_sync_outside_attention(tiny_checkpoint, monkeypatch,
                                                                arch, form):
    runner = ModelRunner(tiny_checkpoint(arch), num_blocks=16, block_size=4, max_num_seqs=2,
                         max_batched_tokens=64, num_state_slots=2, backend="torch")
    runner.execute([SeqInput([1, 2, 3], 0, [1], True, 0), SeqInput([1, 2], 0, [2], True, 1)])
    seqs = [SeqInput([4], 3, [1], True, 0), SeqInput([5], 2, [2], True, 1)]
    ids, positions, step, _ = runner._prepare(seqs)
    state = runner.linear_states.plan(step) if runner.linear_states is not None else None
    meta = runner.backend.attention.plan(step)
    monkeypatch.setattr(runner.backend.attention, "forward",
                        lambda layer, q, k, v, meta: torch.zeros_like(q))
    monkeypatch.setattr(moe_experts, "choose_form", lambda *a: form)  # as on a CUDA decode
    with NoHostSync(), torch.inference_mode():
        logits = runner.model(ids, positions, meta, None, *([state] if state else []))
    assert logits.shape == (2, runner.vocab_size)


@pytest.mark.parametrize("fla", [False, True])
def test_a_verification_step_of_a_hybrid_makes_no_host_sync_outside_attention(
        tiny_checkpoint, monkeypatch, fla):
    """A speculative verification row (its token and 3 drafts) beside a decode row, on the
    torch forms and on fla's kernel (stood in): its linear-attention layers take their rows
    by index, never by a bool mask (each would be a wait for the device, twice a layer)."""
    from support.fla import StandInRecurrent

    from helexa.kernels import fla_gdn

    if fla:
        monkeypatch.setattr(fla_gdn, "_fla_recurrent", StandInRecurrent())
        monkeypatch.setattr(fla_gdn, "fla_decode_available", lambda device: True)
    runner = ModelRunner(tiny_checkpoint("qwen3_5"), num_blocks=16, block_size=4,
                         max_num_seqs=2, max_batched_tokens=64, num_state_slots=2,
                         backend="torch")
    assert ("verification rows fla" in runner.attention_backend) == fla
    runner.execute([SeqInput([1, 2, 3], 0, [1], True, 0), SeqInput([1, 2], 0, [2], True, 1)])
    seqs = [SeqInput([4], 3, [1], True, 0), SeqInput([5, 6, 7, 8], 2, [2, 3], True, 1,
                                                      num_logits=4)]
    ids, positions, step, rows = runner._prepare(seqs)
    state = runner.linear_states.plan(step)
    meta = runner.backend.attention.plan(step)
    monkeypatch.setattr(runner.backend.attention, "forward",
                        lambda layer, q, k, v, meta: torch.zeros_like(q))
    with NoHostSync(), torch.inference_mode():
        logits = runner.model(ids, positions, meta, rows, state)
    assert logits.shape == (5, runner.vocab_size)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_decode_over_quantised_kv_makes_no_host_sync(tiny_checkpoint, kv_dtype):
    """Quantised KV runs the torch attention path on CUDA too (FlashInfer reads no packed
    pool): its decode rows of different lengths take their mask from the planner's host
    figure, not a read of the device each layer."""
    runner = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4, max_num_seqs=2,
                         max_batched_tokens=64, backend="torch", kv_dtype=kv_dtype)
    runner.execute([SeqInput([1, 2, 3, 4, 5], 0, [1, 2], True, 0),
                    SeqInput([1, 2, 3], 0, [3], True, 1)])
    seqs = [SeqInput([4], 5, [1, 2], True, 0), SeqInput([5], 3, [3], True, 1)]
    ids, positions, step, _ = runner._prepare(seqs)
    meta = runner.backend.attention.plan(step)
    with NoHostSync(), torch.inference_mode():
        logits = runner.model(ids, positions, meta, None)
    assert logits.shape == (2, runner.vocab_size)


def test_a_graphs_decode_over_quantised_kv_makes_no_host_sync(tiny_checkpoint):
    """Where a quantised pool's write and decode kernels serve (stood in by sync-free ops,
    as the Triton kernels are on CUDA), a decode step is planned into a graph's fixed
    buffers (TorchBackend.static_meta) and its forward, attention included, reads no value
    back: not its lengths, not its split count, not a tolist."""
    runner = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4, max_num_seqs=2,
                         max_batched_tokens=64, backend="torch", kv_dtype="int8")
    attn = runner.backend.attention
    attn.graph_rows = 2  # as the cuda backend composes it with graphs asked for
    attn.quant_write = lambda kv, slots, k, v: kv.k_scale.index_fill_(0, slots, 1.0)
    attn.quant_decode = lambda q, kv, table, lens, most, bs, per_row: (
        q * lens[:, None, None].to(q.dtype) + table[:, :1, None].to(q.dtype))
    runner.execute([SeqInput([1, 2, 3], 0, [1], True, 0), SeqInput([1, 2], 0, [2], True, 1)])
    ids, positions, step, _ = runner._prepare([SeqInput([4], 3, [1], True, 0),
                                               SeqInput([5], 2, [2], True, 1)])
    meta = attn.plan(step)
    assert meta.graph_rows == 2 and meta.decode_rows is not None and meta.decode_rows[4]
    with NoHostSync(), torch.inference_mode():
        logits = runner.model(ids, positions, meta, None)
    assert logits.shape == (2, runner.vocab_size)
