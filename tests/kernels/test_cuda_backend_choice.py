"""The cuda backend's choices, checked on CPU against a stand-in ``flashinfer`` module.

No GPU here: the stand-in records the arguments each FlashInfer wrapper is built and
planned with, so the test sees which decode kernel a (GQA group, dtype, head_dim) gets,
and which models the backend selection sends to the torch backend instead (and says why).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels import backends
from helexa.kernels.backends import cuda
from helexa.kernels.backends.base import StepPlan
from helexa.kernels.backends.cuda import CudaAttention


class _Wrapper:
    def __init__(self, log: list[dict[str, Any]], kind: str, workspace: torch.Tensor,
                 layout: str, **kwargs: Any) -> None:
        self.record: dict[str, Any] = {"kind": kind, "layout": layout, **kwargs, "plans": []}
        log.append(self.record)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.record["plans"].append((args, kwargs))


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    built: list[dict[str, Any]] = []
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.6.13-standin"  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _Wrapper(built, "decode", ws, layout, **kw))
    mod.BatchPrefillWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _Wrapper(built, "prefill", ws, layout, **kw))
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(cuda, "flashinfer", mod)
    return built


def _backend(heads: int, kv_heads: int, head_dim: int, *, storage: torch.dtype,
             compute: torch.dtype, graph_rows: int = 0) -> CudaAttention:
    att = CudaAttention(torch.device("cpu"), graph_rows=graph_rows)
    att.heads = heads
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    att.allocate_kv([AttentionSpec(kv_heads, head_dim, names[storage])] * 2, 8, 16,
                    storage=storage, compute=compute)
    return att


def _decode_step(rows: int) -> StepPlan:
    return StepPlan(slot_mapping=torch.arange(rows), decode_positions=[3] * rows,
                    decode_tables=[[i] for i in range(rows)], block_size=16, num_blocks=8)


@pytest.mark.parametrize(("heads", "kv_heads", "tensor_cores"), [
    (4, 4, False), (8, 4, False), (6, 2, False), (16, 4, False), (32, 4, False),
    (24, 4, True),  # Qwen3.5-27B: group 6 (also 6 per rank at tp = 2)
    (28, 4, True),  # Qwen2.5-7B: group 7
    (20, 4, True), (64, 4, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_runs_on_tensor_cores_where_the_cuda_core_kernel_cannot(
        fake_flashinfer: list[dict[str, Any]], heads: int, kv_heads: int, tensor_cores: bool,
        dtype: torch.dtype, head_dim: int) -> None:
    att = _backend(heads, kv_heads, head_dim, storage=dtype, compute=dtype, graph_rows=2)
    meta = att.plan(_decode_step(3))  # 3 rows > graph_rows: the plain decode wrapper
    decode = [w for w in fake_flashinfer if w["kind"] == "decode"]
    assert [w.get("use_tensor_cores") for w in decode] == [tensor_cores]
    (args, kwargs), = decode[0]["plans"]
    assert args[3:7] == (heads, kv_heads, head_dim, 16)
    assert kwargs["q_data_type"] == kwargs["kv_data_type"] == dtype
    assert meta.wrapper is not None
    att.plan(_decode_step(2))  # the cuda-graph wrapper chooses the same kernel
    graph = [w for w in fake_flashinfer if w.get("use_cuda_graph")]
    assert [w["use_tensor_cores"] for w in graph] == [tensor_cores]
    kernel = "tensor cores" if tensor_cores else "CUDA cores"
    assert att.describe() == (f"flashinfer 0.6.13-standin; decode on {kernel} "
                              f"(GQA group {heads // kv_heads})")


def test_kv_of_another_dtype_than_the_queries_runs_the_torch_path(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    att = _backend(24, 4, 128, storage=torch.float16, compute=torch.bfloat16)
    meta = att.plan(_decode_step(1))
    assert meta.backend is att.reference  # attention() reaches the torch path directly
    assert not [w for w in fake_flashinfer if w["kind"] == "decode"]
    assert att.describe() == ("flashinfer 0.6.13-standin; KV float16 with bfloat16 queries: "
                              "torch path")


@pytest.mark.parametrize(("dtype", "head_dim", "reason"), [
    (torch.float32, 128, "FlashInfer has no float32 kernels (fp16, bf16 only)"),
    (torch.bfloat16, 96, "FlashInfer has no kernels for head_dim 96 (64, 128, 256, 512 only)"),
    (torch.float16, 80, "FlashInfer has no kernels for head_dim 80 (64, 128, 256, 512 only)")])
@pytest.mark.parametrize("asked", ["auto", "cuda"])
def test_selection_runs_torch_for_a_model_flashinfer_cannot_serve(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        dtype: torch.dtype, head_dim: int, reason: str, asked: str) -> None:
    monkeypatch.setattr(cuda, "available", lambda: True)  # as on a GPU host with FlashInfer
    shape = backends.AttentionShape(24, 4, head_dim, dtype)
    device = backends.select(asked, torch.device("cuda"), shape=shape)
    assert device.name == "torch"
    assert device.describe() == f"torch (not cuda: {reason})"
    assert not fake_flashinfer  # no FlashInfer wrapper was built


@pytest.mark.parametrize("head_dim", cuda.HEAD_DIMS)
@pytest.mark.parametrize("dtype", cuda.DTYPES)
def test_flashinfer_serves_its_dtypes_and_head_sizes(head_dim: int, dtype: torch.dtype) -> None:
    assert cuda.unsupported(backends.AttentionShape(24, 4, head_dim, dtype)) == ""
