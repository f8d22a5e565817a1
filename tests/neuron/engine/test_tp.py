"""Tensor parallelism on CPU over gloo, as real processes: TP=2 decodes as TP=1 does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def test_no_rank_outlives_its_engine_process(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3")
    code = (
        "import os, sys\n"
        "from helexa.neuron.engine.model_runner import ModelRunner\n"
        "if __name__ == '__main__':\n"
        f"    r = ModelRunner({str(model_dir)!r}, num_blocks=8, block_size=8, max_num_seqs=1,\n"
        "                    max_batched_tokens=64, tp_size=2)\n"
        "    print(r.tp_pids[0], flush=True)\n"
        "    os._exit(0)  # no cleanup at all, as if killed\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parents[3])
    assert out.returncode == 0, out.stderr
    assert wait_gone(int(out.stdout.split()[-1]))


def test_tp2_lookahead_feeds_rank_0s_device_tokens_to_every_rank(tiny_checkpoint, monkeypatch):
    """A lookahead step at tp = 2 (engine/lookahead.py): the other rank gets rank 0's
    sampled tokens as a broadcast, so the engine streams what it streams without it."""
    from support.engine import assert_whole, drive

    from helexa.neuron.engine import lookahead
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec

    two = runner(tiny_checkpoint("qwen3"), 2)
    assert two._tp is not None
    sent, real_send = [], two._tp.send_step

    def send_step(seqs, device_tokens=False):
        sent.append(device_tokens)
        real_send(seqs, device_tokens)

    two._tp.send_step = send_step
    runs = {}
    try:
        for on in (False, True):
            monkeypatch.setenv(lookahead.ENV, "1" if on else "0")
            spec = EngineSpec(model_id="tp", num_blocks=96, block_size=8, context=256,
                              prefix_cache=False, limits=m.Limits(anon_max_in_flight=8))
            core = EngineCore(spec, two)
            news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=p, max_tokens=12 + 2 * i,
                                 sampling=m.SamplingParams(temperature=0.0))
                    for i, p in enumerate(prompts())]
            sent.clear()
            runs[on] = drive(core, news, served=True).tokens
            assert_whole(core)
            assert sum(sent) >= 10 if on else sum(sent) == 0  # steps sent as lookahead
    finally:
        two.close()
    assert runs[True] == runs[False]


def test_tp2_state_slots_carved_anew_on_every_rank(tiny_checkpoint):
    """A hybrid's pool re-planned with more state slots (a profile allowing more in flight)
    at tp = 2: every rank carves them, so three sequences at once (slots 0-2, where the
    load had one) decode as at tp = 1."""
    model_dir = tiny_checkpoint("qwen3_5")

    def hybrid(tp: int, slots: int) -> ModelRunner:
        devices = [DEVICE] * tp if DEVICE == "cpu" else [f"cuda:{i}" for i in range(tp)]
        return ModelRunner(model_dir, num_blocks=96, block_size=8, max_num_seqs=4,
                           max_batched_tokens=256, tp_size=tp, device=devices[0],
                           devices=devices, num_state_slots=slots)

    one = hybrid(1, 3)
    margins: list[list[float]] = []
    ref = greedy_generate(one, prompts(), 12, margins=margins)
    two = hybrid(2, 1)
    try:
        two.reset_kv(96, two.kv_dtype, 0, num_state_slots=3)
        assert two.num_state_slots == 3
        got = greedy_generate(two, prompts(), 12)
    finally:
        two.close()
    for r, g, m in zip(ref, got, margins, strict=True):
        tie = next((i for i, gap in enumerate(m) if gap < NEAR_TIE), len(m))
        assert g[:tie] == r[:tie]
