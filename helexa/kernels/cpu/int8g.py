"""The grouped int8 matmul on CPU for the few rows of a decode step (helexa/kernels/cpu/int8g.c).

helexa/kernels/quant.py's plain-torch op dequantises a tile of weight rows to memory and
multiplies it: right for a prefill chunk (MKL's GEMM amortises the tile over many
rows), wasteful for one to eight rows, where the product is a stream of the weight
bytes and the tile writes and reads four float bytes for each int8 one. The native
kernel dequantises in registers instead, AVX2 or AVX-512, the weight's rows split
over threads started per call.

Which is fastest (torch tiles, native AVX2, native AVX-512; native at one thread or
at torch's count) depends on the CPU, how busy its cores are, the thread count and
the shape, so :func:`linear` measures them on the layer's own weight at its first
call of each row bucket (one row; 2 to ``NATIVE_MAX_ROWS``) and keeps the winner per
(shape, group, zeros, dtype, torch threads). ``HELEXA_CPU_INT8G`` (``tile``, ``avx2``, ``avx512``) overrides the measurement;
``HELEXA_CPU_KERNELS=0`` (no library) leaves the torch path.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable

import structlog
import torch

from helexa.kernels.cpu import native as cpu_native

NATIVE_MAX_ROWS = 8  # more rows: a prefill chunk, the torch tiles' GEMM
ISAS = {"avx2": (1, 8), "avx512": (2, 16)}  # name -> (int8g.c's ISA bit, lanes)
KINDS = ("tile", *ISAS)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # scales' dtype -> the kernel's bf16 flag
_PROBE_ROWS = (1, NATIVE_MAX_ROWS)  # measured row count per bucket
_choices: dict[tuple, tuple[str, int]] = {}  # key -> (kind, native threads)
_lock = threading.Lock()
log = structlog.get_logger(component="kernels")

Tiles = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


@functools.cache  # one library per process; asked on every decode call of every layer
def isas(lib: object) -> list[str]:
    """The native builds this library has (on this CPU), in KINDS order."""
    mask = lib.hx_int8g_isas()  # type: ignore[attr-defined]
    return [name for name, (bit, _) in ISAS.items() if mask & bit]


def native(lib: object, isa: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group_size: int, threads: int | None = None
           ) -> torch.Tensor:
    """x [M, K] (scales' dtype) @ W^T on the native kernel, its rows split over ``threads``
    (default torch's count; fewer for a small weight); [M, N] in scales' dtype."""
    bit, lanes = ISAS[isa]
    if group_size % lanes or scales.dtype not in _DTYPES:
        raise ValueError(f"int8g {isa}: needs groups of a multiple of {lanes} and fp32/bf16 "
                         f"scales, got group {group_size}, {scales.dtype}")
    n, k = qweight.shape
    xf = x.float().contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    q, s = qweight.contiguous(), scales.contiguous()
    z = None if zeros is None else zeros.to(s.dtype).contiguous()
    rc = lib.hx_int8g_gemm(bit, xf.data_ptr(), xf.shape[0], k, q.data_ptr(), n,  # type: ignore[attr-defined]
                           s.data_ptr(), None if z is None else z.data_ptr(), group_size,
                           _DTYPES[s.dtype], y.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int8g: the library has no {isa} build")
    return y if s.dtype == torch.float32 else y.to(s.dtype)


def _forced() -> str | None:
    raw = os.environ.get("HELEXA_CPU_INT8G", "measure").strip()
    if raw in ("", "measure"):
        return None
    if raw not in KINDS:
        raise ValueError(f"HELEXA_CPU_INT8G={raw!r}: expected 'measure' or one of {KINDS}")
    return raw


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group_size: int, tiles: Tiles) -> torch.Tensor:
    """x [M, K] @ W^T by the kernel chosen for this layer's shape and M's bucket."""
    rows = x.shape[0]
    lib = cpu_native.load() if rows <= NATIVE_MAX_ROWS and scales.dtype in _DTYPES else None
    if lib is None:
        return tiles(x, qweight, scales, zeros, group_size)
    fit = [i for i in isas(lib) if group_size % ISAS[i][1] == 0]
    if not fit:  # no vector build on this CPU, or groups the lanes do not divide
        return tiles(x, qweight, scales, zeros, group_size)
    threads = torch.get_num_threads()
    forced = _forced()
    if forced is None:
        key = (tuple(qweight.shape), group_size, zeros is not None, scales.dtype, rows > 1,
               threads)
        choice = _choices.get(key)  # measured once per key: no lock once it is there
        if choice is None:
            with _lock:
                if key not in _choices:
                    _choices[key] = _measure(lib, fit, qweight, scales, zeros, group_size,
                                             tiles, _PROBE_ROWS[rows > 1])
                choice = _choices[key]
        kind, threads = choice
    else:
        kind = forced
    if kind not in fit:
        return tiles(x, qweight, scales, zeros, group_size)
    return native(lib, kind, x, qweight, scales, zeros, group_size, threads)


def _measure(lib: object, fit: list[str], qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, tiles: Tiles, rows: int
             ) -> tuple[str, int]:
    """The fastest (kind, native threads) at ``rows`` rows on this weight, timed on a random
    x. Native runs at torch's thread count and at one: starting threads per call, on a
    host whose cores are busy, can cost more than they save."""
    from helexa.kernels.cpu.matmul import _time_us

    x = torch.randn(rows, qweight.shape[1], generator=torch.Generator().manual_seed(rows))
    x = x.to(scales.dtype)
    cands: dict[tuple[str, int], Callable[[], torch.Tensor]] = {
        ("tile", 0): lambda: tiles(x, qweight, scales, zeros, group_size)}
    for isa in fit:
        for t in sorted({1, torch.get_num_threads()}):
            cands[isa, t] = lambda isa=isa, t=t: native(  # type: ignore[misc]
                lib, isa, x, qweight, scales, zeros, group_size, t)
    times = {kind: _time_us(fn) for kind, fn in cands.items()}
    best = min(times, key=times.__getitem__)
    log.info("kernels.cpu_grouped_matmul_chosen", shape=f"{qweight.shape[0]}x{qweight.shape[1]}",
             group=group_size, rows=rows, threads=torch.get_num_threads(),
             kind=best[0], native_threads=best[1],
             times_us={f"{k}x{t}" if t else k: round(us, 1) for (k, t), us in times.items()})
    return best
