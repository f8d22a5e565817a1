"""The grouped int8 matmul on CPU for the few rows of a decode step (kernels/cpu_int8g.c).

kernels/quant.py's plain-torch op dequantises a tile of weight rows to memory and
multiplies it: right for a prefill chunk (MKL's GEMM amortises the tile over many
rows), wasteful for one to eight rows, where the product is a stream of the weight
bytes and the tile writes and reads four float bytes for each int8 one. The native
kernel dequantises in registers instead, on one thread, AVX2 or AVX-512.

Which of the three (torch tiles, native AVX2, native AVX-512) is fastest depends on
the CPU, the thread count and the shape, so :func:`linear` measures them on the
layer's own weight at its first call of each row bucket (one row; 2 to
``NATIVE_MAX_ROWS``) and keeps the winner per (shape, group, zeros, dtype, threads).
``HELEXA_CPU_INT8G`` (``tile``, ``avx2``, ``avx512``) overrides the measurement;
``HELEXA_CPU_KERNELS=0`` (no library) leaves the torch path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import structlog
import torch

from helexa.kernels import cpu_native

NATIVE_MAX_ROWS = 8  # more rows: a prefill chunk, the torch tiles' GEMM
ISAS = {"avx2": (1, 8), "avx512": (2, 16)}  # name -> (cpu_int8g.c's ISA bit, lanes)
KINDS = ("tile", *ISAS)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # scales' dtype -> the kernel's bf16 flag
_PROBE_ROWS = (1, NATIVE_MAX_ROWS)  # measured row count per bucket
_choices: dict[tuple, str] = {}
_lock = threading.Lock()
log = structlog.get_logger(component="kernels")

Tiles = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


def isas(lib: object) -> list[str]:
    """The native builds this library has (on this CPU), in KINDS order."""
    mask = lib.hx_int8g_isas()  # type: ignore[attr-defined]
    return [name for name, (bit, _) in ISAS.items() if mask & bit]


def native(lib: object, isa: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x [M, K] (scales' dtype) @ W^T on the native kernel; [M, N] in scales' dtype."""
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
                           _DTYPES[s.dtype], y.data_ptr())
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
    kind = _forced()
    if kind is None:
        key = (tuple(qweight.shape), group_size, zeros is not None, scales.dtype,
               rows > 1, torch.get_num_threads())
        with _lock:
            if key not in _choices:
                _choices[key] = _measure(lib, fit, qweight, scales, zeros, group_size, tiles,
                                         _PROBE_ROWS[rows > 1])
            kind = _choices[key]
    if kind not in fit:
        return tiles(x, qweight, scales, zeros, group_size)
    return native(lib, kind, x, qweight, scales, zeros, group_size)


def _measure(lib: object, fit: list[str], qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None, group_size: int, tiles: Tiles, rows: int) -> str:
    """The fastest kind at ``rows`` rows on this weight (timed on a random x)."""
    from helexa.kernels.backends.cpu_matmul import _time_us

    x = torch.randn(rows, qweight.shape[1], generator=torch.Generator().manual_seed(rows))
    x = x.to(scales.dtype)
    cands: dict[str, Callable[[], torch.Tensor]] = {
        "tile": lambda: tiles(x, qweight, scales, zeros, group_size)}
    for isa in fit:
        cands[isa] = lambda isa=isa: native(lib, isa, x, qweight, scales, zeros, group_size)  # type: ignore[misc]
    times = {kind: _time_us(fn) for kind, fn in cands.items()}
    best = min(times, key=times.__getitem__)
    log.info("kernels.cpu_grouped_matmul_chosen", shape=f"{qweight.shape[0]}x{qweight.shape[1]}",
             group=group_size, rows=rows, threads=torch.get_num_threads(), kind=best,
             times_us={k: round(t, 1) for k, t in times.items()})
    return best
