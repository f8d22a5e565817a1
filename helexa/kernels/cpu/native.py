"""Build and load helexa/kernels/cpu/native.c (fused CPU decode-step kernels and a few-row matmul),
helexa/kernels/cpu/int8g.c (the grouped int8 matmul of few rows) and helexa/kernels/cpu/kquant.c
(the quantised matmul of few rows on integer dot products) as one library.

The C sources ship with the package and are compiled on first use with the
system C compiler (``$CC``, else ``cc``) for this machine's CPU
(``-march=native``) into helexa's cache folder, keyed by a hash of the source,
the flags and the CPU, so a cached library is never one built for other code or
another CPU. Concurrent first uses (several engine processes) each build to a
temporary name and rename, so none loads a half-written file. When no compiler
is there, or ``HELEXA_CPU_KERNELS=0``, ``load()`` returns None and the model runs
its plain-torch decode path (the same results within fp32 rounding; tests cover
both).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

SOURCE = Path(__file__).with_name("native.c")
SOURCES = (SOURCE, Path(__file__).with_name("int8g.c"), Path(__file__).with_name("kquant.c"))
PANEL = 16  # columns per packed weight panel (cpu_native.c)
MAT_WORDS = 11  # int64 words of one matmul of hx_decode_layers (native.c's mat())
MAT_PANELS, MAT_KQUANT, MAT_INT8G = 0, 1, 2  # its kinds
# No -ffast-math: linking with it adds crtfastmath.o, whose constructor sets flush-to-zero
# and denormals-are-zero for the whole process on load (5e-324 > 0 turns False, msgspec's
# gt=0 checks pass 0). Reassociation alone, for vectorised reductions, has no such hook.
FLAGS = ["-O3", "-march=native", "-pthread", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
log = structlog.get_logger(component="kernels")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "hx_attn_decode": [_P, _I, _I, _I, _I, _P, _F, _P, _P, _P, _P, _P, _I, _P, _I, _I, _P, _F,
                       _P],
    "hx_add_rmsnorm": [_P, _P, _P, _P, _I, _I, _F],
    "hx_silu_mul": [_P, _P, _I, _I],
    "hx_gemm": [_P, _I, _I, _P, _I, _P, _P],
    "hx_decode_layers": [_I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P,
                         _P, _I, _P, _I, _I, _F, _P, _P, _P, _P, _P, _P, _F],
    "hx_int8g_isas": [],
    "hx_int8g_gemm": [_I, _P, _I, _I, _P, _I, _P, _P, _I, _I, _P, _I],
    "hx_kq_isas": [],
    "hx_kq_gemm": [_I, _P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _I],
    "hx_kq_quantize": [_P, _I, _I, _P, _P, _P],
}
_RESTYPES = {"hx_int8g_isas": _I, "hx_int8g_gemm": _I, "hx_kq_isas": _I, "hx_kq_gemm": _I,
             "hx_decode_layers": _I}  # the others return nothing


def enabled() -> bool:
    return os.environ.get("HELEXA_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = ""
    return f"{platform.machine()}|{platform.processor()}|{info}"


def library_path() -> Path:
    from helexa.fixtures.tiny import cache_dir

    h = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES))
    h.update(" ".join(FLAGS).encode())
    h.update(_cpu_key().encode())
    return cache_dir() / "kernels" / f"cpu_native-{h.hexdigest()[:16]}.so"


def build(out: Path) -> None:
    """Compile the source to ``out`` (atomically); raises RuntimeError with the compiler's
    message when it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc / gcc / $CC) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when disabled or unbuildable
    (logged once)."""
    global _lib, _tried
    if not enabled():
        return None
    with _lock:
        if _tried:
            return _lib
        _tried = True
        path = library_path()
        try:
            if not path.exists():
                build(path)
            lib = ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            log.warning("kernels.cpu_native_unavailable", error=str(e),
                        fallback="plain-torch decode")
            return None
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
        _lib = lib
        return lib


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W [N, K] (any strides) -> hx_gemm's panels [ceil(N/16), K, 16] (zero-padded), and the
    bias padded to the panels."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    w = torch.zeros(padded, k, dtype=torch.float32)
    w[:n] = weight
    packed = w.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()
    if bias is None:
        return packed, None
    b = torch.zeros(padded, dtype=torch.float32)
    b[:n] = bias
    return packed, b


def mat_words(kind: int, n: int, k: int, weight: torch.Tensor, bias: torch.Tensor | None,
              isa: int = 0, bits: int = 0, group: int = 0, scales: torch.Tensor | None = None,
              zeros: torch.Tensor | None = None, threads: int = 0) -> list[int]:
    """One matmul of hx_decode_layers as native.c's mat() reads it (MAT_WORDS words); the
    tensors must outlive the plan (the kernels that build these words hold them)."""

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    return [kind, n, k, weight.data_ptr(), ptr(bias), isa, bits, group, ptr(scales), ptr(zeros),
            threads]


def gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int,
         bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 @ W^T (+ bias) with W packed by pack_weight: [M, n]."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.hx_gemm(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n,
                None if bias is None else bias.data_ptr(), y.data_ptr())
    return y
