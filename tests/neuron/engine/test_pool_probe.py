"""The CUDA pool sized by measurement (pool_probe.measured_blocks), its CUDA calls stood in:
what it leaves beside the pool for the graphs captured after it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from helexa.checkpoint.memory import FI_WRAPPER_INT_BYTES
from helexa.neuron.engine import memory_plan, pool_probe

MIB = 2**20


def _measure(monkeypatch: Any, graphs: list[int], encoder: int = 0,
             cache: int | None = None, torch_path: str = "") -> dict[str, int]:
    """``cache``: a vision model's embedding cache bound (None: no tower); ``torch_path``:
    why the cuda backend's pools run the torch path ("": FlashInfer's)."""
    fitted: dict[str, int] = {}
    monkeypatch.setattr(pool_probe, "encoder_peak", lambda runner: encoder)
    monkeypatch.setattr(memory_plan, "fit_blocks", lambda **kw: fitted.update(kw) or 1000)
    runner = SimpleNamespace(
        # every measured step (the probe's forwards and the sampling after a decode) peaks at
        # 100 MiB here; the decode's logits [rows, 8] fp32 stay held while it samples
        meter=SimpleNamespace(peak_bytes=lambda step: (step(), 100 * MIB)[1],
                              free_bytes=lambda: (40 * 2**30, 80 * 2**30)),
        tp_rank=0, tp_size=1, block_size=16, max_num_seqs=max(graphs, default=8), max_batched_tokens=512, spec_k=0,
        kv_bytes_per_block=2 * MIB, extra_bytes_per_block=0, num_state_slots=0,
        device=torch.device("cpu"), config=SimpleNamespace(hidden_size=8), dtype=torch.float32,
        _reset_own_kv=lambda blocks, kv_dtype: None,
        _allocate_kv=lambda *a: None, execute=lambda seqs: torch.zeros(len(seqs), 8),
        backend=SimpleNamespace(executor=SimpleNamespace(graph_sizes=lambda: graphs),
                                attention=SimpleNamespace(torch_path=torch_path)),
        vision=None if cache is None else SimpleNamespace(max_cached_bytes=cache))
    assert pool_probe.measured_blocks(runner, 5000, "auto", 2048) == 1000
    return fitted


def test_the_measured_pool_leaves_room_for_the_graphs_attention_buffers(monkeypatch):
    """Graphs are captured after the pool is sized: each b-row graph's FlashInfer wrapper
    holds an 8 MiB int workspace, and their one page-index buffer takes 4 B a block for
    each of max_slots rows. The measurement counts both (without graphs, neither)."""
    def step(rows: int) -> int:  # the worst step: a decode's sampling, its logits held
        return 100 * MIB + rows * 8 * 4

    plain = _measure(monkeypatch, [])
    assert (plain["step_peak"], plain["bytes_per_block"]) == (step(8), 2 * MIB)
    graphs = _measure(monkeypatch, [16, 8, 4, 2, 1])
    # the decode step's peak too (graphs hold a pool apart), then the five wrappers
    assert graphs["step_peak"] == step(16) + 100 * MIB + 5 * FI_WRAPPER_INT_BYTES
    assert graphs["bytes_per_block"] == 2 * MIB + 4 * 16
    # a quantised pool's graphs (the torch path's Triton kernels) hold no FlashInfer
    # wrapper; their one page table takes the same 4 B a block for each row
    quantised = _measure(monkeypatch, [16, 8, 4, 2, 1], torch_path="quantised KV")
    assert (quantised["step_peak"], quantised["bytes_per_block"]) == (
        step(16) + 100 * MIB, 2 * MIB + 4 * 16)
    # a vision tower whose largest image peaks above the text steps: the larger counts
    assert _measure(monkeypatch, [], encoder=300 * MIB)["step_peak"] == 300 * MIB
    assert _measure(monkeypatch, [], encoder=30 * MIB)["step_peak"] == step(8)
    # its embedding cache stays beside whichever peaks
    assert _measure(monkeypatch, [], encoder=300 * MIB, cache=40 * MIB)["step_peak"] == \
        340 * MIB
    assert _measure(monkeypatch, [], encoder=30 * MIB, cache=40 * MIB)["step_peak"] == \
        step(8) + 40 * MIB
    # the graphs' pool and wrappers are held while an image step runs (eagerly): beside the
    # tower's peak, not inside it
    assert _measure(monkeypatch, [2, 1], encoder=300 * MIB, cache=40 * MIB)["step_peak"] == \
        300 * MIB + 100 * MIB + 2 * FI_WRAPPER_INT_BYTES + 40 * MIB


def test_a_vision_models_measured_step_peak_is_at_least_its_towers(tiny_checkpoint):
    """The probe's steps are text: a model with a vision tower counts the tower's
    activations over its largest image too, the figure helexa plan reserves (its step peaks
    at the larger of the two); a text model counts none."""
    import json

    from helexa.checkpoint.vision_shape import max_image_patches, read_vision_shape
    from helexa.neuron.engine.model_runner import ModelRunner

    path = tiny_checkpoint("qwen3_5", vision=True)
    runner = ModelRunner(path, num_blocks=16, block_size=4, max_num_seqs=2,
                         max_batched_tokens=64, num_state_slots=2)
    shape = read_vision_shape(json.loads((path / "config.json").read_text()))
    assert shape is not None and runner.vision.takes_images
    want = shape.encoder_activation_bytes(max_image_patches(path, shape), 1, 4)  # fp32
    assert pool_probe.encoder_peak(runner) == want > 0
    text = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16, block_size=4, max_num_seqs=2,
                       max_batched_tokens=64)
    assert pool_probe.encoder_peak(text) == 0


def test_the_probe_runs_each_worst_step_shape_on_a_real_runner(tiny_checkpoint):
    """The probe's steps (pool_probe.probe_steps) are real steps a runner takes on its probe
    pool: one long prefill beside decode rows, two prefills (a hybrid's varlen path), one
    of at most SYNC_FREE_MAX_ROWS tokens (a MoE block's masked form); each of the step's
    tokens, its blocks inside the probe pool and no two sequences sharing a block; and
    sampling a decode step's logits as a request asking for everything would."""
    from helexa.kernels.moe_experts import SYNC_FREE_MAX_ROWS
    from helexa.neuron.engine.model_runner import ModelRunner

    bs, rows, prefill = 4, 3, 300
    pool = -(-prefill // bs) + rows + 1  # measured_blocks' probe pool
    steps = pool_probe.probe_steps(prefill, rows, bs, slots=3)
    assert [sum(len(s.token_ids) for s in step) for step in steps] == [
        prefill + rows - 1, prefill + rows - 2, SYNC_FREE_MAX_ROWS]
    assert [sum(s.num_computed == 0 and len(s.token_ids) > 1 for s in step)
            for step in steps] == [1, 2, 1]
    for step in steps:
        blocks = [b for s in step for b in s.block_table]
        assert len(blocks) == len(set(blocks)) and max(blocks) < pool
    runner = ModelRunner(tiny_checkpoint("qwen3_5"), num_blocks=pool, block_size=bs,
                         max_num_seqs=rows, max_batched_tokens=prefill + rows - 1,
                         num_state_slots=3)
    for step in steps:
        logits = runner.execute(step)
        assert logits.shape[0] == len(step)  # every sequence's last token
    # sampling runs on the decode step's real logits (its CUDA peak stood in: nothing
    # beyond them), every row top-k, top-p, min-p, penalties and 20 logprobs
    runner.meter = SimpleNamespace(peak_bytes=lambda step: (step(), 0)[1])
    decode = [pool_probe.SeqInput([0], 0, [pool - 1 - i], True, i) for i in range(rows)]
    assert pool_probe.decode_peaks(runner, decode) == (0, rows * runner.vocab_size * 4)


def test_a_speculating_models_probe_verifies_drafts_on_every_row(tiny_checkpoint):
    """Where a model may speculate (spec_k: the most of any speculation it runs), the probe
    runs a verification step too: every decode row scoring spec_k drafts after its last
    token (spec_k + 1 logits a row, on blocks of its own), and verifying sampled drafts
    beside the drafter's distributions; what the step holds at its peak counts its logits
    and those distributions, well over a decode step's."""
    from helexa.neuron.engine.model_runner import ModelRunner

    bs, rows, k = 4, 3, 6
    runner = ModelRunner(tiny_checkpoint("qwen3_5"), num_blocks=64, block_size=bs,
                         max_num_seqs=rows, max_batched_tokens=32, num_state_slots=rows,
                         spec_k=k)
    assert pool_probe.probe_blocks(runner) == -(-(32 - 2) // bs) + rows * 2 + 1  # 8 tokens a row
    decode, verify = pool_probe.probe_rows(runner, 10, rows, slots=rows)
    assert [(s.token_ids, s.num_computed, s.block_table) for s in decode] == [
        ([0], 0, [10]), ([0], 0, [12]), ([0], 0, [14])]
    assert [(len(s.token_ids), s.num_computed, s.num_logits, s.block_table) for s in verify] == [
        (k + 1, 1, k + 1, [10, 11]), (k + 1, 1, k + 1, [12, 13]), (k + 1, 1, k + 1, [14, 15])]
    steps: list[int] = []
    runner.meter = SimpleNamespace(peak_bytes=lambda step: (steps.append(1), step(), 0)[2])
    logit = runner.vocab_size * 4
    assert pool_probe.decode_peaks(runner, decode, verify) == (
        0, rows * (k + 1) * logit + rows * k * logit)  # its logits and the drafter's q
    assert len(steps) == 4  # decode, its sampling, the verification, its checking
    assert pool_probe.probe_rows(ModelRunner(tiny_checkpoint("qwen3"), num_blocks=16,
                                             block_size=bs, max_num_seqs=2,
                                             max_batched_tokens=32), 0, 2, 1)[1] == []


def _rank(rank: int, free: int, events: list[str], fail: str = "") -> SimpleNamespace:
    """A stand-in rank of a tp = 2 model: its steps, and what its executor was told, in
    ``events``; its meter reads ``free`` bytes and peaks at 1 MiB a step (``fail``: its
    first step raises that instead)."""
    def peak_bytes(step):
        if fail:
            raise RuntimeError(fail)
        step()
        return MIB

    def execute(seqs):
        events.append("step")
        return torch.zeros(len(seqs), 8)

    return SimpleNamespace(
        meter=SimpleNamespace(peak_bytes=peak_bytes, free_bytes=lambda: (free, 80 * 2**30)),
        tp_rank=rank, tp_size=2, block_size=16, max_num_seqs=4, max_batched_tokens=512, spec_k=0,
        kv_bytes_per_block=MIB, extra_bytes_per_block=0, num_state_slots=0,
        config=SimpleNamespace(hidden_size=8), dtype=torch.float32,
        _reset_own_kv=lambda blocks, kv_dtype: None, _allocate_kv=lambda *a: None,
        execute=execute, _device_tokens=lambda tokens: events.append("broadcast"),
        backend=SimpleNamespace(executor=SimpleNamespace(graph_sizes=lambda: []),
            attention=SimpleNamespace(torch_path="")), vision=None)


def test_a_worker_rank_measures_its_own_card_and_says_why_it_cannot():
    """A worker rank's TpMeasure (pool_probe.measure_as_rank): it runs the probe steps
    of its own (eagerly, as rank 0 runs them: no capture step among them) and the lookahead's
    broadcast as rank 0 does, and samples nothing (only rank 0 samples): its peak is its
    forward's. A fit that fails is its answer and the group is in step; a step that fails
    is an answer that says the group is not."""
    from helexa.neuron.engine.tp_messages import TpMeasure

    margin = max(memory_plan.MARGIN_MIN_BYTES, int(memory_plan.MARGIN_FRACTION * 80 * 2**30))
    events: list[str] = []
    worker = _rank(1, margin + MIB + 300 * MIB, events)
    assert pool_probe.measure_as_rank(worker, TpMeasure(5000, "auto", 2048, 3)) == \
        pool_probe.TpMeasured(300)  # its forward's 1 MiB peak alone beside the pool
    assert events == ["step", "step", "step", "step", "broadcast"]
    assert worker.num_state_slots == 3  # a switch's slots, carved for its probe as rank 0's
    leader = _rank(0, margin + MIB + 300 * MIB, [])
    assert pool_probe.measured_blocks(leader, 5000, "auto", 2048) < 300  # it samples
    short = pool_probe.measure_as_rank(_rank(1, margin + MIB + 100 * MIB, []),
                                       TpMeasure(5000, "auto", 2048))
    assert not short.broken and short.error.startswith("KV pool does not fit: ")
    assert "= 100 blocks of 1,048,576 B, but one request of the configured context (2048 " \
           "tokens) needs 128 blocks" in short.error
    oom = pool_probe.measure_as_rank(_rank(1, 0, [], fail="CUDA out of memory"),
                                     TpMeasure(5000, "auto", 2048))
    assert oom == pool_probe.TpMeasured(error="RuntimeError: CUDA out of memory", broken=True)


def test_the_meter_is_chosen_by_device_and_reads_cudas_allocator(monkeypatch):
    """device_memory: CUDA's meter (its calls stood in here) reads a step's peak above what
    was allocated before it and the free memory once the cached blocks are released; a CPU
    has no meter, so its pool is the plan's."""
    from helexa.neuron.engine import device_memory

    calls: list[str] = []
    allocated = {"now": 300, "peak": 0}

    def step() -> None:
        calls.append("step")
        allocated["peak"] = 1000

    for name, fn in {
        "synchronize": lambda device: calls.append("sync"),
        "memory_allocated": lambda device: allocated["now"],
        "reset_peak_memory_stats": lambda device: allocated.update(peak=allocated["now"]),
        "max_memory_allocated": lambda device: allocated["peak"],
        "empty_cache": lambda: calls.append("empty"),
        "mem_get_info": lambda device: (calls.append("info"), (5, 9))[1],
    }.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    assert device_memory.device_meter(torch.device("cpu")) is None
    meter = device_memory.device_meter(torch.device("cuda", 1), 1)
    assert isinstance(meter, device_memory.CudaMeter) and meter.device == torch.device("cuda", 1)
    assert meter.peak_bytes(step) == 700 and calls == ["sync", "step", "sync"]
    assert meter.free_bytes() == (5, 9) and calls[3:] == ["sync", "empty", "info"]


def test_the_prompt_logprobs_rows_a_step_are_what_the_measured_room_holds():
    """The room the probe leaves a step's scored prompt rows (its prefill step's peak less
    the stream its layers pass on and the sampled rows' peak) holds rows of 14 B a logit
    beside the scoring's 128-row pieces (12 B a logit); never fewer than 4 rows a slot."""
    from helexa.neuron.engine.prompt_logprobs import allowance

    runner = SimpleNamespace(max_batched_tokens=512, config=SimpleNamespace(hidden_size=8),
                             dtype=torch.float32, vocab_size=1000)
    runner.scoring_room = pool_probe.scoring_room(runner, 100 * MIB, 10 * MIB)
    assert runner.scoring_room == 90 * MIB - 512 * 3 * 8 * 4
    assert allowance(runner, 8) == (runner.scoring_room - 128 * 1000 * 12) // (1000 * 14)
    runner.scoring_room = pool_probe.scoring_room(runner, 10 * MIB, 10 * MIB)
    assert runner.scoring_room == 0 and allowance(runner, 8) == 32
