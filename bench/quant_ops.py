"""The grouped int8 op's CPU paths side by side, on one weight, in one run.

    python bench/quant_ops.py [--shapes 2048x2048,5632x2048] [--groups 32,128]
                              [--rows 1,4,8,32] [--dtypes float32,bfloat16] [--threads N]

For each weight shape [N, K], group size, activation dtype and row count it times
(µs per product, best of interleaved repeats):

- ``tile``: helexa/kernels/quant.py's plain-torch path (dequantise a cache-sized tile of rows,
  matmul it): the reference, and what serves many rows;
- ``avx2`` / ``avx512``: helexa/kernels/cpu/int8g.c, dequantising in registers (--threads threads);
- ``float``: F.linear on the float weight in the same dtype (what the weight costs
  unquantised);
- ``int8row``: ``aten._weight_int8pack_mm``, torch's per-row int8 op (no groups: the
  floor a grouped layout is up against).

and prints the ratios of the best native kernel against each, so the choice made at
load (helexa/kernels/cpu/int8g.py) can be checked on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helexa.kernels import quant as qk
from helexa.kernels.cpu import int8g as int8g_cpu
from helexa.kernels.cpu import native as cpu_native


def _time_us(fn: Callable[[], object], budget_s: float) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, int(budget_s / max(time.perf_counter() - t0, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def candidates(lib: object, isas: list[str], x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
               z: torch.Tensor, group: int, w: torch.Tensor, row_s: torch.Tensor
               ) -> dict[str, Callable[[], object]]:
    cands: dict[str, Callable[[], object]] = {
        "tile": lambda: qk.int8g_tiles(x, q, s, z, group),
        "float": lambda: F.linear(x, w),
        "int8row": lambda: torch.ops.aten._weight_int8pack_mm(x, q, row_s),
    }
    for isa in isas:
        if group % int8g_cpu.ISAS[isa][1] == 0:
            cands[isa] = lambda isa=isa: int8g_cpu.native(lib, isa, x, q, s, z, group)
    return cands


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default="2048x2048,5632x2048,2048x5632")
    ap.add_argument("--groups", default="32,128")
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=20.0, help="per timed loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = cpu_native.load()
    isas = int8g_cpu.isas(lib) if lib is not None else []
    print(f"bench/quant_ops.py  threads={args.threads}  native builds={isas or 'none'}  "
          f"(µs per product, median of {args.repeats} interleaved repeats)")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for group in (int(v) for v in args.groups.split(",")):
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            for dname in args.dtypes.split(","):
                dtype = getattr(torch, dname)
                s = (torch.rand(n, k // group, generator=g) * 0.01).to(dtype)
                z = (torch.randn(n, k // group, generator=g) * 0.01).to(dtype)
                w = qk.dequantize_int8g(q, s, z, group).to(dtype)
                row_s = s.float().amax(1).to(dtype)
                for m in (int(v) for v in args.rows.split(",")):
                    x = torch.randn(m, k, generator=g).to(dtype)
                    cands = candidates(lib, isas, x, q, s, z, group, w, row_s)
                    times: dict[str, list[float]] = {c: [] for c in cands}
                    for _ in range(args.repeats):
                        for c, fn in cands.items():
                            times[c].append(_time_us(fn, args.budget_ms / 1000))
                    med = {c: statistics.median(t) for c, t in times.items()}
                    cells = "  ".join(f"{c} {t:8.1f}" for c, t in med.items())
                    line = f"{n}x{k} g{group} {dname:<8} M={m:<3} {cells}"
                    nat = [c for c in isas if c in med]
                    if nat:
                        best = min(nat, key=med.__getitem__)
                        line += ("  | best native " + best + ": " + "  ".join(
                            f"{med[o] / med[best]:.2f}x vs {o}" for o in med if o not in isas))
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
