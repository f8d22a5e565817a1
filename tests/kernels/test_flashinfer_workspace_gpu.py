"""On a GPU with FlashInfer: the graph decode wrappers' float scratch that helexa allocates
(helexa/checkpoint/memory.py flashinfer_graph_workspace_bytes, read from FlashInfer
0.6.13's scheduler.cuh) holds FlashInfer's own plan at the largest batch, and the plan's
need is what the formula says: nine tenths of its partial outputs' bytes overflow. Skipped
where no CUDA device and FlashInfer are (bench/gpu_check.sh's machine runs it)."""

from __future__ import annotations

import pytest
import torch

from helexa.checkpoint.memory import flashinfer_graph_workspace_bytes
from helexa.kernels.backends import cuda

pytestmark = pytest.mark.skipif(not cuda.available(), reason=(
    f"needs a CUDA device and FlashInfer ({cuda.import_error() or 'not installed'})"))


def _plan_graph_decode(workspace_bytes: int, heads: int, kv_heads: int, head_dim: int,
                       rows: int) -> None:
    """A cuda-graph tensor-core decode wrapper over ``workspace_bytes`` of float scratch,
    planned for ``rows`` rows of one page each, as helexa's graph wrappers are."""
    import flashinfer

    dev = torch.device("cuda")
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
    indptr = torch.arange(rows + 1, dtype=torch.int32, device=dev)
    indices = torch.arange(rows, dtype=torch.int32, device=dev)
    last = torch.ones(rows, dtype=torch.int32, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr.cpu(), indices, last.cpu(), heads, kv_heads, head_dim, 16,
                 pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)
    torch.cuda.synchronize()


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rows"), [
    (64, 8, 128, 512),  # Qwen3-32B's layout at 512 slots: past the 256 MiB floor
    (24, 4, 256, 640),  # Qwen3.5-27B's attention
])
def test_the_graph_scratch_holds_flashinfers_plan_and_no_more_than_it_needs(
        heads: int, kv_heads: int, head_dim: int, rows: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    planned = flashinfer_graph_workspace_bytes(heads, kv_heads, head_dim, rows, sms)
    _plan_graph_decode(planned, heads, kv_heads, head_dim, rows)  # fits
    group = heads // kv_heads
    tile = 128 if group > 64 and head_dim < 256 else 64 if group > 16 else 16
    splits = max(2 * sms // kv_heads, -(-rows * group // tile) + rows - 1)
    partial_outputs = heads * splits * tile * head_dim * 4
    with pytest.raises(Exception, match="(?i)overflow"):
        _plan_graph_decode(partial_outputs * 9 // 10, heads, kv_heads, head_dim, rows)
