"""A Gated DeltaNet layer's output norm, rmsnorm(o) * weight * silu(z) per value head: the
torch form the reference models round like, and flash-linear-attention's (``fla-core``)
one gated RMSNorm kernel where installed (CUDA only, import-guarded), proved against it
at load (``probe_fla_norm``) and switched off for the process where it fails or
disagrees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helexa.kernels.gated_delta import rel_error
from helexa.kernels.norm import rms_norm

try:  # fla's gated RMSNorm (Triton): norm, weight and SiLU gate in one kernel
    from fla.modules.fused_norm_gate import rms_norm_gated as _fla_norm_gated
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _fla_norm_gated = None
# fla's kernel tunes itself (9 builds, timed on the card) for each 65,536 rows of its input
# (a token's value heads are rows): its key holds that bucket. A long prefill's norm is
# run in parts of at most that many, the one bucket the load's probe tuned, never tuned
# again mid-serving.
FLA_NORM_ROWS = 2048 * 32


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """A Gated DeltaNet layer's output norm per value head: rmsnorm(o) * weight * silu(z).
    o [N, v_heads, v_dim] fp32, z [N, v_heads * v_dim] -> [N, v_heads, v_dim] in ``dtype``.
    The torch form rounds as the reference models do (the norm to ``dtype`` before the
    weight); on CUDA with fla installed one kernel (fp32 inside, one rounding) replaces its
    ~12."""
    if not fla_norm_available(o.device):
        return _gated_rms_norm_torch(o, z, weight, eps, dtype)
    assert _fla_norm_gated is not None
    z = z.reshape(o.shape)
    part = max(1, FLA_NORM_ROWS // o.shape[1])  # tokens a call: the bucket the probe tuned
    if o.shape[0] <= part:
        return _fla_norm_gated(o, z, weight, None, activation="swish", eps=eps).to(dtype)
    return torch.cat([_fla_norm_gated(o[i:i + part], z[i:i + part], weight, None,
                                      activation="swish", eps=eps).to(dtype)
                      for i in range(0, o.shape[0], part)])


def _gated_rms_norm_torch(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    y = rms_norm(o, None, eps).to(dtype) * weight
    return (y.float() * F.silu(z.reshape(o.shape).float())).to(dtype)


def fla_norm_available(device: torch.device) -> bool:
    """fla's gated RMSNorm runs for this device (gated_rms_norm): CUDA, the kernel imported
    (and not switched off by its probe)."""
    return _fla_norm_gated is not None and device.type == "cuda"


def probe_fla_norm(device: torch.device, value_heads: int, value_dim: int, dtype: torch.dtype,
                   tol: float = 2e-2) -> str:
    """Run fla's gated RMSNorm once at a layer's sizes against the torch form, wherever it
    would run (fla_norm_available), whatever the decode kernels' probes said: "" when it
    agrees (or does not run); else why, and it is switched off for the process (the torch
    form runs), so it never fails or skews a step."""
    global _fla_norm_gated
    if not fla_norm_available(device):
        return ""
    assert _fla_norm_gated is not None
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(2, value_heads * value_dim, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(value_dim, generator=gen)).to(dtype)
    why = ""
    try:  # o in fp32 (fla's and the torch forms' outputs), then in the model's dtype
        # (FlashInfer's pool decode's): each a build and tuning of its own, both done here
        for o_dtype in dict.fromkeys((torch.float32, dtype)):
            o = torch.randn(2, value_heads, value_dim, generator=gen).to(o_dtype)
            got = _fla_norm_gated(o.to(device), z.to(device).reshape(o.shape), w.to(device),
                                  None, activation="swish", eps=1e-6).to(dtype).cpu()
            err = rel_error(got, _gated_rms_norm_torch(o.float(), z, w, 1e-6, dtype))
            if err >= tol:
                why = f"fla's gated norm is off by {err:.2g} (relative)"
                break
    except Exception as e:  # noqa: BLE001 - any failure: the torch form runs, said why
        why = f"fla's gated norm failed ({type(e).__name__}: {e})"
    if why:
        _fla_norm_gated = None
    return why
