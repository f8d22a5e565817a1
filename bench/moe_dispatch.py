"""A MoE layer's expert forms side by side on this machine (helexa/kernels/moe_experts.py).

    .venv/bin/python bench/moe_dispatch.py [--experts 64] [--top-k 8] [--hidden 1024]
        [--inter 512] [--rows 1,4,16,64,512] [--dtype float32]

For each row count N it times the looped (host-synced), gathered and masked forms on
the same random routing and prints their medians and each one's ratio to the looped
form. The CPU choice in choose_form (looped everywhere) reads this table; on a GPU the
same script shows where the sync-free forms pay off (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from helexa.kernels.moe_experts import FORMS


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    w13 = torch.randn(e, 2 * i, h, dtype=dtype, device=dev) * h ** -0.5
    w2 = torch.randn(e, h, i, dtype=dtype, device=dev) * i ** -0.5
    print(f"E={e} k={k} H={h} I={i} {args.dtype} on {dev.type}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'rows':>6} " + " ".join(f"{name + ' ms':>12}" for name in FORMS)
          + "   gathered/looped  masked/looped")
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, h, dtype=dtype, device=dev)
        weights, chosen = torch.randn(n, e, device=dev).softmax(-1).topk(k, dim=-1)
        weights = weights.to(dtype)
        ms = {name: _median_ms(functools.partial(f, x, w13, w2, chosen, weights), args.repeats)
              for name, f in FORMS.items()}
        print(f"{n:>6} " + " ".join(f"{ms[name]:>12.2f}" for name in FORMS)
              + f"   {ms['gathered'] / ms['looped']:>15.2f}  {ms['masked'] / ms['looped']:>13.2f}")


if __name__ == "__main__":
    main()
