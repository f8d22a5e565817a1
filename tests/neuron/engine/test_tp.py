"""Tensor parallelism on CPU over gloo, as real processes: TP=2 decodes as TP=1 does."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.greedy import greedy_generate

from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
from helexa.neuron.engine.tp_messages import TpError

NEAR_TIE = 0.02
# bench/gpu_tp.sh runs the equivalence test on GPUs: HELEXA_TEST_DEVICE=cuda (NCCL).
DEVICE = os.environ.get("HELEXA_TEST_DEVICE", "cpu")


def runner(model_dir: Path, tp: int) -> ModelRunner:
    devices = [DEVICE] * tp if DEVICE == "cpu" else [f"cuda:{i}" for i in range(tp)]
    return ModelRunner(model_dir, num_blocks=96, block_size=8, max_num_seqs=4,
                       max_batched_tokens=256, tp_size=tp, device=devices[0], devices=devices)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (21, 9, 14)]


def gone(pid: int) -> bool:
    """Dead or a zombie (reaped later by whoever inherits it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int, secs: float = 10.0) -> bool:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(("arch", "kv_heads"), [("qwen3", 2), ("qwen2", 2), ("llama", 1)])
def test_tp2_greedy_matches_tp1(tiny_checkpoint, arch, kv_heads):
    # llama with one kv head: tp > kv heads, so both ranks hold the head (replicated).
    model_dir = tiny_checkpoint(arch, num_kv_heads=kv_heads)
    one = runner(model_dir, 1)
    margins: list[list[float]] = []
    ref = greedy_generate(one, prompts(), 24, margins=margins)
    two = runner(model_dir, 2)
    try:
        assert two.kv_bytes_per_block * 2 == one.kv_bytes_per_block * (2 if kv_heads == 1 else 1)
        got = greedy_generate(two, prompts(), 24, prefill_chunk=8)
    finally:
        two.close()
    for r, g, m in zip(ref, got, margins, strict=True):
        tie = next((i for i, gap in enumerate(m) if gap < NEAR_TIE), len(m))
        assert g[:tie] == r[:tie]


def test_killed_rank_fails_cleanly_then_reload_works(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    two = runner(model_dir, 2)
    [pid] = two.tp_pids
    step = [SeqInput(prompts()[0], 0, [0, 1, 2], True)]
    two.execute(step)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid)
    with pytest.raises(TpError, match="rank 1"):
        two.execute([SeqInput([5], 21, [0, 1, 2], True)])
    with pytest.raises(TpError):  # stays failed: the engine must restart the model
        two.execute(step)
    assert "rank 1" in two.failed
    two.close()
    again = runner(model_dir, 2)
    try:
        torch.testing.assert_close(again.execute(step), runner(model_dir, 1).execute(step),
                                   atol=1e-4, rtol=1e-4)
    finally:
        again.close()
    assert all(wait_gone(p) for p in again.tp_pids)


def test_tp2_lookahead_feeds_rank_0s_device_tokens_to_every_rank(tiny_checkpoint, monkeypatch):
    """A lookahead step at tp = 2 (engine/lookahead.py): the other rank gets rank 0's
    sampled tokens as a broadcast, so the engine streams what it streams without it. A
    request without max_tokens grows past kv.default_output_tokens to the context: rank 0
    alone holds budgets and reservations, the other rank sees block tables."""
    from support.engine import assert_whole, drive

    from helexa.neuron.engine import lookahead
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    two = runner(tiny_checkpoint("qwen3"), 2)
    assert two._tp is not None
    sent, real_send = [], two._tp.send_step

    def send_step(seqs, device_tokens=False, graph=""):
        sent.append(device_tokens)
        real_send(seqs, device_tokens, graph)

    two._tp.send_step = send_step
    runs = {}
    try:
        for on in (False, True):
            monkeypatch.setenv(lookahead.ENV, "1" if on else "0")
            spec = EngineSpec(model_id="tp", num_blocks=96, block_size=8, context=64,
                              prefix_cache=False,
                              limits=m.Limits(anon_max_in_flight=8, default_output_tokens=8))
            core = EngineCore(spec, two)
            news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=p, max_tokens=12 + 2 * i,
                                 sampling=m.SamplingParams(temperature=0.0))
                    for i, p in enumerate(prompts())]
            news.append(m.NewRequest(req_id="grows", prompt_token_ids=prompts()[1],
                                     sampling=m.SamplingParams(temperature=0.0)))
            sent.clear()
            runs[on] = drive(core, news, served=True).tokens
            assert_whole(core)
            assert len(runs[on]["grows"]) == 64 - len(prompts()[1])
            assert sum(sent) >= 10 if on else sum(sent) == 0  # steps sent as lookahead
    finally:
        two.close()
    assert runs[True] == runs[False]


