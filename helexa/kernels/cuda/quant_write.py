"""A step's new K and V quantised into a quantised KV pool on CUDA in one kernel (Triton).

kernels/kv_quant.py's ``write_quantized``, the reference, quantises in torch: the amax,
the scale, the division, the rounding, the clamp and the cast, then two scatters, for K
and again for V: about twenty kernels a layer a step. This kernel
(helexa/kernels/cuda/_quant_write_triton.py) does all of it in one launch, each program a
token and kv head, the same arithmetic in the same order (division correctly rounded,
ties to even), so it writes the reference's bytes and scales.

The cuda backend (helexa/kernels/backends/cuda.py) runs it for a quantised pool where
:func:`probe` agreed on the device at load (the bytes of 7 tokens at the layers' sizes,
odd slots, rows at a stride, against the reference's), else the reference, the reason
logged as ``kernels.quant_write_fallback``. No Triton or ``HELEXA_TRITON_QUANT_WRITE=0``:
the reference. The tests run the kernel's source on CPU through Triton's interpreter. It
is unmeasured on a GPU.
"""

from __future__ import annotations

import torch

from helexa.kernels import cuda as cuda_kernels
from helexa.kernels.paged_kv import PagedKV

# each quantised kv dtype's KIND in the Triton sources (_quant_write_triton.py and
# _quant_decode_triton.py compare KIND with these literals: a kernel reads no global)
KINDS = {"int8": 0, "fp8_e4m3": 1, "int4": 2}


def unavailable() -> str:
    """"" where the kernel can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_QUANT_WRITE", "_quant_write_triton")


def write(kv: PagedKV, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          interpret: bool = False) -> None:
    """As PagedKV.write for a quantised pool: new tokens' k, v [N, kv_heads, head_dim] (any
    float dtype, rows at any stride, each head's dims contiguous) quantised into their
    slots [N]."""
    from helexa.kernels.cuda import _quant_write_triton as src

    n, kvh, d = k.shape
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    ns = kv.k_scale.shape[-1]
    assert kv.k_data.is_contiguous() and kv.k_scale.is_contiguous()
    src.build(interpret)[(n, kvh)](
        k, v, slot_mapping, kv.k_data, kv.k_scale, kv.v_data, kv.v_scale, k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), KV_HEADS=kvh, HEAD_DIM=d,
        DP=cuda_kernels.pow2(d, 16), DATA_DIM=kv.k_data.shape[-1], NUM_SCALES=ns,
        NSP=cuda_kernels.pow2(ns), KIND=KINDS[kv.kv_dtype])


def probe(device: torch.device, kv_dtype: str, kv_heads: int, head_dim: int,
          dtype: torch.dtype, interpret: bool = False) -> str:
    """Seven new tokens (one all zeros, one at the format's edge) written at odd slots by
    the kernel and by the reference at a layer's sizes: "" when every byte and scale
    agrees, else why not (a failure included)."""
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    pools = [PagedKV(4, 4, kv_heads, head_dim, kv_dtype=kv_dtype, storage=None,
                     compute=dtype, device=device) for _ in range(2)]
    wide = torch.randn(7, kv_heads + 1, head_dim, generator=gen) * 4
    wide[2] = 0.0
    wide[5, :, 0] = 1e4
    k = wide.to(device, dtype)[:, 1:]  # rows at a stride, as the qkv split gives them
    v = (torch.randn(7, kv_heads, head_dim, generator=gen) / 3).to(device, dtype)
    slots = torch.tensor([13, 0, 7, 2, 15, 4, 9], device=device)
    pools[0].write(slots, k, v)
    try:
        write(pools[1], slots, k, v, interpret)
        cuda_kernels.settled(device)
    except Exception as e:  # noqa: BLE001 - any failure: the reference serves, said why
        return f"the Triton quantised-KV write failed ({type(e).__name__}: {e})"
    want, got = pools
    for name in ("k_data", "k_scale", "v_data", "v_scale"):
        if not torch.equal(getattr(got, name), getattr(want, name)):
            return f"the Triton quantised-KV write's {name} differs from the reference's"
    return ""


def chosen(device: torch.device, kv_dtype: str, kv_heads: int, head_dim: int,
           dtype: torch.dtype) -> tuple[bool, str]:
    """Whether this kernel writes a quantised pool of these sizes on ``device`` (its probe
    agreed), and why not where it could run here but was refused ("" otherwise)."""
    if device.type != "cuda" or unavailable() or kv_dtype not in KINDS:
        return False, ""
    why = probe(device, kv_dtype, kv_heads, head_dim, dtype)
    return not why, why
