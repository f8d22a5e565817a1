"""The cuda backend's choices, checked on CPU against a stand-in ``flashinfer`` module.

No GPU here: the stand-in records the arguments each FlashInfer wrapper is built and
planned with, so the test sees which decode kernel a (GQA group, dtype, head_dim) gets,
and which models the backend selection sends to the torch backend instead (and says why).
Its ``append_paged_kv_cache`` does what FlashInfer 0.6.13's kernel does (csrc/page.cu,
page.cuh: the slot of row i is the page ``indices[indptr[batch_indices[i]] + positions[i]
// page_size]``, entry ``positions[i] % page_size``) after the checks it makes, and its
cuda-graph wrappers' ``plan`` copies the layout into their buffers as FlashInfer's does: so
the tests see where each step's K/V land, eager and replayed.
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
from helexa.kernels.backends.base import PrefillRow, StepPlan, token_slots
from helexa.kernels.backends.cuda import CudaAttention


class _Wrapper:
    def __init__(self, log: list[dict[str, Any]], kind: str, workspace: torch.Tensor,
                 layout: str, **kwargs: Any) -> None:
        self.record: dict[str, Any] = {"kind": kind, "layout": layout, **kwargs, "plans": []}
        self.kwargs = kwargs
        log.append(self.record)

    def plan(self, *args: Any, **kwargs: Any) -> None:
        self.record["plans"].append((args, kwargs))
        if self.kwargs.get("use_cuda_graph"):  # FlashInfer copies into the fixed buffers
            indptr, indices, last = args[:3]
            self.kwargs["paged_kv_indptr_buffer"].copy_(indptr)
            self.kwargs["paged_kv_last_page_len_buffer"].copy_(last)
            self.kwargs["paged_kv_indices_buffer"][:len(indices)].copy_(indices)

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return q


def _append_paged_kv_cache(key: torch.Tensor, value: torch.Tensor, batch_indices: torch.Tensor,
                           positions: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                           indices: torch.Tensor, indptr: torch.Tensor,
                           last_page_len: torch.Tensor, layout: str = "NHD") -> None:
    k_cache, v_cache = cache
    assert layout == "NHD"
    for t in (batch_indices, positions, indices, indptr, last_page_len):
        assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous()
        assert t.device == key.device
    assert key.stride(-1) == value.stride(-1) == 1 and key.dim() == value.dim() == 3
    assert key.dtype == value.dtype == k_cache.dtype  # its kernels take the cache's type
    assert indptr.numel() == last_page_len.numel() + 1
    assert batch_indices.numel() == positions.numel() == key.shape[0]
    assert k_cache.stride() == v_cache.stride()
    page_size = k_cache.shape[1]
    flat = indptr[batch_indices.long()].long() * page_size + positions.long()
    page, entry = flat // page_size, flat % page_size
    slots = indices[page].long() * page_size + entry
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    built: list[dict[str, Any]] = []
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.6.13-standin"  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _Wrapper(built, "decode", ws, layout, **kw))
    mod.BatchPrefillWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        lambda ws, layout, **kw: _Wrapper(built, "prefill", ws, layout, **kw))
    mod.append_paged_kv_cache = _append_paged_kv_cache  # type: ignore[attr-defined]
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
    (4, 4, False), (8, 4, False), (6, 2, False),  # groups 1-3: the CUDA-core kernel
    (16, 4, True), (32, 4, True),  # groups 4 (Qwen3-8B) and 8: tensor cores, as SGLang
    (24, 4, True),  # Qwen3.5-27B: group 6 (also 6 per rank at tp = 2)
    (28, 4, True),  # Qwen2.5-7B: group 7
    (20, 4, True), (64, 4, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_runs_on_tensor_cores_from_a_group_of_4_and_where_cuda_cores_cannot(
        fake_flashinfer: list[dict[str, Any]], heads: int, kv_heads: int, tensor_cores: bool,
        dtype: torch.dtype, head_dim: int) -> None:
    att = _backend(heads, kv_heads, head_dim, storage=dtype, compute=dtype, graph_rows=2)
    meta = att.plan(_decode_step(3))  # 3 rows > graph_rows: the plain decode wrapper
    decode = [w for w in fake_flashinfer if w["kind"] == "decode"]
    assert [w.get("use_tensor_cores") for w in decode] == [tensor_cores]
    # prefill on FA2, the module tensor-core decode shares (one JIT build on first load)
    assert [w.get("backend") for w in fake_flashinfer if w["kind"] == "prefill"] == ["fa2"]
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


def test_freeing_the_pool_chooses_no_path(fake_flashinfer: list[dict[str, Any]]) -> None:
    """The load frees its probe pool with no layers and no storage dtype: that is no
    quantised pool, so the backend neither switches to the torch path nor says it did."""
    att = _backend(24, 4, 128, storage=torch.bfloat16, compute=torch.bfloat16)
    assert att.allocate_kv([], 0, 16, storage=None, compute=torch.bfloat16) == []
    assert att.torch_path == "" and att.describe() == "flashinfer 0.6.13-standin"


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
    (torch.bfloat16, 96, "FlashInfer has no kernels for head_dim 96 (64, 128, 256 only)"),
    (torch.float16, 80, "FlashInfer has no kernels for head_dim 80 (64, 128, 256 only)"),
    (torch.bfloat16, 512, "FlashInfer has no kernels for head_dim 512 (64, 128, 256 only)")])
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


def _kv(n: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # k, v as the model hands them over: views of one projection, strided by row
    kv = torch.randn(n, 2 * kv_heads + 3, head_dim, generator=g).to(torch.bfloat16)
    return kv[:, 3:3 + kv_heads], kv[:, 3 + kv_heads:]


def _written(att: CudaAttention, layer: int, slots: list[int], k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Pool ``layer`` holds k, v at exactly ``slots`` and zeros everywhere else."""
    kv = att.pools[layer]
    want_k, want_v = torch.zeros_like(kv.k_slots), torch.zeros_like(kv.v_slots)
    want_k[slots], want_v[slots] = k, v
    torch.testing.assert_close(kv.k_slots, want_k, rtol=0, atol=0)
    torch.testing.assert_close(kv.v_slots, want_v, rtol=0, atol=0)


