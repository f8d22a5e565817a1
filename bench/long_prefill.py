"""Long-prompt benchmark: time to the first token of agent-sized prompts (4k-32k tokens)
through helexa's engine against transformers' one-forward prefill (sdpa) of the same
checkpoint, side by side in one run.

    .venv/bin/python bench/long_prefill.py [--tokens 4096,16384,32768] [--repeats 3]
                                           [--backend auto,torch] [--model DIR | --bench-model]

Without --model it builds (once, cached) the tiny qwen3 that agent replays run on
(``helexa model init-tiny --arch qwen3``: hidden 64, 2 layers, 4 heads / 2 kv heads,
131072 positions), fp32; ``--bench-model`` takes bench/engine.py's ~30M-parameter qwen3
(hidden 512, 8 layers) instead. helexa is EngineCore in-process, as bench/engine.py drives
it (prefill in ``prefill_chunk_tokens`` = 512 chunks, prefix cache off), one contender per
``--backend`` (``torch`` is the plain reference every other backend is tested against);
transformers is one forward of the whole prompt with use_cache. At each length the
contenders run interleaved, each once per repeat, on a fresh random prompt per repeat; a
ratio is the median over repeats of that repeat's own ratio (a shared machine's drifts
cancel within a pair), by wall clock and by process CPU time (far less disturbed by
neighbours on a shared machine: one torch thread).

Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import HelexaEngine, Secs, hf_prefill, prompts  # noqa: E402  (bench/engine.py)


def default_model() -> Path:
    from helexa.fixtures.tiny import cache_dir, init_tiny

    out = cache_dir() / "bench" / "qwen3-tiny-h64-l2"
    if not (out / "model.safetensors").is_file():
        init_tiny(out, arch="qwen3")  # init-tiny's defaults: what `helexa model init-tiny` makes
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: the tiny qwen3)")
    ap.add_argument("--bench-model", action="store_true",
                    help="bench/engine.py's ~30M-parameter qwen3 instead of the tiny one")
    ap.add_argument("--tokens", default="4096,16384,32768", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every contender")
    ap.add_argument("--backend", default="auto",
                    help="helexa attention backends, comma-separated (auto, torch, cpu)")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.tokens.split(",") if x.strip()]
    if args.model:
        model_dir = args.model
    elif args.bench_model:
        from helexa.fixtures.tiny import bench_checkpoint

        model_dir = bench_checkpoint()
    else:
        model_dir = default_model()
    from transformers import AutoModelForCausalLM

    from helexa.neuron.models.config import parse_dtype

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(args.dtype),
                                              attn_implementation="sdpa").eval()
    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    engines = {b: HelexaEngine(model_dir, args.threads, "cpu", args.dtype, b, streams=1,
                               tokens=max(lengths) + 16) for b in names}
    vocab = next(iter(engines.values())).vocab
    for e in engines.values():  # warm-up: allocator, first-call overheads
        e.run(prompts(-1, 1, 600, vocab), 2)
    hf_prefill(hf, prompts(-1, 1, 600, vocab)[0])

    print(f"bench/long_prefill.py  model={model_dir}  {args.dtype}  threads={args.threads}  "
          f"repeats={args.repeats}  prefill_chunk_tokens=512")
    for b, e in engines.items():
        print(f"backend {b}: {e.runner.backend.describe()}")
    print("TTFT in seconds, median [each repeat]; ratios helexa / transformers, median of "
          "per-repeat ratios (wall | process CPU) [wall, each repeat]")
    for n in lengths:
        results: dict[str, list[Secs]] = {"hf": [], **{b: [] for b in engines}}
        for rep in range(args.repeats):
            prompt = prompts(rep + 50, 1, n, vocab)
            results["hf"].append(hf_prefill(hf, prompt[0]))
            for b, e in engines.items():
                results[b].append(e.run(prompt, 1)[0])
        for key, runs in results.items():
            label = "transformers prefill" if key == "hf" else f"helexa[{key}] TTFT"
            walls = " ".join(f"{r[0]:.3g}" for r in runs)
            print(f"  {n:>6} tokens  {label:<24} wall {statistics.median(r[0] for r in runs):8.3f}"
                  f"  cpu {statistics.median(r[1] for r in runs):8.3f}  [{walls}]")
        for b in engines:
            per = [[h[i] / t[i] for h, t in zip(results[b], results["hf"], strict=True)]
                   for i in (0, 1)]
            print(f"  {n:>6} tokens  TTFT helexa[{b}] vs transformers prefill: "
                  f"{statistics.median(per[0]):5.2f}x | {statistics.median(per[1]):5.2f}x "
                  f"[{' '.join(f'{x:.2f}' for x in per[0])}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
