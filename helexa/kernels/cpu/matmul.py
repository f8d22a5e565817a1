"""CPU matmul kernels, chosen per weight shape by measuring on the CPU at load.

Three ways to compute x @ W^T in fp32 on CPU, none best everywhere:

- ``torch``: F.linear on the weight (MKL, all torch threads). For one row the weight
  is held column-major when that measures faster (MKL streams W^T contiguous);
- ``onednn``: a copy of W in oneDNN's blocked layout (torch.ops.mkldnn), ~1.5x MKL
  at 2-16 rows on the EPYC it was tuned on, ~25 µs fixed cost per call;
- ``native``: a copy of W in helexa/kernels/cpu/native.c's 16-column panels, hx_gemm on
  one thread: fastest at few rows on that EPYC, slower than MKL at prefill sizes on
  an AVX-512 Xeon (bench/engine.py there: TTFT 1.56x transformers').

So at load :func:`install` times each candidate per distinct weight shape at
three row counts — one row (single-stream decode), a batched decode (2-16 rows)
and a prefill chunk (more) — on this CPU with this thread count, and installs
a :class:`CpuLinear` that picks the winner by the row count of each call. Copies
are kept only for kinds that won somewhere, within ``HELEXA_CPU_PACK_MAX_MB``.
``HELEXA_CPU_MATMUL`` overrides the measurement (tests, benchmarks): one kind
for every row count, or three comma-separated (1 row, 2-16, more).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from helexa.kernels.cpu import native as cpu_native

KINDS = ("torch", "onednn", "native")
FEW_ROWS = 16  # rows 2..FEW_ROWS are a batched decode; more, a prefill chunk
# At decode sizes hx_gemm is taken while within this factor of the fastest, or within
# NATIVE_SLACK_US of it: a decode step whose every layer matmul is native runs all layers
# in one C call, and that saves more than a few percent on one product. On the F32 29M
# qwen3 of bench/engine.py (one thread, AVX-512 Xeon) only 512x512 kept its steps from
# fusing (hx_gemm 37 against torch's 19 us at one row, 60 against 43 at eight, each timed
# hot); all-native fused steps ran 1.19x (one stream, 65.9 against 56.9 tok/s) and 1.17x
# (eight, 401.5 against 340.4) the measured per-layer ones, interleaved in one process.
NATIVE_SLACK = 1.15
NATIVE_SLACK_US = 50.0
log = structlog.get_logger(component="kernels")


def bucket(rows: int) -> int:
    """Which of the three measured row counts a call of ``rows`` rows falls under."""
    return 0 if rows == 1 else 1 if rows <= FEW_ROWS else 2


class CpuLinear:
    """A linear layer's product on CPU (installed as ``ParallelLinearBase.kernel``):
    ``choice[bucket(rows)]`` names the kind each call runs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 choice: tuple[str, str, str], lib: Any) -> None:
        self.weight, self.bias, self.choice, self.lib = weight, bias, choice, lib
        self.n = weight.shape[0]
        self.onednn: torch.Tensor | None = None
        self.native: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if "onednn" in choice:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), FEW_ROWS)
        if "native" in choice:
            self.native = cpu_native.pack_weight(weight.detach(), bias)

    def kind(self, rows: int) -> str:
        return self.choice[bucket(rows)]

    def mat_words(self, rows: int, bias: torch.Tensor | None) -> list[int] | None:
        """This product at ``rows`` rows as one matmul of hx_decode_layers, or None when it
        does not run hx_gemm there."""
        if self.choice[bucket(rows)] != "native" or self.native is None or bias is not self.bias:
            return None
        packed, padded_bias = self.native
        return cpu_native.mat_words(cpu_native.MAT_PANELS, self.n, packed.shape[1], packed,
                                    padded_bias)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kind = self.choice[bucket(x.shape[0])]
        if kind == "native" and bias is self.bias and self.native is not None:
            return cpu_native.gemm(self.lib, x, self.native[0], self.n, self.native[1])
        if kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing applies to fp32 weights on CPU builds that have it."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def relayout_column_major(weight: torch.Tensor) -> None:
    """Same values and shape, stored transposed (stride (1, rows))."""
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()


@dataclass
class Choice:
    shape: tuple[int, int]
    column_major: bool
    kinds: tuple[str, str, str]
    times_us: dict[str, list[float]]  # kind -> µs at each probed row count


