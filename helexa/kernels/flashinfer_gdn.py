"""FlashInfer's Gated DeltaNet decode over a pool of states (flashinfer.gdn_decode).

For a step of decode rows alone, one kernel per layer reads each row's recurrent state
from its slot of the layer's pool and writes it back in place, with the L2 norms of q and
k, q's k_dim^-0.5 scale and the gates (gated_delta.gates' formulas) inside: no gather and
scatter of the states runs around it, where fla's kernel needs both. Its bf16-state
kernels (CuTe DSL, Hopper and newer) take heads of 128 x 128, as Qwen3.5's are. Its pool
is V-major, [slots, v_heads, v_dim, k_dim] (linear_state.LinearState.pool); the torch
forms read the same storage through the transposed view. The state backend
(helexa/kernels/backends/gdn.py) proves it at load against the torch forms
(``probe_fi_pool``) before any request runs on it. Import-guarded and imported on first
use: CPU never needs it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from helexa.kernels.gated_delta import (
    GateInputs,
    delta_rule_decode,
    gates,
    l2norm,
    rel_error,
)

# imported on first use (its CuTe DSL takes seconds to import; only hybrids on CUDA ask)
_fi_gdn: Any = None
_fi_gdn_tried = False
FI_GDN_ENV = "HELEXA_FLASHINFER_GDN"  # "0": never use it (the GPU check's side-by-side run)

FI_POOL_DIM = 128  # its bf16-state kernels are built for k_dim = v_dim = 128 only


def _fi_module() -> Any:
    """FlashInfer's gdn_decode module, imported once (None where it does not import)."""
    global _fi_gdn, _fi_gdn_tried
    if _fi_gdn is None and not _fi_gdn_tried:
        _fi_gdn_tried = True
        try:
            from flashinfer import gdn_decode

            _fi_gdn = gdn_decode
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _fi_gdn = None
    return _fi_gdn


def fi_pool_unavailable(device: torch.device, dtype: torch.dtype, key_dim: int,
                        value_dim: int) -> str:
    """Why FlashInfer's pool decode (fi_decode_pool) cannot serve these layers ("" when it
    can): it needs CUDA on Hopper or newer, FlashInfer with its CuTe DSL kernels, bf16
    states, and heads of 128 x 128; ``HELEXA_FLASHINFER_GDN=0`` turns it off."""
    if device.type != "cuda":
        return "not a CUDA device"
    if os.environ.get(FI_GDN_ENV, "1") == "0":
        return f"{FI_GDN_ENV}=0"
    module = _fi_module()
    if module is None:
        return "FlashInfer is not installed"
    if not getattr(module, "_GDN_DECODE_BF16_STATE_AVAILABLE", False):
        return "FlashInfer's bf16-state Gated DeltaNet kernels did not import (CuTe DSL)"
    if dtype != torch.bfloat16:
        return f"its kernels keep bf16 states, the model's are {str(dtype).removeprefix('torch.')}"
    if key_dim != FI_POOL_DIM or value_dim != FI_POOL_DIM:
        return f"its kernels take heads of 128 x 128, these are {key_dim} x {value_dim}"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "its kernels need compute capability 9.0 or newer"
    return ""


def fi_rows(n: int) -> int:
    """The batch FlashInfer's pool kernel runs a step of ``n`` decode rows at: 1, 2, 4, then
    the next multiple of 8. It compiles one kernel per batch size (its cache key holds B;
    ~10 s each by its own CI's figures, FlashInfer issue 4110), so a step pads up to one of
    these (the extra rows on the pool's scratch slot) and max_slots = 64 builds 11 kernels
    at load, not 64."""
    if n <= 4:
        return 1 << max(n - 1, 0).bit_length()
    return -(-n // 8) * 8


def fi_decode_pool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw: GateInputs,
                   a_log: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                   scratch: int | None = None) -> torch.Tensor:
    """A whole pure-decode step on FlashInfer's pool kernel, its inputs as the conv gives
    them: q, k [B, key_heads, dk] not yet normalised (it takes the L2 norms and q's
    k_dim^-0.5 scale), v [B, v_heads, dv], the gates raw (with ``a_log``, the layer's A_log
    in fp32); row b's state is slot ``slots[b]`` (int32) of ``pool`` [slots, v_heads, dv,
    dk], read and written in place. With a ``scratch`` slot (one no request holds) the
    step runs at :func:`fi_rows` rows, the padding rows zeros on that slot. Returns o [B,
    v_heads, dv] in v's dtype: a view of FlashInfer's own output buffer for this batch
    size, which its next call of that size (the next layer's) rewrites, so the caller
    uses it before that call (each layer does, before the next layer runs)."""
    module = _fi_module()
    assert module is not None
    n = q.shape[0]
    pad = fi_rows(n) - n if scratch is not None else 0
    a, b = raw.a, raw.b
    if pad:  # zeros: finite through the norms and gates, and only the scratch slot moves
        q, k, v, a, b = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (q, k, v, a, b))
        slots = torch.cat([slots, slots.new_full((pad,), scratch)])
    q, k, v, a, b = (_aligned(x[:, None]) for x in (q, k, v, a, b))
    o, _ = module.gated_delta_rule_decode_pretranspose(
        q=q, k=k, v=v, state=None, A_log=a_log, a=a, dt_bias=raw.dt_bias, b=b,
        scale=q.shape[-1] ** -0.5, use_qk_l2norm=True, initial_state=pool,
        initial_state_indices=slots)
    return o[:n, 0]


