"""One checkpoint served by helexa (`helexa up`) and by `transformers serve` (continuous
batching, the same dtype and thread count), the same greedy /v1/completions requests
interleaved: decode tok/s at 1 and N concurrent streams and the ratios, on this machine.

    .venv/bin/pip install -e '.[bench]'       # transformers serve needs fastapi, uvicorn, accelerate
    .venv/bin/python bench/transformers_serve.py [--model DIR] [--threads 1] [--streams 8]

The default checkpoint is bench/engine.py's 29M qwen3 (helexa.fixtures.tiny's
bench_checkpoint: nothing is downloaded). Requests, repeats and ratios are
bench/gguf_vs_llamacpp.py's (``compare``): each repeat runs every stream count on helexa
then on transformers, each ratio is the median of the repeats' own. Benchmarks print
figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from gguf_vs_llamacpp import against, free_port, ready, report


def start_transformers(model: Path, dtype: str, threads: int, log: Path
                       ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cli = Path(sys.executable).parent / "transformers"
    proc = subprocess.Popen([str(cli), "serve", str(model), "--device", "cpu", "--dtype", dtype,
                             "--continuous-batching", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads),
                                 "HF_HUB_OFFLINE": "1"})
    return proc, ready(proc, f"http://127.0.0.1:{port}", "/health", log, "transformers serve")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: "
                    "bench/engine.py's 29M qwen3)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args(argv)
    if args.model is None:
        from helexa.fixtures.tiny import bench_checkpoint

        args.model = bench_checkpoint()
    counts = (1, args.streams)
    hf_dtype = {"fp32": "float32", "bf16": "bfloat16"}[args.dtype]
    got, status = against(
        (args.model, args.dtype, args.threads, args.log_dir / "bench-helexa.log"),
        lambda: start_transformers(args.model, hf_dtype, args.threads,
                                   args.log_dir / "bench-transformers.log"),
        (args.model.name, str(args.model)), "transformers", counts, args.new_tokens,
        args.repeats)
    import transformers

    print(f"bench/transformers_serve.py {args.model.name}  {args.dtype}  threads={args.threads}  "
          f"new={args.new_tokens}  repeats={args.repeats}  transformers "
          f"{transformers.__version__} serve --continuous-batching  "
          f"load {os.getloadavg()[0]:.1f}")
    report(got, status, counts, "transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
