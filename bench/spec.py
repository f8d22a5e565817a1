"""Speculative decoding benchmark: n-gram prompt lookup against no speculation, and the
adaptive policy against fixed k at 8 streams, measured side by side in one run.

    .venv/bin/python bench/spec.py [--repeats 3] [--tokens 96] [--threads 1] [--model DIR]

Workloads, on the benchmarks' init-tiny checkpoint (helexa.tiny.bench_checkpoint):
- rewrite: greedy, the prompt a ~300-token document; the output repeats much of
  what came before it (a random-weight model's greedy text falls into loops, so
  here the repetition is of its own output as much as of the prompt);
- free chat: sampled (temperature 1, seeded), a random prompt; a random model's
  sampled text almost never repeats, so prompt lookup is nearly always wrong or
  silent: this shows what drafting and verification cost when they buy nothing.

Rates are output tokens per second of this process's CPU time (torch on one
thread): on a shared machine wall time swings with the neighbours, CPU time far
less. Contenders share one ModelRunner (weights and KV pool) and run interleaved, each
once per repeat; each ratio is the median over repeats of that repeat's own ratio.
Figures come through EngineCore's step loop. Benchmarks print figures; they assert
nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

TARGETS = [  # (label, numerator, denominator, bound)
    ("rewrite, 1 stream: ngram vs off", "rewrite_1_ngram", "rewrite_1_off", 2.0),
    ("free chat, 1 stream: ngram vs off", "chat_1_ngram", "chat_1_off", 0.95),
    ("free chat, 8 streams: adaptive ngram vs off", "chat_8_adaptive", "chat_8_off", 0.95),
    ("rewrite, 8 streams: adaptive ngram vs off", "rewrite_8_adaptive", "rewrite_8_off", 0.95),
]
SHOWN = [("free chat, 8 streams: fixed-k ngram vs off", "chat_8_fixed", "chat_8_off"),
         ("rewrite, 8 streams: fixed-k ngram vs off", "rewrite_8_fixed", "rewrite_8_off")]

SPEC = {  # speculation limits per contender kind
    "off": dict(speculation="off"),
    "ngram": dict(speculation="ngram", spec_k=4),
    "adaptive": dict(speculation="ngram", spec_k=4),  # the config defaults' thresholds
    "fixed": dict(speculation="ngram", spec_k=4, spec_full_below=1.0, spec_off_above=1.01,
                  spec_min_acceptance=0.0),
}


def prompts(workload: str, rep: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1000 * rep + n)
    out = []
    for _ in range(n):
        if workload == "rewrite":  # a document of repeated sentences, then a restart of it
            sentences = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 20))]
                         for _ in range(6)]
            doc = [t for _ in range(3) for s in rng.sample(sentences, 6) for t in s]
            out.append(doc + sentences[0][:4])
        else:
            out.append([rng.randrange(vocab) for _ in range(64)])
    return out


def run(core, runner, batch: list[list[int]], new_tokens: int, sampled: bool,
        seed: int) -> tuple[float, float]:
    """(output tokens per second, acceptance rate) for one batch run to the end."""
    from helexa.neuron.engine import messages as m

    params = (m.SamplingParams(temperature=1.0, seed=seed) if sampled
              else m.SamplingParams(temperature=0.0))
    news = [m.NewRequest(req_id=f"{seed}-{i}", prompt_token_ids=p, max_tokens=new_tokens,
                         sampling=params) for i, p in enumerate(batch)]
    before = core.status()
    started = time.process_time()
    n = 0
    inbound = m.ToEngine(new=news)
    while True:
        out = core.step(inbound)
        inbound = None
        n += sum(len(u.new_token_ids) for u in out.updates)
        if not core.has_work:
            break
    secs = time.process_time() - started
    after = core.status()
    drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return n / secs, (accepted / drafted if drafted else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.engine.spec import EngineSpec, full_limits
    from helexa.tiny import bench_checkpoint

    model_dir = args.model or bench_checkpoint()
    runner = ModelRunner(model_dir, num_blocks=320, block_size=16, max_num_seqs=8,
                         max_batched_tokens=1024)
    cores = {}
    for kind, spec_limits in SPEC.items():
        limits = full_limits(m.SetLimits(max_in_flight=16, anon_max_in_flight=16, max_slots=8,
                                          max_batched_tokens=1024, prefill_chunk_tokens=512,
                                          **spec_limits))
        spec = EngineSpec(model_id="bench", model_dir=str(model_dir), num_blocks=320,
                          block_size=16, context=4096, prefix_cache=False, limits=limits)
        cores[kind] = EngineCore(spec, runner)
    cases = [(w, n, kind) for w in ("rewrite", "chat") for n, kinds in
             ((1, ("off", "ngram")), (8, ("off", "adaptive", "fixed"))) for kind in kinds]
    rates: dict[str, list[float]] = {}
    acc: dict[str, list[float]] = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms up (allocations, rotary tables)
        for w, n, kind in cases:
            batch = prompts(w, rep, n, runner.vocab_size)
            tps, a = run(cores[kind], runner, batch, args.tokens, w == "chat", seed=rep)
            if rep:
                rates.setdefault(f"{w}_{n}_{kind}", []).append(tps)
                acc.setdefault(f"{w}_{n}_{kind}", []).append(a)
    print(f"model {model_dir.name}, {args.tokens} tokens per stream, {args.repeats} repeats,"
          f" torch threads {args.threads}")
    for key in rates:
        print(f"  {key:22s} {statistics.median(rates[key]):8.1f} tok/s"
              f"   acceptance {statistics.median(acc[key]):.2f}")
    for label, num, den, bound in TARGETS:
        r = statistics.median(a / b for a, b in zip(rates[num], rates[den], strict=True))
        print(f"  {label:45s} {r:5.2f}x  (target >= {bound}x: {'met' if r >= bound else 'MISSED'})")
    for label, num, den in SHOWN:
        r = statistics.median(a / b for a, b in zip(rates[num], rates[den], strict=True))
        print(f"  {label:45s} {r:5.2f}x  (shown: what adapting saves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
