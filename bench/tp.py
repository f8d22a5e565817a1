"""Tensor-parallel benchmark: TP=2 against TP=1 decode on CPU (gloo, real processes).

    .venv/bin/python bench/tp.py [--model DIR] [--repeats 3] [--new-tokens 64]

Every rank runs one torch thread, so TP=2 uses two cores where TP=1 uses one.
Prints decode tok/s for one and for eight streams, measured interleaved, with
medians, and what moves between ranks per decode step: the payload each rank
puts into collectives (all-reduces after o_proj and down_proj, the embedding's
all-reduce, the logits gather) and the step plan rank 0 pipes to each rank.
On CPU there is no target: this shows the cost of the machinery. On GPUs run
bench/gpu_tp.sh.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def decode_rate(runner, streams: int, new_tokens: int, prompt_tokens: int, rep: int,
                comm) -> tuple[float, float, float]:
    """(tok/s, collective bytes per step, plan bytes per step) of greedy decode."""
    from helexa.neuron.engine.model_runner import SeqInput

    g = torch.Generator().manual_seed(rep)
    prompts = torch.randint(10, runner.vocab_size - 10, (streams, prompt_tokens), generator=g)
    per = -(-(prompt_tokens + new_tokens) // runner.block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(streams)]
    last = runner.execute([SeqInput(p, 0, t, True)
                           for p, t in zip(prompts.tolist(), tables, strict=True)]).argmax(-1).tolist()
    comm_before, plan_bytes = comm["bytes"], 0
    start = time.perf_counter()
    for k in range(new_tokens - 1):
        n = prompt_tokens + k
        last = runner.execute([SeqInput([x], n, t, True)
                               for x, t in zip(last, tables, strict=True)]).argmax(-1).tolist()
        plan_bytes += runner._tp.plan_bytes if runner._tp is not None else 0
    secs = time.perf_counter() - start
    steps = new_tokens - 1
    return streams * steps / secs, (comm["bytes"] - comm_before) / steps, plan_bytes / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint (default: bench/engine.py's tiny qwen3)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    from helexa.fixtures.tiny import bench_checkpoint
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.models.layers import COMM_STATS

    torch.set_num_threads(1)
    model_dir = args.model or bench_checkpoint()
    devices = [args.device] if args.device == "cpu" else [f"cuda:{i}" for i in range(2)]
    runners = {
        tp: ModelRunner(model_dir, device=devices[0], dtype=args.dtype, num_blocks=
                        args.streams * -(-(args.prompt_tokens + args.new_tokens) // 16),
                        block_size=16, max_num_seqs=args.streams, max_batched_tokens=4096,
                        tp_size=tp, devices=devices * (2 if args.device == "cpu" else 1))
        for tp in (1, 2)
    }
    results: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    try:
        for r in runners.values():  # warm-up
            decode_rate(r, 1, 4, args.prompt_tokens, -1, COMM_STATS)
        for rep in range(args.repeats):
            for streams in (1, args.streams):
                for tp, r in runners.items():
                    results.setdefault((tp, streams), []).append(
                        decode_rate(r, streams, args.new_tokens, args.prompt_tokens, rep,
                                    COMM_STATS))
    finally:
        for r in runners.values():
            r.close()

    print(f"bench/tp.py  model={model_dir}  device={args.device}  one torch thread per rank  "
          f"repeats={args.repeats}  prompt={args.prompt_tokens}  new={args.new_tokens}")
    print(f"  {'tp':>2} {'streams':>7} {'decode tok/s':>13}   {'collective B/step/rank':>22}"
          f" {'plan B/step/rank':>17}   runs")
    med = {}
    for (tp, streams), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med[tp, streams] = statistics.median(x[0] for x in runs)
        comm, plan = runs[-1][1], runs[-1][2]
        # COMM_STATS counts in Python, per call: a replayed CUDA graph and FlashInfer's fused
        # all-reduce + norm run no Python per collective, so on a GPU it would undercount
        counted = f"{comm:>22,.0f}" if args.device == "cpu" else f"{'(CPU only)':>22}"
        print(f"  {tp:>2} {streams:>7} {med[tp, streams]:>13.1f}   {counted} {plan:>17,.0f}"
              f"   [{' '.join(f'{x[0]:.1f}' for x in runs)}]")
    for streams in (1, args.streams):
        print(f"  TP=2 / TP=1 at {streams} stream(s): {med[2, streams] / med[1, streams]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
