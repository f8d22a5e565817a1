"""One-kernel RMSNorm, residual add + RMSNorm and SiLU-and-mul on CUDA (FlashInfer's).

The models' torch forms are several small kernels each: an RMSNorm in fp32 is a cast, a
reduction, the eps add, the rsqrt, the scaling and a cast back (7 launches with its
weight), the residual add one more, SwiGLU's gate two. A dense decoder layer ran ~39
kernels a decode step, ~27 of them these, on the first GPU run (bench/gpu_check.sh, an
H200: 233 a step for 6 layers, 0.44 of the weight-streaming roofline at batch 1), and in a
launch-bound step each costs a few microseconds whatever its size. :func:`install` gives
the loaded model's modules FlashInfer's kernels through the seams the models keep for it
(helexa/neuron/models/layers.py): ``RMSNorm.kernel`` (``flashinfer.rmsnorm``, 2-D rows or
3-D heads with their strides, so a q/k norm reads the projection's view in place),
``RMSNorm.add_kernel`` (``flashinfer.fused_add_rmsnorm``: the residual stream gains the
layer's output and the next norm is taken in one pass, in place: both tensors are the
step's own) and an MLP's ``silu_and_mul``. At tp > 1 the norm all-reduces before its add
kernel, unless cuda_comm.py's one-kernel all-reduce + add + norm takes the step.

Where they run: bf16 or fp16 weights (FlashInfer's norm kernels take those) and a norm
width a multiple of 8 (its 16-byte vector loads); anything else keeps the torch form, as
does any call whose tensors the kernel would not read (another dtype, a last dim that is
not contiguous). FlashInfer computes the norm in fp32 and scales by the weight before the
one rounding, where transformers rounds first: results agree to bf16 rounding.
``HELEXA_CUDA_FUSED=0`` leaves every module its torch form (a diagnostic switch: the GPU
check measures both side by side).

FlashInfer's calls sit behind :class:`FusedOps` so that CPU tests can stand in for them.
"""

from __future__ import annotations

import math
import os
from typing import Any

import structlog
import torch

# the head sizes FlashInfer's rope kernel is built for (helexa plan counts its fp32 table)
from helexa.checkpoint.step_memory import ROPE_HEAD_DIMS

log = structlog.get_logger(component="kernels")

DTYPES = (torch.bfloat16, torch.float16)
ENV = "HELEXA_CUDA_FUSED"


class FusedOps:
    """FlashInfer's three kernels (a test stands in torch forms of them)."""

    def __init__(self) -> None:
        import flashinfer

        self.fi = flashinfer

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None) -> torch.Tensor:
        return self.fi.rmsnorm(x, weight, eps, out=out)

    def fused_add_rmsnorm(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> None:
        self.fi.fused_add_rmsnorm(y, x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.fi.silu_and_mul(x)

    def apply_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> None:
        """q [N, h, d], k [N, kvh, d] rotated in place (their leading cos_sin_cache.shape[1]
        dims, rotate-half pairs), in one launch."""
        self.fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1],
                                                       cos_sin_cache, is_neox=True)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _is_norm(m: torch.nn.Module) -> bool:
    """An RMSNorm with the models' seams (helexa/neuron/models/layers.py, a layer above)."""
    return all(hasattr(m, a) for a in ("kernel", "add_kernel", "folded", "eps", "weight"))


def _rows_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return (t.dtype == dtype and t.dim() in (2, 3) and t.stride(-1) == 1
            and _aligned(t))


def _aligned(t: torch.Tensor) -> bool:
    """Where FlashInfer's CuTe-DSL norms assume their rows start: 16 bytes, and a
    contiguous 2-D tensor gcd(128, a row's bytes) (one row sliced from a wider tensor is
    contiguous, yet can start anywhere). Anything else takes the torch form. Off a GPU
    (a stand-in's tests) the start within the storage stands for the address, as torch's
    CUDA allocations start 512-byte aligned."""
    need = 16
    if t.dim() == 2 and t.is_contiguous():
        need = max(16, math.gcd(128, t.shape[-1] * t.element_size()))
    start = t.data_ptr() if t.is_cuda else t.storage_offset() * t.element_size()
    return start % need == 0