def test_a_mixed_steps_kv_lands_at_the_runners_slots_in_one_append_per_layer(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    att = _backend(8, 2, 64, storage=torch.bfloat16, compute=torch.bfloat16, graph_rows=4)
    # two decode rows (one at a block's first entry), a fresh prompt, and a chunk over
    # cached context that crosses a block boundary: blocks in no order, as the pool hands out
    rows = [([5, 2], 20), ([7], 0)]
    prefills = [([3, 6], 0, 18), ([1, 4, 0], 12, 30)]  # (table, cached, cached + chunk)
    slots = [token_slots(t, p, p + 1, 16)[0] for t, p in rows]
    step = StepPlan(slot_mapping=torch.tensor(slots), decode_positions=[p for _, p in rows],
                    decode_tables=[t for t, _ in rows], block_size=16, num_blocks=8)
    start = len(rows)
    for table, cached, end in prefills:
        n = end - cached
        step.prefills.append(PrefillRow(start, start + n, cached, table))
        slots += token_slots(table, cached, end, 16)
        start += n
    meta = att.plan(step)
    assert meta.wrapper is att._prefill
    # the prefill wrapper's layout: a query row per decode row, then each chunk's rows; the
    # pages each row's context spans, and how full its last page is
    prefill = next(w for w in fake_flashinfer if w["kind"] == "prefill")
    (qo, indptr, indices, last, *_), kw = prefill["plans"][-1]
    assert qo.tolist() == [0, 1, 2, 20, 38]
    assert indptr.tolist() == [0, 2, 3, 5, 7] and indices.tolist() == [5, 2, 7, 3, 6, 1, 4]
    assert last.tolist() == [5, 1, 2, 14]
    # each row's context length, from the step's one host buffer (pinned on a GPU), so
    # FlashInfer makes and copies none of its own from pageable memory
    assert kw["seq_lens"].tolist() == [21, 1, 18, 30] and kw["seq_lens"].device.type == "cpu"
    k, v = _kv(len(slots), 2, 64, seed=1)
    q = torch.zeros(len(slots), 8, 64, dtype=torch.bfloat16)
    att.forward(1, q, k, v, meta)
    _written(att, 1, slots, k, v)
    _written(att, 0, [], k[:0], v[:0])  # the other layer's pool is untouched


def test_a_replayed_decode_step_writes_its_own_steps_slots(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    att = _backend(8, 2, 64, storage=torch.bfloat16, compute=torch.bfloat16, graph_rows=4)
    static = att.static_meta(3)  # what the captured 3-row graph runs with
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    for seed, rows in enumerate([[([0], 3), ([1, 2], 16), ([4], 15)],
                                 [([6, 5], 31), ([3], 0), ([2, 7], 17)]]):
        step = StepPlan(slot_mapping=torch.empty(0), decode_positions=[p for _, p in rows],
                        decode_tables=[t for t, _ in rows], block_size=16, num_blocks=8)
        meta = att.plan(step)
        assert meta.graph_rows == 3 and meta.append is static.append  # the graph's buffers
        for pool in att.pools:
            pool.k_cache.zero_()
            pool.v_cache.zero_()
        k, v = _kv(3, 2, 64, seed=seed)
        att.forward(0, q, k, v, static)  # the replay: static inputs only
        _written(att, 0, [token_slots(t, p, p + 1, 16)[0] for t, p in rows], k, v)


def test_graph_wrappers_share_one_page_buffer_and_each_replay_reads_its_own_pages(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    """Every b-row graph reads its pages from one buffer of graph_rows x pool blocks (one
    each held graph_rows^2 x blocks in all: 1.3 GB of indices and workspaces at 64 rows of
    50k blocks, uncounted); steps of alternating sizes each write at their own pages."""
    att = _backend(8, 2, 64, storage=torch.bfloat16, compute=torch.bfloat16, graph_rows=4)
    three, two = att.static_meta(3), att.static_meta(2)
    assert three.append.indices is two.append.indices and three.append.indices.numel() == 4 * 8
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    for seed, rows in enumerate([[([0], 3), ([1, 2], 16), ([4], 15)], [([6, 5], 31), ([3], 0)],
                                 [([7], 2), ([5, 1], 20), ([6], 9)]]):
        step = StepPlan(slot_mapping=torch.empty(0), decode_positions=[p for _, p in rows],
                        decode_tables=[t for t, _ in rows], block_size=16, num_blocks=8)
        static = att.static_meta(len(rows))
        assert att.plan(step).append is static.append
        for pool in att.pools:
            pool.k_cache.zero_()
            pool.v_cache.zero_()
        k, v = _kv(len(rows), 2, 64, seed=seed)
        att.forward(0, q[:len(rows)], k, v, static)  # the replay: static inputs only
        _written(att, 0, [token_slots(t, p, p + 1, 16)[0] for t, p in rows], k, v)


def test_the_cuda_backend_makes_its_device_the_current_one(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on cuda:1 (tp 1, one model per engine process): FlashInfer's CuTe kernels,
    torch's graph capture and lookahead's event use the current device, so the backend
    chosen for it, cuda or torch, makes it cuda:1."""
    current: list[torch.device] = []
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def set_device(d: torch.device) -> None:
        if d.index is None:  # as torch's: "Expected a torch.device with a specified index"
            raise ValueError(f"no index: {d}")
        current.append(d)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(cuda, "CudaAttention", lambda device, **kw: types.SimpleNamespace(
        device=device, name="cuda", **kw))  # its buffers need the device
    dev = backends.select("cuda", torch.device("cuda:1"),
                          shape=backends.AttentionShape(24, 4, 128, torch.bfloat16))
    assert dev.name == "cuda" and current == [torch.device("cuda:1")]
    # the torch backend on a GPU too (FlashInfer absent, an fp32 model, head_dim 96)
    dev = backends.select("auto", torch.device("cuda:2"),
                          shape=backends.AttentionShape(24, 4, 96, torch.bfloat16))
    assert dev.name == "torch" and current[-1] == torch.device("cuda:2")
    # a bare "cuda" (the GPU check's, a one-GPU host's) is the current device: left as is
    assert backends.select("cuda", torch.device("cuda"), shape=backends.AttentionShape(
        24, 4, 128, torch.bfloat16)).name == "cuda" and len(current) == 2


def test_flashinfers_scratch_holds_a_split_prefill_of_a_wide_gqa_group() -> None:
    """A split-kv prefill plan keeps each split's fp32 partial output: group x 2 CTAs an SM x
    128 rows x head_dim floats. From a group of 16 (Qwen3-235B at tp 4) that passes the 256
    MiB default, where FlashInfer's plan raises 'Buffer overflow'; narrower groups keep it."""
    cpu = torch.device("cpu")  # as on a 132-SM H100 / H200
    assert cuda.workspace_bytes(None, cpu) == cuda.WORKSPACE_BYTES
    assert cuda.workspace_bytes(backends.AttentionShape(24, 4, 256, torch.bfloat16),
                                cpu) == cuda.WORKSPACE_BYTES  # Qwen3.5-27B: group 6
    wide = cuda.workspace_bytes(backends.AttentionShape(64, 4, 128, torch.bfloat16), cpu)
    assert wide >= 16 * 2 * 132 * 128 * 128 * 4 > cuda.WORKSPACE_BYTES


def test_the_graph_wrappers_scratch_holds_their_largest_batchs_split_plan() -> None:
    """In graph mode FlashInfer 0.6.13 always splits the KV; on tensor cores each split's
    fp32 partial output is a tile of 16 query rows (group <= 16), and the splits number
    max(2 CTAs an SM / kv heads, ceil(rows x group / 16) + rows - 1) (scheduler.cuh
    PrefillSplitQOKVIndptr). Qwen3-32B (64 heads, 8 KV, 128 dims) at 512 rows needs
    64 x 767 x 16 x 128 x 4 bytes for its partial outputs: past the 256 MiB the eager
    wrappers keep, where its first graph plan would raise 'Buffer overflow'."""
    cpu, shape = torch.device("cpu"), backends.AttentionShape(64, 8, 128, torch.bfloat16)
    assert cuda.workspace_bytes(shape, cpu, 8) == cuda.WORKSPACE_BYTES  # 33 splits: ~17 MiB
    need = 64 * (-(-512 * 8 // 16) + 511) * 16 * 128 * 4
    assert need > cuda.WORKSPACE_BYTES
    assert cuda.workspace_bytes(shape, cpu, 512) >= need + 64 * 767 * 16 * 4  # + their sums
    assert cuda.workspace_bytes(shape, cpu) == cuda.WORKSPACE_BYTES  # eager: unchanged


def test_each_rank_sizes_flashinfers_scratch_for_its_own_heads(monkeypatch) -> None:
    """The runner gives select the whole model's heads; at tp 2 a rank's wrappers plan its
    half (Qwen3-32B: 32 query and 4 KV heads a card), and its graph scratch is what the
    plan counts a card, not the whole model's (402 MiB where the plan counted 256)."""
    from helexa.checkpoint.memory import flashinfer_graph_workspace_bytes

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # 132 SMs, no set_device
    monkeypatch.setattr(cuda, "CudaAttention", lambda device, **kw: types.SimpleNamespace(
        device=device, name="cuda", **kw))
    whole = backends.AttentionShape(64, 8, 128, torch.bfloat16)
    got = backends.select("cuda", torch.device("cuda"), max_num_seqs=512, tp_size=2,
                          shape=whole).attention
    assert got.graph_workspace_bytes == flashinfer_graph_workspace_bytes(32, 4, 128, 512)
    assert got.graph_workspace_bytes < flashinfer_graph_workspace_bytes(64, 8, 128, 512)
    assert whole.per_rank(8) == backends.AttentionShape(8, 1, 128, torch.bfloat16)


def test_the_graph_wrappers_workspace_exists_only_where_graphs_are_captured(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    """FlashInfer's float scratch for the graph wrappers (256 MiB) is made only when the
    backend captures decode graphs: with engine.cuda_graphs off it would hold card memory
    that nothing uses and no plan counts."""
    off = CudaAttention(torch.device("cpu"), graph_rows=0, workspace_bytes=1024,
                        graph_workspace_bytes=2048)
    on = CudaAttention(torch.device("cpu"), graph_rows=4, workspace_bytes=1024,
                       graph_workspace_bytes=2048)
    assert off._graph_workspace is None
    assert on._graph_workspace is not None and on._graph_workspace.numel() == 2048


def test_a_quantised_pool_runs_eagerly_and_says_so(fake_flashinfer: list[dict[str, Any]]) -> None:
    """A quantised KV pool runs the torch path: no step is planned on a graph wrapper, so
    the executor says it captures none and the graph wrappers' scratch is given back; a
    switch back to a pool FlashInfer reads makes it again and plans graph rows."""
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor

    att = CudaAttention(torch.device("cpu"), graph_rows=4, graph_workspace_bytes=2048)
    att.heads = 24
    ex = CudaGraphExecutor(att)
    att.allocate_kv([AttentionSpec(4, 128, "int8")] * 2, 8, 16, storage=None,
                    compute=torch.bfloat16)
    assert att._graph_workspace is None
    assert ex.describe() == "no graphs (quantised KV: torch path, eager)"
    assert not getattr(att.plan(_decode_step(2)), "graph_rows", 0)
    att.allocate_kv([AttentionSpec(4, 128, "bf16")] * 2, 8, 16, storage=torch.bfloat16,
                    compute=torch.bfloat16)
    assert att._graph_workspace is not None and att._graph_workspace.numel() == 2048
    assert ex.describe() == "graphs for 1..4 rows, captured at load"
    assert att.plan(_decode_step(2)).graph_rows == 2


def test_a_quantised_pools_decode_rows_run_the_triton_kernel_where_it_agreed(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantised pool asks the Triton kernels' probes at the layers' sizes: where they
    agreed, its new K and V are written by one, its decode rows are planned as one table
    for another and its prefill chunks go to the third, and the backend line says so; where
    one disagreed, the reason is logged and its torch form runs (decode rows in length
    groups); a float pool of another dtype than the queries' asks nothing."""
    from helexa.kernels.cuda import quant_decode, quant_write

    asked: list[tuple[Any, ...]] = []
    verdict, write_verdict = (True, ""), (True, "")
    monkeypatch.setattr(quant_decode, "chosen", lambda *a: asked.append(a) or verdict)
    monkeypatch.setattr(quant_write, "chosen", lambda *a: asked.append(a) or write_verdict)
    warned: list[tuple[str, str]] = []
    monkeypatch.setattr(quant_decode.log, "warning",
                        lambda event, **kw: warned.append((event, kw["reason"])))
    att = CudaAttention(torch.device("cpu"))
    att.heads = 24
    spec = [AttentionSpec(4, 128, "int4")] * 2
    att.allocate_kv(spec, 8, 16, storage=None, compute=torch.bfloat16)
    cpu = torch.device("cpu")
    assert asked == [(cpu, "int4", 4, 128, torch.bfloat16),
                     (cpu, "int4", 24, 4, 128, torch.bfloat16),
                     (cpu, "int4", 24, 4, 128, torch.bfloat16, quant_decode.probe_prefill)]
    assert att.reference.quant_decode is quant_decode.decode and not warned
    assert att.reference.quant_write is quant_write.write
    assert att.reference.quant_prefill is quant_decode.prefill
    assert att.describe().endswith(
        "quantised KV: torch path (Triton: writes, decode, prefill)")
    meta = att.plan(_decode_step(2))
    assert meta.decode_rows is not None and not meta.decode_groups
    table, lens, longest, bs, per_row = meta.decode_rows
    assert table.tolist() == [[0], [1]] and lens.tolist() == [4, 4]
    assert (longest, bs, per_row, meta.graph_rows) == (4, 16, False, 0)  # no graphs asked
    over_cache = StepPlan(slot_mapping=torch.arange(20, 24), block_size=16, num_blocks=8,
                          prefills=[PrefillRow(0, 4, 20, [0, 1])])  # 4 tokens after 20
    chunk = att.plan(over_cache).prefills[0]  # the kernel masks as it goes: no [n, T] mask
    assert chunk.context_len == 24 and chunk.mask is None
    verdict = (False, "the Triton quantised-KV decode is off by 0.5 (relative; 0.03 allowed)")
    write_verdict = (False, "the Triton quantised-KV write's k_data differs from the ...")
    att.allocate_kv(spec, 8, 16, storage=None, compute=torch.bfloat16)
    assert att.reference.quant_decode is None and att.reference.quant_write is None
    assert att.reference.quant_prefill is None and att.describe().endswith("torch path")
    assert warned == [("kernels.quant_write_fallback", write_verdict[1]),
                      ("kernels.quant_decode_fallback", verdict[1]),
                      ("kernels.quant_prefill_fallback", verdict[1])]
    meta = att.plan(_decode_step(2))
    assert meta.decode_rows is None and meta.decode_groups
    assert att.plan(over_cache).prefills[0].mask.shape == (4, 24)  # SDPA reads one
    att.allocate_kv([AttentionSpec(4, 128, "fp16")] * 2, 8, 16, storage=torch.float16,
                    compute=torch.bfloat16)
    assert len(asked) == 6 and att.reference.quant_decode is att.reference.quant_write is None


def test_a_quantised_pools_decode_steps_are_planned_into_its_graphs_buffers(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With graphs asked for and the Triton write and decode kernels serving, a pure-decode
    step of up to graph_rows rows is planned into fixed buffers (the first b rows of one
    set: the new tokens' slots, each row's pages and context) with the split count of the
    most a row can hold (the model's reach, else the pool's), each row split on the device;
    the next step of that size refills the same tensors; a step with a prefill, one wider
    than the graphs, or a pool whose write kernel was refused is planned afresh; a page
    outside the pool is refused before any kernel reads it; freeing the pool frees the
    torch path's too."""
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor
    from helexa.kernels.cuda import quant_decode, quant_write

    verdicts = {"write": (True, ""), "decode": (True, "")}
    monkeypatch.setattr(quant_decode, "chosen", lambda *a: verdicts["decode"])
    monkeypatch.setattr(quant_write, "chosen", lambda *a: verdicts["write"])
    att = CudaAttention(torch.device("cpu"), graph_rows=4)
    att.heads = 24
    spec = [AttentionSpec(4, 128, "int8")] * 2
    att.allocate_kv(spec, 8, 16, storage=None, compute=torch.bfloat16)
    assert CudaGraphExecutor(att).describe() == (  # type: ignore[arg-type]
        "graphs for 1..4 rows, captured at load (the torch path's Triton kernels)")
    first = att.plan(StepPlan(slot_mapping=torch.tensor([5, 33]), decode_positions=[5, 17],
                              decode_tables=[[0], [2, 6]], block_size=16, num_blocks=8))
    assert first is att.static_meta(2) and first.graph_rows == 2 and not first.decode_groups
    assert first.decode_rows is not None
    table, lens, most, bs, per_row = first.decode_rows
    assert (most, bs, per_row) == (128, 16, True) and table.shape == (2, 8)
    assert table[:, :2].tolist() == [[0, 0], [2, 6]] and lens.tolist() == [6, 18]
    assert first.slot_mapping.tolist() == [5, 33]
    again = att.plan(StepPlan(slot_mapping=torch.tensor([70, 9]), decode_positions=[40, 2],
                              decode_tables=[[3, 1, 4], [7]], block_size=16, num_blocks=8))
    assert again is first and lens.tolist() == [41, 3] and table[0, :3].tolist() == [3, 1, 4]
    assert first.slot_mapping.tolist() == [70, 9]
    three = att.static_meta(3)  # the same rows, three of them
    assert three.decode_rows is not None
    assert three.decode_rows[0].data_ptr() == table.data_ptr()
    assert three.slot_mapping.data_ptr() == first.slot_mapping.data_ptr()
    mixed = att.plan(StepPlan(slot_mapping=torch.arange(3), decode_positions=[5],
                              decode_tables=[[0]], prefills=[PrefillRow(1, 3, 0, [1])],
                              block_size=16, num_blocks=8))
    wide = att.plan(_decode_step(5))
    assert mixed.graph_rows == wide.graph_rows == 0
    assert wide.decode_rows is not None and wide.decode_rows[2:] == (4, 16, False)
    att.reference.reach = 40  # set by the graph executor from the model's rope reach
    att.allocate_kv(spec, 8, 16, storage=None, compute=torch.bfloat16)  # fresh buffers
    meta = att.plan(_decode_step(2))
    assert meta.decode_rows is not None and meta.decode_rows[0].shape == (2, 3)
    assert meta.decode_rows[2] == 40 and meta.decode_rows[0].data_ptr() != table.data_ptr()
    with pytest.raises(ValueError, match="a block outside the pool of 8 blocks"):
        att.plan(StepPlan(slot_mapping=torch.tensor([5]), decode_positions=[20],
                          decode_tables=[[0, 8]], block_size=16, num_blocks=8))  # no page 8
    att.allocate_kv([], 0, 16, storage=None, compute=torch.bfloat16)  # the probe pool freed
    assert att.pools == [] and att.reference.pools == [] and not att.reference.graph_ready()
    verdicts["write"] = (False, "refused")
    att.allocate_kv(spec, 8, 16, storage=None, compute=torch.bfloat16)
    assert att.plan(_decode_step(2)).graph_rows == 0
    assert CudaGraphExecutor(att).describe() == (  # type: ignore[arg-type]
        "no graphs (quantised KV: torch path, eager)")


def test_a_plan_waits_only_for_its_own_wrappers_last_copies(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan rewrites its wrapper's pinned buffer, so it waits for that wrapper's last
    plan's copies, and no other's: an MTP head's pass planned between two lookahead steps
    (the prefill wrapper, recorded behind the step in flight) must not hold the next decode
    step's plan until that step is done."""
    events: list[list[str]] = []  # per event: what happened to it, in order

    class Event:
        def __init__(self) -> None:
            self.log: list[str] = []
            events.append(self.log)

        def record(self) -> None:
            self.log.append("record")

        def synchronize(self) -> None:
            self.log.append("wait")

    monkeypatch.setattr(cuda, "copies_done_event", lambda device: Event())
    att = _backend(8, 2, 64, storage=torch.bfloat16, compute=torch.bfloat16, graph_rows=4)
    side = StepPlan(slot_mapping=torch.arange(5), decode_positions=[], decode_tables=[],
                    prefills=[PrefillRow(block_table=[3], num_computed=0, start=0, end=5)],
                    block_size=16, num_blocks=8)
    att.plan(_decode_step(2))  # the held step
    att.plan(_decode_step(2))  # the step after it, launched before it is read
    att.plan_side(side)  # the MTP head's catch-up, while that one runs
    att.plan(_decode_step(2))
    att.plan_side(side)
    decode, prefill = events
    assert decode == ["record", "wait", "record", "wait", "record"]
    assert prefill == ["record", "wait", "record"]
    # a new pool (a kv_dtype switch) makes the decode wrappers again; the prefill wrapper
    # lives on, so its next plan still waits for its last one's copies
    att.allocate_kv([AttentionSpec(2, 64, "bf16")] * 2, 8, 16, storage=torch.bfloat16,
                    compute=torch.bfloat16)
    att.plan_side(side)
    assert prefill == ["record", "wait", "record", "wait", "record"]


def test_an_eager_decode_plans_query_offsets_in_memory_helexa_made_first(
        fake_flashinfer: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer 0.6.13's eager decode plan copies its query offsets from the arange it
    caches by power of two (``utils._get_range_buf(batch + 1, "cpu")``), made pageable, so
    the copy would wait for the device each step: the backend puts that entry in the cache
    first (pinned on a GPU), once, before the plan that reads it; graph steps leave it."""
    cache: dict[tuple[str, Any], torch.Tensor] = {}
    utils = types.SimpleNamespace(_cache_buf=cache, _get_range_buf=lambda n, device: None)
    monkeypatch.setattr(cuda.flashinfer, "utils", utils, raising=False)
    att = _backend(8, 2, 64, storage=torch.bfloat16, compute=torch.bfloat16, graph_rows=2)
    att.plan(_decode_step(2))  # a graph wrapper's step: its offsets are fixed buffers
    assert cache == {}
    att.plan(_decode_step(5))  # eager: batch 5, offsets 0..5 from the arange of 8
    assert list(cache) == [("range_8", "cpu")]
    made = cache[("range_8", "cpu")]
    assert made.dtype == torch.int32 and made.tolist() == list(range(8))
    att.plan(_decode_step(7))
    assert cache[("range_8", "cpu")] is made  # made once, never written
    att.plan(_decode_step(8))
    assert set(cache) == {("range_8", "cpu"), ("range_16", "cpu")}


def test_a_wider_batch_makes_the_graph_wrappers_scratch_and_indices_at_its_width(
        fake_flashinfer: list[dict[str, Any]]) -> None:
    """The executor told of a wider batch (a profile with more rows): the graph wrappers'
    float scratch is made again at the new width's size with the next pool, the old one
    given back first, and decode steps up to the new width are planned on graph wrappers
    (a step the old width ran eagerly)."""
    from helexa.kernels.backends.cuda_graphs import CudaGraphExecutor

    att = CudaAttention(torch.device("cpu"), graph_rows=2, graph_workspace_bytes=2048)
    att.heads = 8
    ex = CudaGraphExecutor(att, graph_workspace=lambda rows: 1000 * rows)
    layers = [AttentionSpec(4, 128, "bf16")] * 2
    att.allocate_kv(layers, 8, 16, storage=torch.bfloat16, compute=torch.bfloat16)
    assert not getattr(att.plan(_decode_step(5)), "graph_rows", 0)  # wider than built: eager
    ex.set_graph_rows(5)
    att.allocate_kv(layers, 8, 16, storage=torch.bfloat16, compute=torch.bfloat16)
    assert att._graph_workspace is not None and att._graph_workspace.numel() == 5000
    assert att._graph_indices is not None and att._graph_indices.numel() == 5 * 8
    assert att.plan(_decode_step(5)).graph_rows == 5
    assert ex.describe() == "graphs for 1..5 rows, captured at load"