def test_tp2_prompt_logprobs_are_tp1s(tiny_checkpoint):
    """Prompt logprobs at tp = 2 (every rank runs the chunks whose every row wants logits;
    rank 0 gathers them and scores): tp = 1's, chunk by chunk."""
    from support.engine import assert_whole, drive

    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    scored: dict[int, list] = {}
    for tp in (1, 2):
        r = runner(tiny_checkpoint("qwen3"), tp)
        try:
            spec = EngineSpec(model_id="tp", num_blocks=96, block_size=8, context=64,
                              limits=m.Limits(anon_max_in_flight=8, prefill_chunk_tokens=6))
            core = EngineCore(spec, r)
            got = scored[tp] = []
            drive(core, [m.NewRequest(
                req_id="s", prompt_token_ids=prompts()[0], max_tokens=0,
                sampling=m.SamplingParams(temperature=0.0, prompt_logprobs=2))],
                served=True, on_update=lambda u, got=got: got.extend(u.prompt_logprobs or ()))
            assert_whole(core)
        finally:
            r.close()
    assert len(scored[2]) == len(prompts()[0]) - 1
    assert [[t.token_id for t in e.top] for e in scored[2]] == \
        [[t.token_id for t in e.top] for e in scored[1]]
    torch.testing.assert_close(torch.tensor([e.logprob for e in scored[2]]),
                               torch.tensor([e.logprob for e in scored[1]]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("measured", [False, True])
def test_tp2_state_slots_carved_anew_on_every_rank(tiny_checkpoint, measured):
    """A hybrid's pool re-planned with more state slots (a profile allowing more in flight)
    at tp = 2: every rank carves them, so three sequences at once (slots 0-2, where the
    load had one) decode as at tp = 1; ``measured`` (as on CUDA) every rank's probe runs
    the hybrid's steps, its linear-attention states beside the probe pool, at load and at
    the switch (room for the plan's 96 blocks on both ranks), a verification step of two
    drafts a row among them (every rank runs it: its collectives)."""
    from support.pool_meter import ScriptedMeters

    model_dir = tiny_checkpoint("qwen3_5")
    meter = ScriptedMeters({0: [2**40], 1: [2**40]}) if measured else None

    def hybrid(tp: int, slots: int) -> ModelRunner:
        devices = [DEVICE] * tp if DEVICE == "cpu" else [f"cuda:{i}" for i in range(tp)]
        return ModelRunner(model_dir, num_blocks=96, block_size=8, max_num_seqs=4,
                           max_batched_tokens=256, tp_size=tp, device=devices[0],
                           devices=devices, num_state_slots=slots,
                           memory_meter=meter if tp > 1 else None, spec_k=2 * measured)

    one = hybrid(1, 3)
    margins: list[list[float]] = []
    ref = greedy_generate(one, prompts(), 12, margins=margins)
    two = hybrid(2, 1)
    try:
        two.reset_kv(96, two.kv_dtype, 64, num_state_slots=3)
        assert (two.num_state_slots, two.num_blocks) == (3, 96)
        got = greedy_generate(two, prompts(), 12)
    finally:
        two.close()
    for r, g, m in zip(ref, got, margins, strict=True):
        tie = next((i for i, gap in enumerate(m) if gap < NEAR_TIE), len(m))
        assert g[:tie] == r[:tie]


def _measured(model_dir: Path, script, **kw) -> ModelRunner:
    """A tp = 2 runner whose pool every rank measures through ``script``'s readings
    (support/pool_meter.py: the CUDA meter's part, on CPU), as on CUDA."""
    return ModelRunner(model_dir, num_blocks=96, block_size=8, max_num_seqs=4,
                       max_batched_tokens=256, tp_size=2, memory_meter=script, context=64,
                       **kw)


def _free_for(one: ModelRunner, rank: int, blocks: int, peak: int, rows: int = 4) -> int:
    """The free bytes a rank must read for ``blocks`` blocks to fit (memory_plan.fit_blocks:
    beside its step's peak and the 256 MiB margin of a 1000 MiB card), at tp = 2: rank 0's
    peak holds the max_num_seqs decode rows' logits it samples, the other ranks' do not."""
    from helexa.neuron.engine.memory_plan import MARGIN_MIN_BYTES

    sampled = rows * one.vocab_size * 4 if rank == 0 else 0  # the rows' fp32 logits
    return MARGIN_MIN_BYTES + peak + sampled + blocks * (one.kv_bytes_per_block // 2) + 7


def test_tp2_every_rank_measures_and_the_pool_is_the_least_fit(tiny_checkpoint, monkeypatch,
                                                               capfd):
    """On CUDA each rank measures its own card, in lockstep, and every rank takes the fewest
    blocks any rank holds: at load (rank 1 the least), at a kv_dtype switch to a wider
    batch (rank 0 the least; every rank measures and runs at rank 0's width), and a
    switch that a rank cannot fit restores the old pool and width on every rank. The
    steps after decode what tp = 1 decodes, over every block of the pool."""
    from support.pool_meter import ScriptedMeters

    from helexa.neuron.engine.memory_plan import KvPlanError
    from helexa.neuron.engine.tp_worker import TpWorkers

    model_dir = tiny_checkpoint("qwen3")
    one = runner(model_dir, 1)
    margins: list[list[float]] = []
    ref = greedy_generate(one, prompts(), 12, margins=margins)
    peak = 2**20
    # per rank, what its three measurements read: load, a switch, a switch rank 1 cannot fit
    free = {r: [_free_for(one, r, n, peak, rows) for n, rows in fits]
            for r, fits in ((0, ((70, 4), (40, 6), (60, 8))), (1, ((50, 4), (60, 6), (3, 8))))}
    sent: list[int] = []  # the pool rank 0 sends the other rank (TpResetKv)
    widths: list[tuple[int, ...]] = []  # and the width it runs at (rows, step tokens)
    real_reset = TpWorkers.reset_kv
    monkeypatch.setattr(TpWorkers, "reset_kv", lambda self, n, *a: (
        sent.append(n), widths.append(a[2:]), real_reset(self, n, *a)))
    two = _measured(model_dir, ScriptedMeters(free, peak=peak))
    tail = [SeqInput(prompts()[0], 0, [93, 94, 95], True)]  # the last blocks of the plan's 96

    def decodes_as_tp1(blocks: int) -> None:
        got = greedy_generate(two, prompts(), 12, shuffle_seed=blocks)
        for r, g, m in zip(ref, got, margins, strict=True):
            tie = next((i for i, gap in enumerate(m) if gap < NEAR_TIE), len(m))
            assert g[:tie] == r[:tie]
        last = [SeqInput(prompts()[0], 0, [blocks - 3, blocks - 2, blocks - 1], True)]
        torch.testing.assert_close(two.execute(last), one.execute(tail), atol=1e-4, rtol=1e-4)

    try:
        assert (two.num_blocks, sent) == (50, [50])
        decodes_as_tp1(50)
        two.reset_kv(96, "fp32", 64, max_num_seqs=6, max_batched_tokens=512)
        assert (two.num_blocks, sent[1:], widths[1:]) == (40, [40], [(6, 512)])
        decodes_as_tp1(40)
        with pytest.raises(KvPlanError, match=r"^tensor-parallel rank 1: KV pool does not fit: "
                                              r".* = 3 blocks of .* \(64 tokens\) needs 8 blocks"):
            two.reset_kv(96, "auto", 64, max_num_seqs=8, max_batched_tokens=1024)
        assert (two.num_blocks, two.kv_dtype, sent[2:]) == (40, "fp32", [40])  # the old pool
        assert (two.max_num_seqs, two.max_batched_tokens, widths[2:]) == (6, 512, [(6, 512)])
        decodes_as_tp1(40)
    finally:
        two.close()
    # each rank logs its own measurement (rank 1's JSON lines, from its process)
    lines = [json.loads(x) for x in capfd.readouterr().err.splitlines()
             if '"engine.kv_pool_measured"' in x]
    assert [x["blocks"] for x in lines if x["tp_rank"] == 1] == [50, 60]


@pytest.mark.parametrize("fails", ["fit", "step", "step-late"])
def test_tp2_a_rank_that_cannot_measure_fails_the_load_naming_it(tiny_checkpoint, fails):
    """A rank whose pool does not fit one request of the context fails the load with its
    arithmetic; one whose probe step fails (out of memory) takes the group down with its
    message, the other rank's collective failing at once; and where rank 0 meets the loss
    only once that rank has gone (``step-late``: on NCCL a collective waits on a lost peer
    until the health check finds it dead), the load still says why it left. No rank hangs
    or outlives it."""
    import multiprocessing

    from support.pool_meter import ScriptedMeters

    from helexa.neuron.engine.memory_plan import KvPlanError
    from helexa.neuron.engine.tp_messages import DEFAULT_TIMEOUT_SECS

    model_dir = tiny_checkpoint("qwen3")
    one = runner(model_dir, 1)
    free = {0: [_free_for(one, 0, 70, 2**20)], 1: [_free_for(one, 1, 5, 2**20)]}
    oom = {1: "CUDA out of memory (scripted)"} if fails.startswith("step") else {}
    start = time.monotonic()
    if fails == "fit":
        with pytest.raises(KvPlanError, match=r"^tensor-parallel rank 1: KV pool does not fit: "
                                              r".* = 5 blocks of .* needs 8 blocks"):
            _measured(model_dir, ScriptedMeters(free, fail_step=oom))
    elif fails == "step":
        with pytest.raises(TpError, match=r"(?s)^measuring the KV pool failed on tensor-parallel "
                                          r"rank 0: .*; rank 1: RuntimeError: CUDA out of "
                                          r"memory \(scripted\)$"):
            _measured(model_dir, ScriptedMeters(free, fail_step=oom))
    else:
        with pytest.raises(TpError, match=r"^tensor-parallel rank 1 failed measuring its KV pool "
                                          r"and left the group: RuntimeError: CUDA out of "
                                          r"memory \(scripted\)$"):
            _measured(model_dir, ScriptedMeters(free, fail_step=oom, late={0: 3.0}))
    # not a collective's timeout: the group's bound (20 s) was not waited out; the messages
    # above say which rank failed and why (a 15 s bound failed at 16 s on a loaded machine)
    assert time.monotonic() - start < DEFAULT_TIMEOUT_SECS
    assert not multiprocessing.active_children()
