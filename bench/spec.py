"""Speculative decoding benchmark: n-gram prompt lookup against no speculation, and the
adaptive policy against fixed k at 8 streams, measured side by side in one run.

    .venv/bin/python bench/spec.py [--repeats 3] [--tokens 96] [--threads 1] [--model DIR]

--model may name a hybrid checkpoint (Qwen3.5, Qwen3-Next): speculation on one
rolls its linear-attention state back past rejected drafts (docs/speculation.md).

The checkpoint is the benchmarks' init-tiny one (helexa.fixtures.tiny.bench_checkpoint,
~30M parameters) with every attention output projection zeroed: the compute of a
step is unchanged, but the next token becomes a function of the last one, so a
random-weight model can be made to rewrite a document (it has no other way to
copy text, and a random model's own text does not repeat its prompt).

- rewrite: greedy; the prompt is a ~300-token document made of the model's own
  greedy runs from a few starting tokens, and ends on one of those starting
  tokens, so the output repeats a stretch of the prompt, as a rewrite does;
- free chat: sampled (temperature 1, seeded) from a random prompt; the sampled
  text of a random model almost never repeats, so prompt lookup is nearly always
  silent or wrong: this shows what drafting and verification cost when they buy
  nothing.

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
import shutil
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


def copying_checkpoint(src: Path) -> Path:
    """`src` with the attention output projections zeroed, linear attention's too in a
    hybrid (made once, beside it)."""
    from safetensors.torch import load_file, save_file

    out = src.parent / (src.name + "-no-attn-out")
    if not (out / "model.safetensors").is_file():
        out.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, out / f.name)
        w = load_file(src / "model.safetensors")
        for k in w:
            if k.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight")):
                w[k] = torch.zeros_like(w[k])
        save_file(w, out / "model.safetensors")
    return out


def greedy_run(start: int, n: int, successor: dict[int, int]) -> list[int]:
    out = [start]
    while len(out) < n:
        out.append(successor[out[-1]])
    return out


def prompts(workload: str, rep: int, n: int, vocab: int,
            successor: dict[int, int]) -> list[list[int]]:
    rng = random.Random(1000 * rep + n)
    out = []
    for _ in range(n):
        if workload == "rewrite":  # the model's own runs from 5 starts, then a restart
            starts = [rng.randrange(vocab) for _ in range(5)]
            doc = [t for s in starts for t in greedy_run(s, 60, successor)]
            out.append(doc + [rng.choice(starts)])
        else:
            out.append([rng.randrange(vocab) for _ in range(64)])
    return out


def successor_table(core, vocab: int) -> dict[int, int]:
    """The model's greedy next token after each token, read off one forward (it depends on
    the last token only: see copying_checkpoint)."""
    runner = core.runner
    ids = list(range(vocab))
    from helexa.neuron.engine.model_runner import SeqInput

    nxt: dict[int, int] = {}
    for lo in range(0, vocab, 512):
        # one state slot for all (hybrids): linear attention's output is zeroed too
        seqs = [SeqInput([t], 0, [0], True, 0) for t in ids[lo:lo + 512]]
        nxt.update(zip(ids[lo:lo + 512], runner.execute(seqs).argmax(-1).tolist(), strict=True))
    return nxt


def run(core, runner, batch: list[list[int]], new_tokens: int, sampled: bool,
        seed: int) -> tuple[float, float]:
    """(decode tokens per CPU second once every stream has its first token, acceptance
    rate) for one batch run to the end. Prefill is the same work with or without
    speculation, so it is left out of the rate, as single-stream decode figures do."""
    from helexa.neuron.engine import messages as m

    params = (m.SamplingParams(temperature=1.0, seed=seed) if sampled
              else m.SamplingParams(temperature=0.0))
    news = [m.NewRequest(req_id=f"{seed}-{i}", prompt_token_ids=p, max_tokens=new_tokens,
                         sampling=params) for i, p in enumerate(batch)]
    before = core.status()
    firsts: set[str] = set()
    n = 0
    started = 0.0
    inbound = m.ToEngine(new=news)
    while True:
        out = core.step(inbound)
        inbound = None
        if len(firsts) < len(news):  # still prefilling: the decode clock has not started
            firsts.update(u.req_id for u in out.updates if u.new_token_ids)
            if len(firsts) == len(news):
                started = time.process_time()
        else:
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
    from helexa.fixtures.tiny import bench_checkpoint
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.engine.spec import EngineSpec

    model_dir = copying_checkpoint(args.model or bench_checkpoint())
    runner = ModelRunner(model_dir, num_blocks=320, block_size=16, max_num_seqs=8,
                         max_batched_tokens=1024, num_state_slots=16)  # hybrids: 1 a request
    cores = {}
    for kind, spec_limits in SPEC.items():
        limits = m.Limits(max_in_flight=16, anon_max_in_flight=16, max_slots=8,
                          max_batched_tokens=1024, prefill_chunk_tokens=512, **spec_limits)
        spec = EngineSpec(model_id="bench", model_dir=str(model_dir), num_blocks=320,
                          block_size=16, context=4096, prefix_cache=False, limits=limits)
        cores[kind] = EngineCore(spec, runner)
    successor = successor_table(cores["off"], runner.vocab_size)
    cases = [(w, n, kind) for w in ("rewrite", "chat") for n, kinds in
             ((1, ("off", "ngram")), (8, ("off", "adaptive", "fixed"))) for kind in kinds]
    rates: dict[str, list[float]] = {}
    acc: dict[str, list[float]] = {}
    for rep in range(args.repeats + 1):  # repeat 0 warms up (allocations, rotary tables)
        for w, n, kind in cases:
            batch = prompts(w, rep, n, runner.vocab_size, successor)
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
