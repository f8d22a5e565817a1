"""A minimal greedy driver over a ModelRunner, for equivalence tests, benchmarks
and tensor-parallel checks — not the engine (that is neuron/engine/engine_core).

Each sequence gets its own blocks up front (optionally from a shuffled pool,
so paging is really exercised), and every step carries all unfinished
sequences at once: a prefill chunk for those with prompt left, one decode
token for the rest, as a continuous-batching engine would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from helexa.neuron.engine.model_runner import ModelRunner, SeqInput


def assign_blocks(lengths: Sequence[int], block_size: int, num_blocks: int,
                  shuffle_seed: int | None = None) -> list[list[int]]:
    """Block tables covering each length, drawn from 0..num_blocks-1 (shuffled if a seed is given)."""
    pool = list(range(num_blocks))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(pool)
    tables, at = [], 0
    for n in lengths:
        need = -(-n // block_size)
        if at + need > num_blocks:
            raise ValueError(f"{sum(lengths)} tokens do not fit {num_blocks} blocks of {block_size}")
        tables.append(pool[at : at + need])
        at += need
    return tables


def greedy_generate(runner: ModelRunner, prompts: Sequence[Sequence[int]],
                    max_new_tokens: int | Sequence[int], *, prefill_chunk: int | None = None,
                    shuffle_seed: int | None = None,
                    margins: list[list[float]] | None = None) -> list[list[int]]:
    """Greedy-decode every prompt together; returns each one's new tokens.

    With ``margins`` (a list to fill), also records per sequence and step the gap
    between the top two logits, so callers can tell a near-tie from a mismatch."""
    n = len(prompts)
    budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    tables = assign_blocks([len(p) + b for p, b in zip(prompts, budgets, strict=True)],
                           runner.block_size, runner.num_blocks, shuffle_seed)
    fed = [0] * n  # prompt tokens already sent
    outputs: list[list[int]] = [[] for _ in range(n)]
    if margins is not None:
        margins[:] = [[] for _ in range(n)]
    chunk = prefill_chunk or max(len(p) for p in prompts)
    while True:
        active = [i for i in range(n) if len(outputs[i]) < budgets[i]]
        if not active:
            return outputs
        step: list[SeqInput] = []
        for i in active:
            prompt = prompts[i]
            if fed[i] < len(prompt):
                toks = list(prompt[fed[i] : fed[i] + chunk])
                step.append(SeqInput(toks, fed[i], tables[i], fed[i] + len(toks) == len(prompt), i))
                fed[i] += len(toks)
            else:
                done = len(prompt) + len(outputs[i]) - 1
                step.append(SeqInput([outputs[i][-1]], done, tables[i], True, i))
        logits = runner.execute(step)
        picks = iter(logits.argmax(dim=-1).tolist())
        gaps = iter((lambda t: (t[:, 0] - t[:, 1]).tolist())(logits.topk(2).values)
                    if margins is not None else [])
        for i, s in zip(active, step, strict=True):
            if s.need_logits:
                outputs[i].append(next(picks))
                if margins is not None:
                    margins[i].append(next(gaps))
