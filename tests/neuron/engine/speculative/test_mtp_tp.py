"""The MTP head at tensor parallel 2, on CPU over gloo as real rank processes: the head's
passes equal tensor parallel 1's, and speculation with it (speculation = "mtp") leaves
greedy output unchanged alone and in a batch of 8 with chunked prefill, gets a right
head's drafts accepted, and leaves the ledger whole (the tensor-parallel-1 versions:
test_mtp_drafter.py)."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch
from support.engine import assert_whole, drive
from support.mtp import SPEC, assert_right_head_drafted, craft_right_mtp_head, requests, spec_for

from helexa.checkpoint.memory import kv_bytes_per_token
from helexa.checkpoint.shape import read_model_shape
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
from helexa.neuron.engine.spec import EngineSpec

# fp32; tp = 2 sums the fc's, o_proj's and down_proj's halves in another order (one
# all-reduce each), so the last bits differ: ~6e-6 seen on logits of magnitude ~17.
TOL = dict(atol=1e-4, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")

def at_tp(spec: EngineSpec, tp: int) -> EngineSpec:
    return msgspec.structs.replace(spec, tp=tp)


def head_passes(model_dir: Path, tp: int) -> list[torch.Tensor]:
    """Logits and outputs of the head over one sequence in chunks then decode rows (a
    shuffled table), a batched pass of two sequences, and the lm_head alone."""
    runner = ModelRunner(model_dir, num_blocks=64, block_size=4, max_num_seqs=4,
                         max_batched_tokens=256, dtype="float32", num_state_slots=4,
                         tp_size=tp)
    try:
        # each rank's pool shard holds the head's layer, as helexa plan counts per card
        shape = read_model_shape(model_dir / "config.json")
        assert runner.kv_bytes_per_block == 4 * kv_bytes_per_token(shape, tp, "fp32", 1)
        h = runner.model.cfg.hidden_size
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(3, 500, (23,), generator=g).tolist()
        hidden = torch.randn(23, h, generator=g)
        table = list(range(runner.num_blocks))
        random.Random(7).shuffle(table)
        got = []
        for start, end in [(0, 9), (9, 17), *((i, i + 1) for i in range(17, 23))]:
            logits, out = runner.execute_mtp(
                [SeqInput(tokens[start:end], start, table[:6], True, num_logits=end - start)],
                hidden[start:end])
            got += [logits, out]
        other = torch.randint(3, 500, (5,), generator=g).tolist()
        logits, out = runner.execute_mtp(
            [SeqInput(other, 0, table[6:8], True, num_logits=2),
             SeqInput(tokens[:1], 23, table[:6], False)],
            torch.randn(6, h, generator=g))
        got += [logits, out, runner.mtp_logits(out)]
        return got
    finally:
        runner.close()


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_the_heads_passes_at_tp2_equal_tp1(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, mtp=True)
    one, two = head_passes(model_dir, 1), head_passes(model_dir, 2)
    assert [t.shape for t in two] == [t.shape for t in one]
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("arch", ["qwen3_5", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_greedy_output_at_tp2_identical_alone_and_in_a_batch_of_8(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch, mtp=True)
    news = requests(2, 8)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    core = EngineCore(at_tp(spec_for(model_dir, speculation="mtp", **SPEC), 2))
    try:
        assert core.runner.tp_size == 2 and core.status().drafter == "mtp"
        got = drive(core, news[:1], served=True).tokens
        assert got == {"r0": want["r0"]}
        assert_whole(core)
        # all 8 at once: prefill in chunks of 6 beside the others' verification rows
        got = drive(core, news, served=True).tokens
        assert got == want
        assert core.status().spec_drafted_tokens > 0
        assert not core.speculator.drafter.follows
        assert_whole(core)
    finally:
        core.close()


def test_a_right_head_has_its_drafts_accepted_at_tp2(tiny_checkpoint, tmp_path):
    model_dir = craft_right_mtp_head(tiny_checkpoint("qwen3_5", mtp=True), tmp_path / "crafted")
    news = requests(1, 3)
    plain = drive(EngineCore(spec_for(model_dir)), news, served=True)
    core = EngineCore(at_tp(spec_for(model_dir, speculation="mtp", **SPEC), 2))
    try:
        assert_right_head_drafted(core, news, plain.tokens, plain.steps)
    finally:
        core.close()


def test_mtp_under_a_full_batch_chains_lookahead_steps_at_tp2(tiny_checkpoint, monkeypatch):
    """A full batch drafts only probes: the steps between run as a lookahead chain at tp = 2
    (rank 0's device tokens broadcast, its hidden states kept for the head), and greedy
    output is still plain decoding's."""
    from helexa.neuron.engine import lookahead

    model_dir = tiny_checkpoint("qwen3_5", mtp=True)
    news = requests(3, 4)
    want = drive(EngineCore(spec_for(model_dir)), news, served=True).tokens
    monkeypatch.setenv(lookahead.ENV, "1")
    full = dict(spec_k=2, spec_full_below=0.0, spec_off_above=0.0)
    core = EngineCore(at_tp(spec_for(model_dir, speculation="mtp", **full), 2))
    launched = []
    real = lookahead.launch
    monkeypatch.setattr(lookahead, "launch", lambda core, plan, inputs, tokens=None, **kw: (
        launched.append(tokens is not None), real(core, plan, inputs, tokens, **kw))[1])
    try:
        got = drive(core, news, served=True).tokens
        assert got == want
        assert core.status().spec_drafted_tokens > 0
        assert sum(launched) >= 10  # steps launched from the held step's device tokens
        assert_whole(core)
    finally:
        core.close()