def warm_fi_pool(pool: torch.Tensor, key_heads: int, key_dim: int, rows: int,
                 scratch: int) -> list[int]:
    """Build FlashInfer's kernel for every batch a decode step of 1..``rows`` rows runs at
    (:func:`fi_rows`) over ``pool`` (a layer's [slots + 1, v_heads, v_dim, k_dim], its last
    slot ``scratch``; every layer's has its shape) now, at load: it compiles one per batch
    size and pool shape on first use (seconds each), which a step of a new size would
    otherwise wait for mid-serving. Runs zeros through slots 0..rows - 1, then zeroes the
    pool (no request holds a slot yet); returns the batch sizes built."""
    vh, dv = pool.shape[1], pool.shape[2]
    dtype, dev = pool.dtype, pool.device
    a_log = torch.zeros(vh, dtype=torch.float32, device=dev)
    sizes = sorted({fi_rows(b) for b in range(1, rows + 1)})
    for size in sizes:
        b = min(size, rows)  # padded up to size on the scratch slot
        zeros = GateInputs(torch.zeros(b, vh, dtype=dtype, device=dev),
                           torch.zeros(b, vh, dtype=dtype, device=dev), a_log,
                           torch.zeros(vh, dtype=dtype, device=dev))
        q = torch.zeros(b, key_heads, key_dim, dtype=dtype, device=dev)
        fi_decode_pool(q, q.clone(), torch.zeros(b, vh, dv, dtype=dtype, device=dev), zeros,
                       a_log, pool, torch.arange(b, dtype=torch.int32, device=dev), scratch)
    pool.zero_()
    return sizes


FI_ALIGN = 32  # bytes: FlashInfer's CuTe launcher declares its tensors so aligned


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous at a FI_ALIGN-byte address, copied only where it is not (a, b are views
    into the layer's projection: at 24 value heads a row's a starts 48 bytes past b's),
    with a contiguous tensor's strides: a row of one is a view whose batch stride is the
    projection's width, which addresses nothing but is not what the kernel was built on
    (warm_fi_pool's fresh tensors); its view with those strides is free."""
    if not (x.is_contiguous() and x.data_ptr() % FI_ALIGN == 0):
        return x.clone(memory_format=torch.contiguous_format)
    strides = [1] * x.dim()
    for d in range(x.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * x.shape[d + 1]
    return x if list(x.stride()) == strides else x.as_strided(x.shape, strides)


def probe_fi_pool(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                  value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run FlashInfer's pool decode once on a small pool at a layer's sizes against the
    torch forms: two rows reading and writing slots 2 and 0 of three. "" when the outputs,
    the two slots' new states and the untouched slot 1 all agree; else why not."""
    gen = torch.Generator().manual_seed(0)
    kh, vh, dk, dv = key_heads, value_heads, key_dim, value_dim
    slots = [2, 0]
    q, k = (torch.randn(2, kh, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(2, vh, dv, generator=gen).to(dtype)
    raw = GateInputs(*(torch.randn(*shape, generator=gen).to(dtype)
                       for shape in ((2, vh), (2, vh), (vh,), (vh,))))
    pool = torch.randn(3, vh, dv, dk, generator=gen).to(dtype)  # V-major, as the kernel's
    states = pool[slots].transpose(-1, -2).float()  # [2, vh, dk, dv]
    g, beta = gates(raw)
    want = delta_rule_decode((l2norm(q.float()) * dk ** -0.5).repeat_interleave(vh // kh, 1),
                             l2norm(k.float()).repeat_interleave(vh // kh, 1), v, g, beta,
                             states)
    want_pool = pool.clone()
    want_pool[slots] = states.transpose(-1, -2).to(dtype)
    try:
        dev_pool = pool.to(device, copy=True)  # the kernel writes it in place
        got = fi_decode_pool(q.to(device), k.to(device), v.to(device),
                             GateInputs(*(x.to(device) for x in raw)),
                             raw.A_log.float().to(device), dev_pool,
                             torch.tensor(slots, dtype=torch.int32, device=device))
        got_pool = dev_pool.cpu()
    except Exception as e:  # noqa: BLE001 - any failure: the other kernels run, said why
        return f"FlashInfer's pool decode failed ({type(e).__name__}: {e})"
    if not torch.equal(got_pool[1], pool[1]):
        return "FlashInfer's pool decode wrote a slot it was not given"
    err = max(rel_error(got.cpu(), want), rel_error(got_pool, want_pool))
    return "" if err < tol else f"FlashInfer's pool decode is off by {err:.2g} (relative)"