def install(model: torch.nn.Module, dtype: torch.dtype, ops: FusedOps | None = None) -> str:
    """Give the model's norms and MLPs the fused kernels; returns the describe line."""
    if not enabled():
        return f"norms, SiLU: torch ({ENV}=0)"
    if dtype not in DTYPES:
        return f"norms, SiLU: torch ({str(dtype).removeprefix('torch.')} weights)"
    first = next((m for m in model.modules() if _is_norm(m)), None)
    if first is None:
        return ""
    try:  # a first call of each builds (JIT) and proves them before any graph holds them
        ops = ops or FusedOps()
        dev = first.weight.device
        probe = torch.randn(2, 64, dtype=dtype, device=dev)
        w = torch.ones(64, dtype=dtype, device=dev)
        ops.rmsnorm(probe, w, 1e-6, None)
        ops.fused_add_rmsnorm(probe.clone(), probe.clone(), w, 1e-6)
        ops.silu_and_mul(probe)
    except Exception as e:  # noqa: BLE001 - any failure: the torch forms run, said why
        log.warning("kernels.fused_ops", fused=False, reason=f"{type(e).__name__}: {e}")
        return f"norms, SiLU: torch (FlashInfer's kernels failed: {type(e).__name__})"
    ones: dict[int, torch.Tensor] = {}

    def weight_of(norm: Any, w: torch.Tensor | None) -> torch.Tensor:
        if w is not None:
            return w
        n = norm.weight.shape[-1]
        if n not in ones:  # a folded norm scales by nothing
            ones[n] = torch.ones(n, dtype=dtype, device=norm.weight.device)
        return ones[n]

    def kernel_for(norm: Any) -> Any:
        def kernel(x: torch.Tensor, w: torch.Tensor | None, eps: float,
                   out: torch.Tensor | None) -> torch.Tensor | None:
            if not _rows_ok(x, dtype) or (out is not None and not _rows_ok(out, dtype)):
                return None
            return ops.rmsnorm(x, weight_of(norm, w), eps, out)
        return kernel

    def add_for(norm: Any) -> Any:
        def add(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None,
                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
            if (y.dim() != 2 or not y.is_contiguous() or not x.is_contiguous()
                    or y.dtype != dtype or x.dtype != dtype or y.shape != x.shape
                    or not _aligned(x) or not _aligned(y)):
                return None
            ops.fused_add_rmsnorm(y, x, weight_of(norm, w), eps)  # x += y; y = norm(x)
            return y, x
        return add

    norms = mlps = 0
    for m in model.modules():
        if _is_norm(m) and m.weight.shape[-1] % 8 == 0 and m.weight.dtype == dtype:
            m.kernel = kernel_for(m)
            m.add_kernel = add_for(m)
            norms += 1
        elif hasattr(m, "silu_and_mul") and hasattr(m, "gate_up_proj"):
            m.silu_and_mul = ops.silu_and_mul
            mlps += 1
    log.info("kernels.fused_ops", norms=norms, mlps=mlps)
    return "norms, residual add + norm, SiLU: FlashInfer kernels"


def install_rope(model: torch.nn.Module, dtype: torch.dtype,
                 ops: FusedOps | None = None) -> str:
    """Give the model's rotary table FlashInfer's one-launch rope (q and k rotated in place
    together, in fp32 from an fp32 cos/sin table, where the torch form is three kernels
    for the pair, six where q and k are rotated apart), after one probe step agrees with
    the torch form; returns the describe line ("" for a model without a rotary table)."""
    rotary: Any = getattr(model, "rotary", None)
    attention = getattr(model, "attention_layers", None)
    if rotary is None or not attention:
        return ""
    if not enabled():
        return f"rope: torch ({ENV}=0)"
    head_dim = attention[0].head_dim
    if dtype not in DTYPES or head_dim not in ROPE_HEAD_DIMS or rotary.head_dim % 2:
        return "rope: torch (FlashInfer's rope does not take this dtype or head size)"
    try:
        ops = ops or FusedOps()
        cache = rotary.kernel_cache()  # probed, then installed: built once
        why = _probe_rope(rotary, ops, head_dim, dtype, cache)
        said = why
    except Exception as e:  # noqa: BLE001 - any failure: the torch form runs, said why
        why, said = f"rope failed ({type(e).__name__}: {e})", f"rope failed: {type(e).__name__}"
    if why:
        log.warning("kernels.fused_rope", fused=False, reason=why)
        return f"rope: torch (FlashInfer's {said})"
    rotary.use_kernel(ops.apply_rope, cache)
    log.info("kernels.fused_rope", fused=True, rotary_dim=rotary.head_dim)
    return "rope: FlashInfer kernel"


def _probe_rope(rotary: Any, ops: FusedOps, head_dim: int, dtype: torch.dtype,
                cache: torch.Tensor) -> str:
    """Rotate a small q and k at far-apart positions with the kernel and with the torch
    form (the table's own rows): "" when they agree to bf16 rounding, else why not."""
    from helexa.kernels.gated_delta import rel_error
    from helexa.kernels.rotary import Rotation

    gen = torch.Generator().manual_seed(0)
    dev = rotary.device
    positions = torch.tensor([0, 7, rotary.length - 1], device=dev)
    q = torch.randn(3, 2, head_dim, generator=gen).to(dtype).to(dev)
    k = torch.randn(3, 1, head_dim, generator=gen).to(dtype).to(dev)
    cos, sin = rotary.cos_sin(positions)
    want_q, want_k = Rotation(cos.unsqueeze(1), sin.unsqueeze(1)).pair(q, k)
    got_q, got_k = q.clone(), k.clone()
    ops.apply_rope(positions, got_q, got_k, cache)
    err = max(rel_error(got_q, want_q), rel_error(got_k, want_k))
    return "" if err < 2e-2 else f"rope is off by {err:.2g} (relative)"
