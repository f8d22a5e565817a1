"""MTP speculation benchmark: the checkpoint's MTP head against no speculation, side by
side in one run, with a head that is right and with one that is wrong.

    .venv/bin/python bench/mtp.py [--repeats 2] [--tokens 64] [--threads 1]

The model is a tiny Qwen3.5 with an MTP head (init-tiny --mtp; hidden 256, 8 layers,
vocab 4096), in two variants sharing its shapes, so a step costs the same in both:

- right: every residual branch of the target and of the head writes zero, so the
  target's next token is a function of the current one and the head (fc passing the
  normed embedding through, the target's final norm) predicts exactly that function
  one token further: its drafts are all accepted, as an upper bound on what a head
  buys (a trained head is right 60-80% of the time);
- wrong: the random head of the same checkpoint, whose drafts are almost never
  accepted: this shows what the head costs when it buys nothing (its pass after every
  step keeps its KV current even when the policy stops drafting).

Contenders per variant: off, mtp with k fixed at 3 (drafts every step), mtp with the
adaptive policy (the config defaults), at 1 stream and at 8. Rates are decode tokens
per CPU second (bench/spec.py's `run`: prefill left out); each ratio is the median
over repeats of that repeat's own ratio. Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from spec import run  # bench/spec.py: one batch through EngineCore, CPU-timed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.mtp import craft_right_mtp_head  # noqa: E402  (the MTP tests' right head)

MODEL = dict(arch="qwen3_5", mtp=True, hidden_size=256, num_layers=8, num_heads=4,
             num_kv_heads=2, head_dim=64, intermediate_size=768, vocab_size=4096, seed=0)
SPEC = {"off": dict(speculation="off"),
        "fixed": dict(speculation="mtp", spec_k=3, spec_full_below=1.0, spec_off_above=1.01,
                      spec_min_acceptance=0.0),
        "adaptive": dict(speculation="mtp")}


def checkpoints() -> dict[str, Path]:
    """The random-head checkpoint and its right-head variant, made once under the cache."""
    from helexa.fixtures.tiny import cache_dir, init_tiny

    wrong = cache_dir() / "bench" / "qwen3_5-mtp-h256-l8-v4096"
    if not (wrong / "model.safetensors").is_file():
        init_tiny(wrong, **MODEL)
    right = wrong.parent / (wrong.name + "-right")
    if not (right / "model.safetensors").is_file():
        craft_right_mtp_head(wrong, right)
    return {"right": right, "wrong": wrong}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from helexa.neuron.engine import messages as m
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.engine.spec import EngineSpec

    rates: dict[str, list[float]] = {}
    acc: dict[str, list[float]] = {}
    for variant, model_dir in checkpoints().items():
        runner = ModelRunner(model_dir, num_blocks=320, block_size=16, max_num_seqs=8,
                             max_batched_tokens=1024, num_state_slots=16)
        cores = {kind: EngineCore(EngineSpec(
            model_id="bench", model_dir=str(model_dir), num_blocks=320, block_size=16,
            context=4096, prefix_cache=False, limits=m.Limits(
                max_in_flight=16, anon_max_in_flight=16, max_slots=8, max_batched_tokens=1024,
                prefill_chunk_tokens=512, **limits)), runner) for kind, limits in SPEC.items()}
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            for n in (1, 8):
                rng = random.Random(100 * rep + n)
                batch = [[rng.randrange(runner.vocab_size) for _ in range(48)] for _ in range(n)]
                for kind, core in cores.items():
                    tps, a = run(core, runner, batch, args.tokens, False, seed=rep)
                    if rep:
                        rates.setdefault(f"{variant}_{n}_{kind}", []).append(tps)
                        acc.setdefault(f"{variant}_{n}_{kind}", []).append(a)
    print(f"tiny qwen3_5 with an MTP head (h256, 8 layers, vocab 4096), {args.tokens} tokens"
          f" per stream, {args.repeats} repeats, torch threads {args.threads}")
    for key in rates:
        print(f"  {key:18s} {statistics.median(rates[key]):8.1f} tok/s"
              f"   acceptance {statistics.median(acc[key]):.2f}")
    for variant in ("right", "wrong"):
        for n in (1, 8):
            for kind in ("fixed", "adaptive"):
                num, den = rates[f"{variant}_{n}_{kind}"], rates[f"{variant}_{n}_off"]
                r = statistics.median(a / b for a, b in zip(num, den, strict=True))
                print(f"  {variant} head, {n} stream{'s' * (n > 1)}: {kind} mtp vs off"
                      f"{'':8s} {r:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
