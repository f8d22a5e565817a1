"""Which KV pools FlashInfer's kernels read on a cuda backend (helexa/kernels/backends/cuda.py).

A pool stored in the queries' own float dtype. Any other, a quantised kind (per-token
scales, which FlashInfer's fp8 layout has no room for) or another float dtype, runs the
torch path. A quantised pool's writes and decode rows run Triton kernels there
(helexa/kernels/cuda/quant_decode.py) and its decode steps are captured as CUDA graphs
like FlashInfer's, where those kernels' probes agree at load; a float pool of another
dtype runs every decode step eagerly, with no CUDA graph to capture, so ``helexa plan``
counts no graph pool for it and says why.
"""

from __future__ import annotations

FLOAT_KV = ("fp32", "fp16", "bf16")
# programs the quantised-KV decode kernel aims for across a step's rows and kv heads
# (about two a streaming multiprocessor on an H100); it launches at most this many plus
# one a (row, kv head), which bounds a captured step's split scratch (memory.py)
SPLIT_PROGRAMS = 264


def torch_path_kv(kv_dtype: str, float_dtype: str) -> str:
    """"" where FlashInfer reads a ``kv_dtype`` pool beside ``float_dtype`` queries; else
    what makes it the torch path's."""
    if kv_dtype == float_dtype:
        return ""
    if kv_dtype in FLOAT_KV:
        return f"KV {kv_dtype} with {float_dtype} queries"
    return f"quantised KV ({kv_dtype})"


def graphs_off(kv_dtype: str, float_dtype: str) -> str:
    """"" where a cuda backend captures decode graphs over a ``kv_dtype`` pool beside
    ``float_dtype`` queries (FlashInfer's, or a quantised pool's Triton kernels); else why
    every decode step runs eagerly."""
    return "" if kv_dtype not in FLOAT_KV else torch_path_kv(kv_dtype, float_dtype)
