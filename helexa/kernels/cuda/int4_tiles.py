"""int4 products of many rows on CUDA: the weight dequantised a tile at a time (Triton),
multiplied on cuBLAS.

torch's CUDA int4 op (``_weight_int4pack_mm``, tinygemm) computes a tile of outputs per
block and reads its inputs again for each: fast for a decode step's few rows, several
times slower than a bf16 GEMM for a prefill chunk's (torchao's HQQ README, an A6000 at
4096 x 4096: 0.038 ms at 16 rows, 1.09 ms at 512 where its Triton GEMM took 0.24). A
step of more than ``ROWS`` rows here has the packed weight dequantised in tiles of at
most ``TILE_BYTES`` of bf16 (helexa/kernels/cuda/_int4_tiles_triton.py reads the op's own
packed layout: no second copy of the weight) and multiplies each on cuBLAS, as vLLM's AWQ
path does for large batches. The bound and the tile size are read from those figures,
not measured: no GPU has run this.

The kernel earns its place on the card: the first call for each (device, group size,
inner k-tiling) dequantises a seeded layer packed by torch's own op and compares it with
the values it packed, outside any graph capture; a kernel that fails or disagrees leaves
that kind to torch's op, the reason logged as ``kernels.cuda_int4_tiles_fallback``. No
Triton, or ``HELEXA_TRITON_INT4=0``: torch's op. Int4Linear.prepare runs the probe at load.
The tests run the kernel's source on CPU through Triton's interpreter, over a replica of
torch's CUDA packing (tests/support/tinygemm.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from helexa.kernels import cuda as cuda_kernels

ROWS = 64  # more rows than this take the tiles (a decode step's keep torch's op)
TILE_BYTES = 16 << 20  # bf16 bytes of one dequantised tile

Op = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
# (device, group, inner) -> "" or why torch's op serves
_verdicts = cuda_kernels.Verdicts(
    "kernels.cuda_int4_tiles", "int4 prefill: dequantised tiles on cuBLAS",
    "int4 prefill: torch's op",
    lambda key: {"device": str(key[0]), "group": key[1], "inner_k_tiles": key[2]})


def unavailable() -> str:
    """"" where the kernel can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_INT4", "_int4_tiles_triton")


def dequantize(packed: torch.Tensor, scales_zeros: torch.Tensor, n0: int, n1: int,
               group_size: int, interpret: bool = False) -> torch.Tensor:
    """Rows n0..n1 (multiples of 8, or n1 the layer's last) of the weight packed for torch's
    CUDA int4 op, [n1 - n0, K] in the scales' dtype."""
    from helexa.kernels.cuda import _int4_tiles_triton

    inner, k_super = packed.shape[3] * 2, packed.shape[1]
    k = k_super * inner * 16
    out = torch.empty(n1 - n0, k, dtype=scales_zeros.dtype, device=packed.device)
    _int4_tiles_triton.build(interpret)[(-(-(n1 - n0) // 8), k_super)](
        packed, scales_zeros, out, n1, n0, k_super, scales_zeros.stride(0), out.stride(0),
        INNER=inner, G=group_size)
    return out


def tiled(x: torch.Tensor, packed: torch.Tensor, group_size: int, n: int,
          scales_zeros: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """x [M, K] (the scales' dtype) @ W^T, W dequantised TILE_BYTES at a time: [M, n]."""
    k = x.shape[1]
    out = torch.empty(x.shape[0], n, dtype=scales_zeros.dtype, device=x.device)
    rows = max(8, TILE_BYTES // (k * scales_zeros.element_size()) // 8 * 8)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w = dequantize(packed, scales_zeros, r0, r1, group_size, interpret)
        torch.mm(x, w.t(), out=out[:, r0:r1])
    return out


Pack = Callable[[torch.Tensor, int], torch.Tensor]


def probe(device: torch.device, group_size: int, inner: int, pack: Pack,
          interpret: bool = False) -> str:
    """Dequantise a seeded layer of this kind (40 rows: a ragged last tile of 8; K of two
    super-tiles, or two groups) that ``pack`` (torch's CUDA packing, at ``inner`` k-tiles)
    packed, against the values packed: "" when they agree to the scales' rounding, else
    why not."""
    from helexa.kernels.quant import dequantize_int4  # (quant imports this module)

    gen = torch.Generator().manual_seed(group_size * 10 + inner)
    k = 2 * max(group_size, inner * 16)
    q = torch.randint(0, 16, (40, k), generator=gen, dtype=torch.int32)
    s = torch.rand(k // group_size, 40, generator=gen) * 0.02 + 1e-3
    z = torch.randn(k // group_size, 40, generator=gen) * 0.01
    sz = torch.stack([s, z], dim=-1).to(torch.bfloat16)  # [K / G, N, 2], as the op reads
    want = dequantize_int4(q, sz[..., 0].t(), sz[..., 1].t(), group_size)
    sz = sz.to(device)
    try:
        packed = pack(q.to(device), inner)
        got = torch.cat([dequantize(packed, sz, 0, 32, group_size, interpret),
                         dequantize(packed, sz, 32, 40, group_size, interpret)]).float().cpu()
        cuda_kernels.settled(device)
    except Exception as e:  # noqa: BLE001 - any failure: torch's op serves, said why
        return f"the Triton int4 dequantisation failed ({type(e).__name__}: {e})"
    err = float((got - want).abs().max() / want.abs().max())
    return "" if err < 1e-2 else f"the Triton int4 dequantisation is off by {err:.2g}"


def linear(x: torch.Tensor, packed: torch.Tensor, group_size: int, n: int,
           scales_zeros: torch.Tensor, op: Op, pack: Pack) -> torch.Tensor:
    """x [M, K] on a CUDA device @ W^T: the tiles for more than ROWS rows where the kernel
    proved itself on this card (never in a graph capture), else ``op`` (torch's)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if x.shape[0] <= ROWS or unavailable() or capturing:
        return op(x, packed, group_size, scales_zeros)
    if verdict(x.device, group_size, packed.shape[3] * 2, pack):
        return op(x, packed, group_size, scales_zeros)
    return tiled(x, packed, group_size, n, scales_zeros)


def verdict(device: torch.device, group_size: int, inner: int, pack: Pack,
            interpret: bool = False) -> str:
    """What serves this kind's many-row products: "" the tiles, else why torch's op (the
    probe runs once a kind, outside a graph capture; Int4Linear.prepare calls it at load)."""
    return _verdicts.decide((device, group_size, inner),  # (a prefill's every layer asks)
                            lambda: probe(device, group_size, inner, pack, interpret))


def prepare(packed: torch.Tensor, group_size: int, pack: Pack) -> None:
    """At load: the verdict for a layer's (or an expert stack's) kind, where the tiles can
    run (a CUDA weight in torch's layout, Triton importable), so that no prefill probes."""
    if packed.device.type == "cuda" and not unavailable():
        verdict(packed.device, group_size, packed.shape[-1] * 2, pack)


def describe(device: torch.device) -> str:
    """What serves int4 products of many rows on ``device``, for the executor's describe()
    ("" before any int4 kind was proved there)."""
    return _verdicts.describe(device, unavailable())
