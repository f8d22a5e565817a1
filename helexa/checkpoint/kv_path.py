"""Which KV pools FlashInfer's kernels read on a cuda backend (helexa/kernels/backends/cuda.py).

A pool stored in the queries' own float dtype. Any other, a quantised kind (per-token
scales, which FlashInfer's fp8 layout has no room for) or another float dtype, runs the
torch path: every decode step eagerly, with no CUDA graph to capture, so ``helexa plan``
counts no graph pool for it and says why.
"""

from __future__ import annotations

FLOAT_KV = ("fp32", "fp16", "bf16")


def torch_path_kv(kv_dtype: str, float_dtype: str) -> str:
    """"" where FlashInfer reads a ``kv_dtype`` pool beside ``float_dtype`` queries; else
    what makes it the torch path's."""
    if kv_dtype == float_dtype:
        return ""
    if kv_dtype in FLOAT_KV:
        return f"KV {kv_dtype} with {float_dtype} queries"
    return f"quantised KV ({kv_dtype})"
