"""The native quantised kernel's builds side by side (helexa/kernels/cpu/kquant.c): one
decode step's few rows through 4-bit (Q4_K's layout) and 8-bit weights, per build this CPU
has, interleaved, with each build's time against the fastest.

    .venv/bin/python bench/kquant_builds.py [--shapes 3072x512,512x1536,8192x512]
                                            [--rows 1,8] [--threads 1] [--repeats 7]

Shapes are N x K (output rows x inputs); the defaults are bench/engine.py's 29M qwen3's
gate/up, down and head. The engine does not run this table: it measures each layer's own
weight at load and takes the fastest (kquant.py). Benchmarks print figures; they assert
nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from helexa.kernels.cpu import kquant


def weight(n: int, k: int, bits: int, group: int = 32) -> kquant.KqWeight:
    g = torch.Generator().manual_seed(n * k + bits)
    lo, hi = (0, 16) if bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, (n, k), generator=g)
    w = kquant.pack(q, torch.rand(n, k // group, generator=g) * 0.01 + 1e-3,
                    torch.rand(n, k // group, generator=g) * 0.01)
    assert w is not None and w.bits == bits
    return w


def micros(fn, calls: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="3072x512,512x1536,8192x512")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    builds = [b for b in kquant.isas() if b != "plain"]
    if not builds:
        print("no native kquant build on this machine (no C compiler?)")
        return 0
    print(f"bench/kquant_builds.py  threads={args.threads}  builds={builds}  median us of "
          f"{args.repeats} interleaved repeats (x: the fastest build's time over this one's)")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for bits in (4, 8):
            w = weight(n, k, bits)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                runs = builds
                times: dict[str, list[float]] = {b: [] for b in runs}
                for _ in range(args.repeats):
                    for b in runs:
                        times[b].append(micros(
                            lambda b=b, x=x, w=w: kquant.native(b, x, w, args.threads)))
                med = {b: statistics.median(v) for b, v in times.items()}
                base = min(med.values())
                cells = "  ".join(f"{b} {us:7.1f} ({base / us:.2f}x)" for b, us in med.items())
                print(f"  {n}x{k} {bits}-bit rows={rows}:  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
