"""Quantised linear layers on CPU with fp32 activations: integer dot products for a decode
step's few rows (helexa/kernels/cpu/kquant.c), dequantised tiles and MKL's GEMM for more.

The weight is ``w = s * u + z`` per (row, group): u in 4 bits (GGUF Q4_K, GPTQ / AWQ /
compressed-tensors int4) or int8 (Q8_0, Q6_K, Q5_K and layers fusing several types),
fp32 scales and zeros (the values helexa/kernels/quant.py's layouts hold, repacked:
:func:`pack`). The native kernel quantises the activation once per call per 32
values (llama.cpp's activations have 8 bits, which moved greedy tokens of the parity
tests; these 15) and sums products in integers (int16 pairs, pmaddwd or VNNI's vpdpwssd,
against the weight widened once for all of a step's rows; or two int8 halves against the
weight's bytes, VNNI's vpdpbusd: kquant.c says when each wins); :func:`emulate` is
the same arithmetic in plain torch, and :func:`dequantize` the plain-torch float weight
every path is tested against (tests/kernels/test_kquant.py states the tolerances).

Which runs a layer's decode rows — the native kernel (AVX2, VNNI, VNNI8, AVX512, plain C
where none; on one thread or torch's count), helexa/kernels/cpu/int8g.c's fp32 kernel (8-bit
weights) or torch tiles — is measured on the layer's own weight at load, per row bucket (one row;
2 to ``NATIVE_MAX_ROWS``; more, a prefill chunk, probed at ``PREFILL_PROBE_ROWS``), as
int8g.py does. Prefill is measured too: dequantising every tile of the weight for each chunk
cost more than the integer kernel's pass per 8 rows on the 29M qwen3 of bench/engine.py.
``HELEXA_CPU_KQUANT`` (``tile``, ``int8g``, ``plain``, ``avx2``, ``vnni``, ``vnni8``,
``avx512``) forces a kind.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from helexa.kernels.cpu import native as cpu_native

NATIVE_MAX_ROWS = 8  # more rows: a prefill chunk (its own measured bucket)
PREFILL_PROBE_ROWS = 64  # rows the prefill bucket is measured at
XBLOCK = 32  # activation values per scale (kquant.c)
VMAX = 16256.0  # 127 * 128: the activation's 15-bit range (kquant.c: two int8 halves hold it)
# name -> kquant.c's bit: plain C, AVX2, VNNI (int16 activations against widened weights),
# VNNI8 (the activation as two int8 halves against the weight's bytes), AVX512 (the wide form
# at 512 bits, with AVX512-VNNI where the CPU has it)
ISAS = {"plain": 1, "avx2": 2, "vnni": 4, "vnni8": 8, "avx512": 16}
KINDS = ("tile", "int8g", *ISAS)
TILE_BYTES = 4 << 20  # float bytes of one dequantised tile
_PROBE_ROWS = (1, NATIVE_MAX_ROWS, PREFILL_PROBE_ROWS)  # per bucket (:func:`bucket`)
_BUCKETS = ("1 row", f"2-{NATIVE_MAX_ROWS} rows", "prefill")
_choices: dict[tuple, tuple[str, int]] = {}  # key -> (kind, native threads)
_times: dict[tuple, dict[tuple[str, int], float]] = {}  # key -> µs per call of each (kind, threads)
log = structlog.get_logger(component="kernels")


@dataclass
class KqWeight:
    """A layer's weight in the kernel's form: ``packed`` uint8 [N, K / 2] (bits 4: byte i of
    each 64-value chunk is u[i] | u[i + 32] << 4) or int8 [N, K]; scales and zeros fp32
    [N, K / group]."""

    packed: torch.Tensor
    bits: int
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.packed.shape
        return n, width * 2 if self.bits == 4 else width


@functools.cache
def isas() -> tuple[str, ...]:
    """The kernel builds this library has on this CPU (none when it cannot be built)."""
    lib = cpu_native.load()
    if lib is None:
        return ()
    mask = lib.hx_kq_isas()
    return tuple(name for name, bit in ISAS.items() if mask & bit)


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> KqWeight | None:
    """q [N, K] (integers) with ``w = q * scale + zero`` per contiguous group [N, G] -> the
    kernel's form; None for a shape the kernel does not take (the caller keeps its op)."""
    n, k = q.shape
    groups = scale.shape[1]
    group = k // groups
    if group * groups != k or k % XBLOCK or not (group == 16 or group % XBLOCK == 0):
        return None
    lo, hi = int(q.min()), int(q.max())
    scale = scale.float().contiguous()
    zero = None if zero is None else zero.float().contiguous()
    if lo >= 0 and hi <= 15 and k % 64 == 0 and group % XBLOCK == 0:
        u = q.to(torch.uint8).view(n, k // 64, 2, 32)
        packed = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        return KqWeight(packed, 4, scale, zero, group)
    if lo < -128 or hi > 127:
        return None
    return KqWeight(q.to(torch.int8).contiguous(), 8, scale, zero, group)


def values(w: KqWeight, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """The integer values u of rows r0..r1 as int8 [rows, K]."""
    p = w.packed[r0:r1]
    if w.bits == 8:
        return p
    rows = p.shape[0]
    p = p.view(rows, -1, 1, 32)
    return torch.cat([p & 0x0F, p >> 4], dim=2).view(rows, -1).to(torch.int8)


def dequantize(w: KqWeight, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """The plain-torch float weight of rows r0..r1 (fp32): ``s * u + z`` per group."""
    u = values(w, r0, r1)
    rows, k = u.shape
    out = u.view(rows, k // w.group, w.group).float() * w.scales[r0:r1].unsqueeze(-1)
    if w.zeros is not None:
        out = out + w.zeros[r0:r1].unsqueeze(-1)
    return out.view(rows, k)


def tiles(x: torch.Tensor, w: KqWeight) -> torch.Tensor:
    """x [M, K] fp32 @ W^T by dequantised tiles of rows and torch.mm: the prefill path."""
    n, k = w.shape
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    rows = max(1, TILE_BYTES // (k * 4))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        torch.mm(x, dequantize(w, r0, r1).t(), out=out[:, r0:r1])
    return out


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kquant.c's rule in torch: x [M, K] fp32 -> (v int16 [M, K], dx fp32 [M, K / 32]) with
    dx = amax / VMAX and v = nearest-even(x * (VMAX / amax)) per 32 values."""
    m, k = x.shape
    b = x.view(m, k // XBLOCK, XBLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    # a true division, as C's (``VMAX / tensor`` is torch's reciprocal times VMAX)
    iscale = torch.where(amax > 0, torch.full_like(amax, VMAX) / amax, torch.zeros_like(amax))
    v = torch.round(b * iscale).clamp_(-VMAX, VMAX).to(torch.int16).view(m, k)
    return v, (amax / VMAX).view(m, -1)


def emulate(x: torch.Tensor, w: KqWeight) -> torch.Tensor:
    """The native kernel's arithmetic in torch (fp64 sums): the weight against the
    quantised activation. The kernels agree with it to fp32 summation order."""
    v, dx = quantize_activation(x.float())
    xd = (v.double().view(x.shape[0], -1, XBLOCK) * dx.double().unsqueeze(-1)).flatten(1)
    return (xd @ dequantize(w).double().t()).float()


def native(isa: str, x: torch.Tensor, w: KqWeight, threads: int | None = None) -> torch.Tensor:
    """x [M, K] @ W^T on kquant.c's ``isa`` build; [M, N] fp32."""
    lib = cpu_native.load()
    if lib is None or isa not in isas():
        raise RuntimeError(f"kquant: the library has no {isa} build on this CPU")
    n, k = w.shape
    xf = x.float().contiguous()
    y = torch.empty(xf.shape[0], n, dtype=torch.float32)
    rc = lib.hx_kq_gemm(ISAS[isa], xf.data_ptr(), xf.shape[0], k, w.packed.data_ptr(), w.bits,
                        n, w.scales.data_ptr(), None if w.zeros is None else w.zeros.data_ptr(),
                        w.group, y.data_ptr(), threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"kquant: hx_kq_gemm refused {w.bits}-bit {n}x{k} in groups of "
                           f"{w.group} (code {rc})")
    return y


def _int8g(x: torch.Tensor, w: KqWeight, threads: int) -> torch.Tensor:
    from helexa.kernels.cpu import int8g

    lib = cpu_native.load()
    best = int8g.isas(lib)[-1]
    return int8g.native(lib, best, x, w.packed, w.scales, w.zeros, w.group, threads)


def _forced() -> str | None:
    raw = os.environ.get("HELEXA_CPU_KQUANT", "measure").strip()
    if raw in ("", "measure"):
        return None
    if raw not in KINDS:
        raise ValueError(f"HELEXA_CPU_KQUANT={raw!r}: expected 'measure' or one of {KINDS}")
    return raw


def _candidates(w: KqWeight, rows: int, *, all_isas: bool = False) -> list[str]:
    """The kinds that can run ``rows`` rows of ``w`` here, tiles first (int8g.c takes a
    decode step's few rows only). The plain C build is measured only on a CPU with no
    other (18-50x slower than AVX2 at every bucket on the 29M qwen3 of bench/engine.py;
    not timing it took helexa/neuron/formats/gguf/activation.py's two loads of its Q4_K_M
    file from 20.1 to 8.6 s) unless ``all_isas`` (a forced kind may still name it)."""
    out = ["tile"]
    lib = cpu_native.load()
    if w.bits == 8 and lib is not None and rows <= NATIVE_MAX_ROWS:
        from helexa.kernels.cpu import int8g

        if any(w.group % int8g.ISAS[i][1] == 0 for i in int8g.isas(lib)):
            out.append("int8g")
    simd = [i for i in isas() if i != "plain"]
    return out + (list(isas()) if all_isas or not simd else simd)


def run(kind: str, x: torch.Tensor, w: KqWeight, threads: int) -> torch.Tensor:
    if kind == "tile":
        return tiles(x, w)
    if kind == "int8g":
        return _int8g(x, w, threads)
    return native(kind, x, w, threads)


def linear(x: torch.Tensor, w: KqWeight) -> torch.Tensor:
    """x [M, K] fp32 @ W^T by the kind chosen for this layer's shape and M's bucket."""
    kind, threads = choice(w, x.shape[0])
    return run(kind, x, w, threads)


def bucket(rows: int) -> int:
    """The measured bucket of ``rows`` rows: 0 one, 1 up to NATIVE_MAX_ROWS, 2 prefill."""
    return 0 if rows <= 1 else (1 if rows <= NATIVE_MAX_ROWS else 2)


def choice(w: KqWeight, rows: int) -> tuple[str, int]:
    """(kind, native threads) for ``rows`` rows of this layer: forced, else measured once
    per (shape, form, bucket, torch threads). A prefill chunk whose bucket measured tiles
    fastest (at PREFILL_PROBE_ROWS rows) still takes the native kernel when its passes of
    NATIVE_MAX_ROWS rows, at the fastest native build's measured time each (int8g.c may
    have won those rows: it takes no more), cost less than that tile call: the
    tiles dequantise the whole weight whatever the rows, so a short prompt's few rows are
    faster natively (bench/engine.py's 29M qwen3 Q4_K_M: a 16-token prefill in 2 passes)."""
    threads = torch.get_num_threads()
    forced = _forced()
    if forced is not None:
        return (forced if forced in _candidates(w, rows, all_isas=True) else "tile"), threads
    b = bucket(rows)
    got = _measured(w, b, threads)
    if b == 2 and got[0] == "tile":
        _measured(w, 1, threads)
        few = {kt: us for kt, us in _times[_key(w, 1, threads)].items() if kt[0] in ISAS}
        if few:
            best = min(few, key=few.__getitem__)
            if -(-rows // NATIVE_MAX_ROWS) * few[best] < _times[_key(w, 2, threads)][got]:
                return best
    return got


def _key(w: KqWeight, b: int, threads: int) -> tuple:
    return (w.shape, w.bits, w.group, w.zeros is not None, b, threads)


def _measured(w: KqWeight, b: int, threads: int) -> tuple[str, int]:
    key = _key(w, b, threads)
    got = _choices.get(key)
    if got is None:  # engine processes call from one thread: no lock
        # the candidates only on a miss: asking the library costs ~5% of a decode step
        _times[key] = _measure(w, _candidates(w, _PROBE_ROWS[b]), _PROBE_ROWS[b])
        got = _choices[key] = min(_times[key], key=_times[key].__getitem__)
    return got


def _measure(w: KqWeight, cands: list[str], rows: int) -> dict[tuple[str, int], float]:
    """µs per call of each candidate (kind, native threads) at ``rows`` rows (logged)."""
    from helexa.kernels.cpu.matmul import _time_us

    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    fns: dict[tuple[str, int], Callable[[], torch.Tensor]] = {("tile", 0): lambda: tiles(x, w)}
    for kind in cands[1:]:
        for t in sorted({1, torch.get_num_threads()}):
            fns[kind, t] = lambda kind=kind, t=t: run(kind, x, w, t)  # type: ignore[misc]
    times = {k: _time_us(fn) for k, fn in fns.items()}
    best = min(times, key=times.__getitem__)
    log.info("kernels.cpu_quant_matmul_chosen", shape=f"{w.shape[0]}x{w.shape[1]}", bits=w.bits,
             group=w.group, rows=rows, kind=best[0], native_threads=best[1],
             times_us={f"{k}x{t}" if t else k: round(us, 1) for (k, t), us in times.items()})
    return times


def chosen() -> list[str]:
    """The kinds measured so far, as 'kind (1 row)' / 'kind (2-8 rows)' / 'kind (prefill)',
    for status lines."""
    seen = sorted({(b, kind) for (*_, b, _), (kind, _) in _choices.items()})
    return [f"{kind} ({_BUCKETS[b]})" for b, kind in seen]


class KQuantLinear:
    """kernel(x, bias) of a quantised layer in this form (its buffers ``qweight``,
    ``qscales``, ``qzeros`` registered on the layer, so its bytes are counted)."""

    def __init__(self, mod: torch.nn.Module, w: KqWeight, perm: torch.Tensor | None = None
                 ) -> None:
        for name, t in (("qweight", w.packed), ("qscales", w.scales), ("qzeros", w.zeros)):
            if t is not None:
                mod.register_buffer(name, t, persistent=False)
        self.w, self.perm = w, perm  # perm: GPTQ act-order, inputs gathered into group order

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(-1, self.perm)
        y = linear(x2.float(), self.w).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*shape[:-1], self.w.shape[0])

    def mat_words(self, rows: int, bias: torch.Tensor | None) -> list[int] | None:
        """This product at ``rows`` rows as one matmul of hx_decode_layers (native.c's mat()),
        or None when its measured kind there is torch tiles (or inputs are permuted)."""
        if self.perm is not None or (bias is not None and (
                bias.dtype != torch.float32 or not bias.is_contiguous())):
            return None
        kind, threads = choice(self.w, rows)
        w, (n, k) = self.w, self.w.shape
        if kind in ISAS:
            return cpu_native.mat_words(cpu_native.MAT_KQUANT, n, k, w.packed, bias, ISAS[kind],
                                        w.bits, w.group, w.scales, w.zeros, threads)
        if kind == "int8g":
            from helexa.kernels.cpu import int8g

            best = int8g.isas(cpu_native.load())[-1]
            return cpu_native.mat_words(cpu_native.MAT_INT8G, n, k, w.packed, bias,
                                        int8g.ISAS[best][0], 8, w.group, w.scales, w.zeros,
                                        threads)
        return None

    def prepare(self, max_num_seqs: int) -> None:
        """Measure this layer's kernels now, not in the first request's decode step."""
        for rows in sorted({1, min(max_num_seqs, 2), PREFILL_PROBE_ROWS}):
            choice(self.w, rows)

    def dequantized(self) -> torch.Tensor:
        """The float weight [N, K] in the inputs' own order."""
        w = dequantize(self.w)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def install(mod: torch.nn.Module, q: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor | None, dtype: torch.dtype,
            perm: torch.Tensor | None = None) -> bool:
    """Install the op on ``mod`` when it serves it: a CPU layer with fp32 activations, a
    library built for this CPU, a shape the kernel takes. False leaves the caller's op."""
    if dtype != torch.float32 or q.device.type != "cpu" or not isas():
        return False
    w = pack(q, scale, zero)
    if w is None:
        return False
    if perm is not None:
        mod.register_buffer("qperm", perm, persistent=False)
    mod.kernel = KQuantLinear(mod, w, perm)
    return True
