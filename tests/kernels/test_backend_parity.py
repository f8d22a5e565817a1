"""Every attention backend against the torch reference on the same steps: chunked prefill,
ragged decode batches whose rows come and go, block tables drawn from a shuffled pool, and
each KV dtype. Logits within tolerance, greedy choices equal (away from near-ties)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from helexa.kernels.backends import cuda
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

DEVICE = os.environ.get("HELEXA_TEST_DEVICE", "cpu")
BLOCK, POOL = 8, 128
# The backends compared with torch on this device.
OTHERS = ["cpu"] if DEVICE == "cpu" else (["cuda"] if cuda.available() else [])


def _runner(model_dir, backend: str, kv_dtype: str, monkeypatch, matmul: str) -> ModelRunner:
    with monkeypatch.context() as mp:
        mp.setenv("HELEXA_CPU_MATMUL", matmul)
        return ModelRunner(model_dir, device=DEVICE, num_blocks=POOL, block_size=BLOCK,
                           kv_dtype=kv_dtype, max_num_seqs=8, max_batched_tokens=256,
                           backend=backend)


def _script(seed: int):
    """Prompts and block tables drawn from a shuffled pool (no two share a block)."""
    rng = random.Random(seed)
    blocks = list(range(POOL))
    rng.shuffle(blocks)
    lens = [37, 5, 61, 12, 90]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lens]
    tables = []
    for n in lens:
        need = -(-(n + 24) // BLOCK)
        tables.append(blocks[:need])
        blocks = blocks[need:]
    return prompts, tables


def _drive(runner: ModelRunner, seed: int, chooser: list[list[int]] | None):
    """Prefill in 16-token chunks alongside decode rows, then ragged decode steps while rows
    leave. Next tokens come from ``chooser`` (the reference's choices) when given, so both
    runs see identical inputs; returns each step's logits and greedy choices."""
    prompts, tables = _script(seed)
    done = [0] * len(prompts)  # tokens of each sequence in the cache
    nxt: list[int | None] = [None] * len(prompts)
    out, picks = [], []
    step = 0
    while True:
        seqs, who = [], []
        for i, p in enumerate(prompts):
            if step >= 8 + 2 * i:  # rows leave one by one
                continue
            if done[i] < len(p):  # still prefilling: next chunk of up to 16
                chunk = p[done[i] : done[i] + 16]
                last = done[i] + len(chunk) == len(p)
                seqs.append(SeqInput(chunk, done[i], tables[i], last))
            else:
                seqs.append(SeqInput([nxt[i]], done[i], tables[i], True))
            who.append(i)
        if not seqs:
            return out, picks
        logits = runner.execute(seqs)
        out.append(logits)
        want = [i for s, i in zip(seqs, who, strict=True) if s.need_logits]
        choice = logits.argmax(-1).tolist() if chooser is None else chooser[len(picks)]
        picks.append(choice)
        for s, i in zip(seqs, who, strict=True):
            done[i] += len(s.token_ids)
        for r, i in enumerate(want):
            prompts[i] = prompts[i] + [choice[r]] if done[i] >= len(prompts[i]) else prompts[i]
            nxt[i] = choice[r]
        step += 1


@pytest.mark.skipif(not OTHERS, reason="no other backend on this device")
@pytest.mark.parametrize(("kv_dtype", "matmul"), [
    ("auto", "native"), ("auto", "measure"),  # the kernel choice matters for the matmuls
    ("bf16", "native"), ("fp8_e4m3", "native"), ("int8", "native"), ("int4", "native")])
@pytest.mark.parametrize("backend", OTHERS)
def test_backend_matches_torch(tiny_model_dir, monkeypatch, backend, kv_dtype, matmul):
    ref = _runner(tiny_model_dir, "torch", kv_dtype, monkeypatch, matmul)
    other = _runner(tiny_model_dir, backend, kv_dtype, monkeypatch, matmul)
    assert (ref.backend.name, other.backend.name) == ("torch", backend)
    ref_logits, ref_picks = _drive(ref, 3, None)
    got_logits, got_picks = _drive(other, 3, ref_picks)
    assert len(got_logits) == len(ref_logits) > 10
    tol = 1e-4 if kv_dtype == "auto" else 2e-3  # quantised KV: the pools round alike
    for step, (a, b) in enumerate(zip(got_logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"step {step}")
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 10 * tol
        assert (a.argmax(-1) == b.argmax(-1))[clear].all(), f"greedy differs at step {step}"
    for pa, pb in zip(other.kv_pools, ref.kv_pools, strict=True):  # the same KV written
        ka = pa.k_heads if not pa.quantized else pa.k_data
        kb = pb.k_heads if not pb.quantized else pb.k_data
        if ka.dtype.is_floating_point:
            torch.testing.assert_close(ka.float(), kb.float(), rtol=tol, atol=tol)