def _time_us(fn: Callable[[], Any], budget_s: float = 0.004) -> float:
    """Best of three timed loops of ``fn`` (each ~budget/3), in µs per call."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, min(200, int(budget_s / 3 / once)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def _forced() -> tuple[str, str, str] | None:
    raw = os.environ.get("HELEXA_CPU_MATMUL", "measure").strip()
    if raw in ("", "measure"):
        return None
    kinds = [k.strip() for k in raw.split(",")]
    if len(kinds) == 1:
        kinds *= 3
    if len(kinds) != 3 or any(k not in KINDS for k in kinds):
        raise ValueError(f"HELEXA_CPU_MATMUL={raw!r}: expected 'measure', one of {KINDS}, "
                         "or three of them comma-separated (1 row, 2-16 rows, more)")
    return kinds[0], kinds[1], kinds[2]


def measure(weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, int, int],
            lib: Any, allow_relayout: bool) -> Choice:
    """Time every available kind at each of ``rows`` for this weight's shape (on copies:
    the weight itself is left alone)."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    b = None if bias is None else torch.randn(n, generator=g)
    xs = [torch.randn(m, k, generator=g) for m in rows]
    column_major = False
    if allow_relayout:  # one row: does MKL stream W^T faster than W?
        wt = w.t().contiguous().t()
        column_major = _time_us(lambda: F.linear(xs[0], wt, b)) < _time_us(lambda: F.linear(xs[0], w, b))
        if column_major:
            w = wt
    def plain(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, b)

    cands: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": plain}
    if can_pack(w):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, FEW_ROWS)

        def onednn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

        cands["onednn"] = onednn
    if lib is not None:
        panels, pb = cpu_native.pack_weight(w, b)

        def native(x: torch.Tensor) -> torch.Tensor:
            return cpu_native.gemm(lib, x, panels, n, pb)

        cands["native"] = native
    times = {kind: [_time_us(functools.partial(fn, x)) for x in xs] for kind, fn in cands.items()}
    return Choice((n, k), column_major, choose(times), times)


def choose(times: dict[str, list[float]]) -> tuple[str, str, str]:
    """The kind per row bucket from µs per call at each: the fastest, except that at decode
    sizes hx_gemm within NATIVE_SLACK (or NATIVE_SLACK_US) of it wins, as only an
    all-native layer stack runs fused (hx_decode_layers: no eager ops between)."""
    kinds = [min(times, key=lambda kd: times[kd][i]) for i in range(3)]  # noqa: B023 (used at once)
    for i in (0, 1):
        if "native" in times:
            native, best = times["native"][i], times[kinds[i]][i]
            if native <= NATIVE_SLACK * best or native - best <= NATIVE_SLACK_US:
                kinds[i] = "native"
    return kinds[0], kinds[1], kinds[2]


def install(linears: list[tuple[Any, bool]], lib: Any, *, max_num_seqs: int,
            max_batched_tokens: int, max_copy_mb: float) -> list[Choice]:
    """Measure (or take HELEXA_CPU_MATMUL's choice) per distinct weight shape and install a
    CpuLinear on every module of ``linears`` ((module, may relayout) pairs: a tied head is
    the embedding and keeps its rows). Returns the choices made, one per shape."""
    forced = _forced()
    if forced is not None and "native" in forced and lib is None:
        forced = tuple("torch" if k == "native" else k for k in forced)  # type: ignore[assignment]
    rows = (1, max(2, min(max_num_seqs, FEW_ROWS)), max(FEW_ROWS + 1, min(max_batched_tokens, 128)))
    choices: dict[tuple, Choice] = {}
    for mod, relayout in linears:
        w = mod.weight
        key = _key(mod, relayout)
        if key not in choices:
            if forced is not None:
                choices[key] = Choice(tuple(w.shape), relayout, forced, {})
            else:
                choices[key] = measure(w, getattr(mod, "bias", None), rows, lib, relayout)
    copy_bytes = sum(mod.weight.numel() * 4 * len({k for k in choices[_key(mod, r)].kinds
                                                   if k != "torch"})
                     for mod, r in linears)
    over = copy_bytes > max_copy_mb * 2**20
    for mod, relayout in linears:
        c = choices[_key(mod, relayout)]
        if c.column_major:
            relayout_column_major(mod.weight)
        kinds = ("torch",) * 3 if over else c.kinds
        mod.kernel = CpuLinear(mod.weight, getattr(mod, "bias", None), kinds, lib)  # type: ignore[arg-type]
    if over:
        log.info("kernels.cpu_matmul_copies_skipped", copy_mb=round(copy_bytes / 2**20),
                 max_mb=max_copy_mb)
    return list(choices.values())


def _key(mod: Any, relayout: bool) -> tuple:
    return (tuple(mod.weight.shape), getattr(mod, "bias", None) is not None, relayout)
