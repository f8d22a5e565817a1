"""The grouped int8 matmul on CUDA for the few rows of a decode step (Triton).

helexa/kernels/quant.py's plain-torch op, ``int8g_tiles``, dequantises a tile of weight
rows (4 MiB of float) to memory and multiplies it on cuBLAS. That is right for a prefill
chunk, where the GEMM amortises the tile over many rows. For a decode step's few rows it
launches about four kernels a tile (a 5120 x 17408 layer: ~170 a step) and writes and
reads back two float bytes for each int8 one. This kernel (helexa/kernels/cuda/
_int8g_triton.py) reads each int8 byte and its group's scale once, dequantises in
registers and multiplies on the tensor cores (rows padded to 16), with K split over
programs so that a layer of few output rows still fills the card; the spans' fp32
partial sums are added after. It serves the layouts of GGUF Q8_0, Q6_K and Q5_K, GPTQ
8-bit and grouped int8 alike (any group size that divides K, zeros or none), and per-row
int8 as one group a row (helexa/kernels/quant.py int8_linear).

Steps of at most ``ROWS`` rows (64) take it; more keep the tiles. The bound, the block sizes
and the split are read from the kernels' arithmetic, not measured: no GPU has run this.

The kernel earns its place on the card it runs on: the first call for each (device,
dtype, group size, zeros or not) runs it against the tiles on a seeded layer, outside
any graph capture, and a kernel that fails or disagrees leaves that key to the tiles,
the reason logged as ``kernels.cuda_grouped_matmul_fallback``. No Triton (a CPU-only
install, or ``HELEXA_TRITON_INT8G=0``) means the tiles. The tests run the same kernel on
CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from helexa.kernels import cuda as cuda_kernels

# A decode step's rows, up to four blocks of the tensor-core tile. Each 16-row block reads
# the int8 weight again (a byte a value each: four at 64 rows), where the tiles write and
# read back two float bytes a value besides: read from the arithmetic, not measured.
ROWS = 64
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
# an fp32 model's steps, shallower: its fp32 operands at BLOCK_K = 128 took 255 registers
# and spilled 1,352 B a thread (compiled for sm90), at 64 still 208-280 B; at 32, 242-247
# registers and none
BLOCK_K_FP32 = 32
PROGRAMS_PER_SM = 4  # K is split until the programs number this many per SM ...
MIN_SPAN_BLOCKS = 4  # ... while each keeps at least this many BLOCK_K steps
_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}

Tiles = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
# (device, dtype, group, zeros) -> "" or why the tiles serve
_verdicts = cuda_kernels.Verdicts(
    "kernels.cuda_grouped_matmul", "grouped int8 decode: Triton kernel",
    "grouped int8 decode: dequantised tiles",
    lambda key: {"device": str(key[0]), "dtype": str(key[1]).removeprefix("torch."),
                 "group": key[2], "zeros": key[3]})


def unavailable() -> str:
    """"" where the kernel can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_INT8G", "_int8g_triton")


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k(n: int, k: int, rows: int, sms: int, block_k: int = BLOCK_K) -> int:
    """How many spans K is cut into: enough programs for PROGRAMS_PER_SM on each of
    ``sms``, each span at least MIN_SPAN_BLOCKS steps of ``block_k``."""
    blocks = -(-n // BLOCK_N) * -(-rows // BLOCK_M)
    want = -(-PROGRAMS_PER_SM * sms // blocks)
    return max(1, min(want, k // (block_k * MIN_SPAN_BLOCKS)))


def run(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
        zeros: torch.Tensor | None, group_size: int, sms: int, interpret: bool = False
        ) -> torch.Tensor:
    """x [M, K] (scales' dtype) @ W^T on the kernel, W = q * scale + zero per group;
    [M, N] in scales' dtype. ``interpret``: Triton's interpreter (CPU tensors)."""
    from helexa.kernels.cuda import _int8g_triton

    m, k = x.shape
    n = qweight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight = qweight.contiguous()  # (its row stride is passed: the copy's, not the view's)
    scales = scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    block_k = BLOCK_K_FP32 if x.dtype == torch.float32 else BLOCK_K
    split = split_k(n, k, m, sms, block_k)
    span = -(-k // (split * block_k)) * block_k
    split = -(-k // span)  # no span left empty
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (-(-n // BLOCK_N), split, -(-m // BLOCK_M))
    dot, precision = _int8g_triton.operands(x.dtype, interpret)
    _int8g_triton.build(interpret)[grid](
        x, qweight, scales, scales if zeros is None else zeros, part,
        m, n, k, span, x.stride(0), qweight.stride(0), scales.stride(0),
        G=group_size, GROUPING=_int8g_triton.grouping(group_size, block_k),
        HAS_ZEROS=zeros is not None, DOT=dot, PRECISION=precision,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    out = part[0] if split == 1 else part.sum(0)
    return out.to(scales.dtype)


def probe(device: torch.device, dtype: torch.dtype, group_size: int, zeros: bool,
          tiles: Tiles, sms: int, interpret: bool = False) -> str:
    """Run the kernel against ``tiles`` on a seeded layer of this kind (3 rows, then 20:
    two blocks of rows; a ragged last block of outputs, K split in two): "" when within
    the dtype's tolerance, else why not (a failure of the kernel included)."""
    gen = torch.Generator().manual_seed(group_size)
    k = group_size * -(-2 * BLOCK_K * MIN_SPAN_BLOCKS // group_size)
    tol = _TOL.get(dtype, 1e-2)
    # outputs ragged against the blocks, then a multiple of 16 (the build a real layer's
    # shape takes: Triton specialises N on its divisibility by 16)
    for n, rows in ((3 * BLOCK_N - 5, 3), (2 * BLOCK_N, BLOCK_M + 4)):
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        s = torch.rand(n, k // group_size, generator=gen) * 0.02 + 1e-3
        z = torch.randn(n, k // group_size, generator=gen) * 0.01 if zeros else None
        x = torch.randn(rows, k, generator=gen)
        q, s, x = q.to(device), s.to(device, dtype), x.to(device, dtype)
        z = None if z is None else z.to(device, dtype)
        try:
            got = run(x, q, s, z, group_size, sms, interpret).float()
        except Exception as e:  # noqa: BLE001 - any failure: the tiles serve, said why
            return f"the Triton kernel failed ({type(e).__name__}: {e})"
        want = tiles(x, q, s, z, group_size).float()
        err = float((got - want).norm() / want.norm())
        if err >= tol:
            return f"the Triton kernel is off by {err:.2g} (relative; {tol} allowed)"
    return ""


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group_size: int, tiles: Tiles) -> torch.Tensor:
    """x [M, K] on a CUDA device @ W^T: the kernel for a decode step's rows where it has
    proved itself on this card, else ``tiles``; [M, N] in scales' dtype."""
    if x.shape[0] > ROWS or x.shape[0] == 0 or unavailable():
        return tiles(x, qweight, scales, zeros, group_size)
    key = (x.device, scales.dtype, group_size, zeros is not None)
    why = _verdicts.get(key)
    if why is None:
        if _capturing():  # a probe syncs: never in a graph capture
            return tiles(x, qweight, scales, zeros, group_size)
        why = _verdicts.decide(key, lambda: probe(x.device, scales.dtype, group_size,
                                                  zeros is not None, tiles,
                                                  _sms(x.device.index or 0)))
    if why:
        return tiles(x, qweight, scales, zeros, group_size)
    sms = _sms(x.device.index or 0)
    if _capturing():  # a launch failing in a capture spoils it: nothing to fall back to
        return run(x, qweight, scales, zeros, group_size, sms)
    try:  # this layer's own build (prepare runs every layer's at load): a failure is its kind's
        return run(x, qweight, scales, zeros, group_size, sms)
    except Exception as e:  # noqa: BLE001 - the tiles serve from now on, said why
        _verdicts.record(key, f"the Triton kernel failed on a {tuple(qweight.shape)} layer "
                              f"({type(e).__name__}: {e})")
        return tiles(x, qweight, scales, zeros, group_size)


def describe(device: torch.device) -> str:
    """What serves grouped int8 decode steps on ``device``, for the executor's describe()."""
    return _verdicts.describe(device, unavailable())
