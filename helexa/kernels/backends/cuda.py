"""The ``cuda`` attention backend: FlashInfer's paged kernels over the block tables.

Installed with the optional extra (``pip install -e '.[cuda]'``); this module
imports without it and ``available()`` says whether it can run. Nothing on CPU
or in the default tests needs it.

- Pool: plain kv dtypes as contiguous NHD pages, [num_blocks, block_size,
  kv_heads, head_dim] for K and for V, the layout FlashInfer reads; a token's
  flat slot (block * block_size + offset) is the same as on every backend.
  Quantised kv dtypes (per-token-head scales, helexa/kernels/kv_quant.py) are not a
  FlashInfer format: those pools run the torch backend's path, their writes, decode rows
  and prefill chunks over cached context on Triton kernels where each agreed at load
  (kernels/cuda/quant_write.py, quant_decode.py).
- Per step, one ``plan`` on host-side index arrays (no device-to-host copy):
  a pure-decode step through BatchDecodeWithPagedKVCacheWrapper, any step with
  a prefill chunk through BatchPrefillWithPagedKVCacheWrapper (causal, queries
  aligned to the end of their context, so a chunk over cached context needs no
  mask and decode rows ride along with q_len 1). Each layer's new K and V are written
  by one kernel, FlashInfer's ``append_paged_kv_cache``, over the same paged layout the
  step planned (:class:`KvAppend`: each flat row's batch row and position in its
  sequence, built once a step); attention reads the pages in place, no gather.
- CUDA graphs (``engine.cuda_graphs``, any tp, dense or hybrid): a pure-decode step of
  b rows, 1 <= b <= max_slots, is planned on its own cuda-graph decode wrapper over fixed
  index buffers, and its KV append reads those buffers and two more of its own (the rows'
  batch indices and positions): ``plan`` fills them all for the step, so the graph
  replays with the step's layout (:meth:`CudaAttention.static_meta`). The executor
  (cuda_graphs.py) captures every b at load and replays after, with the step's ids and
  positions copied into its static inputs.
- Quantised kv dtypes, and a kv dtype other than the queries' (FlashInfer's kernels take one
  q/kv dtype pair per build): the composed torch backend (``reference``) allocates and plans.
- What FlashInfer serves (:func:`unsupported`): fp16/bf16 queries, head_dim 64/128/256 (512:
  no valid FA2 tile); decode of any GQA group on its tensor-core kernel, and of groups 1, 2,
  3, 4 and 8 on its CUDA-core one (which raises ``Unsupported group_size`` at ``plan`` for
  Qwen3.5-27B's 6; :func:`tensor_cores` chooses). ``select`` runs the torch backend, saying
  why, for a model FlashInfer cannot serve at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import structlog
import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.checkpoint.memory import (
    FI_FLOAT_WORKSPACE_BYTES,
    flashinfer_graph_workspace_bytes,
    flashinfer_workspace_bytes,
)
from helexa.kernels.backends.base import (
    AttentionBackend,
    AttentionShape,
    StepMeta,
    StepPlan,
    copies_done_event,
    pinned,
    used_blocks,
)
from helexa.kernels.backends.torch_ref import TorchBackend, TorchMetadata
from helexa.kernels.cuda import quant_decode
from helexa.kernels.paged_kv import NhdKV, PagedKV

try:  # the optional extra
    import flashinfer

    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available", said why
    flashinfer = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

WORKSPACE_BYTES = FI_FLOAT_WORKSPACE_BYTES  # FlashInfer's scratch, per wrapper family: at least
# What FlashInfer 0.6's prebuilt/JIT kernels are instantiated for (its dispatch macros):
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)  # GQA groups its CUDA-core decode kernel serves
# 512 is instantiated but its FA2 prefill (and tensor-core decode) tiles are all invalid in
# 0.6.13 (prefill.cuh KernelTraits::IsInvalid: 8 x 32 MMA columns of the output >= 256)
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)  # fp32 raises KeyError in its JIT at load

log = structlog.get_logger(component="kernels")


def workspace_bytes(shape: AttentionShape | None, device: torch.device,
                    graph_rows: int = 0) -> int:
    """FlashInfer's float scratch for this model with this card's SMs: the prefill and
    eager decode wrappers' (memory.flashinfer_workspace_bytes), or with ``graph_rows`` the
    graph wrappers' for batches up to that many (flashinfer_graph_workspace_bytes; the
    plan counts it in its graph pool)."""
    if shape is None:
        return WORKSPACE_BYTES
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" and torch.cuda.is_available() else 132)
    if graph_rows:
        return flashinfer_graph_workspace_bytes(shape.heads, shape.kv_heads, shape.head_dim,
                                                graph_rows, sms)
    return flashinfer_workspace_bytes(shape.group, shape.head_dim, sms)


def unsupported(shape: AttentionShape) -> str:
    """Why FlashInfer cannot serve attention of this shape ("" when it can)."""
    if shape.dtype not in DTYPES:
        name = str(shape.dtype).removeprefix("torch.")
        return f"FlashInfer has no {name} kernels (fp16, bf16 only)"
    if shape.head_dim not in HEAD_DIMS:
        return (f"FlashInfer has no kernels for head_dim {shape.head_dim} "
                f"({', '.join(map(str, HEAD_DIMS))} only)")
    return ""


TENSOR_CORE_GROUP = 4  # from this GQA group up, decode on tensor cores (SGLang's rule)


def tensor_cores(group: int) -> bool:
    """Decode on the tensor-core kernel? Wherever the CUDA-core kernel cannot run, and for
    groups of 4 and more: FlashInfer documents tensor cores as faster for large groups, and
    SGLang's FlashInfer backend takes them from a group of 4 in 16-bit KV. On the one GPU
    measured here (an H200) the CUDA-core kernel took ~15 µs a layer at batch 1 over 130
    tokens (docs/operating.md); bench/gpu_check.sh's decode stage times the other kernel on
    the same model beside the chosen one (``other_decode_kernel``), so the next GPU run
    says whether this rule holds there."""
    return group not in CUDA_CORE_GROUPS or group >= TENSOR_CORE_GROUP


def available() -> bool:
    return flashinfer is not None and torch.cuda.is_available()


def import_error() -> str:
    return _IMPORT_ERROR or ("no CUDA device" if not torch.cuda.is_available() else "")


@dataclass
class KvAppend:
    """Where a step's new K/V go, as FlashInfer's ``append_paged_kv_cache`` reads it: int32
    on the device. Flat row i is token ``positions[i]`` of batch row ``batch_indices[i]``,
    whose pages are ``indices[indptr[b]:indptr[b + 1]]`` (the layout its attention is
    planned on; ``last_page_len`` completes it). The same flat slot as the runner's slot
    mapping: ``indices[indptr[b] + p // block_size] * block_size + p % block_size``."""

    batch_indices: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    indices: torch.Tensor  # [>= indptr[-1]]
    indptr: torch.Tensor  # [B + 1]
    last_page_len: torch.Tensor  # [B]


@dataclass
class CudaMetadata(StepMeta):
    """A step planned on one FlashInfer wrapper that every layer runs."""

    backend: CudaAttention
    append: KvAppend
    num_decode: int
    wrapper: Any = None  # the planned FlashInfer wrapper
    graph_rows: int = 0  # a pure-decode step of this many rows on a cuda-graph wrapper (0: none)


@dataclass
class _GraphWrapper:
    wrapper: Any  # a cuda-graph decode wrapper over the fixed index buffers of ``append``
    append: KvAppend  # static: every buffer a captured step's KV writes read


class CudaAttention(AttentionBackend):
    name = "cuda"

    def __init__(self, device: torch.device, *, graph_rows: int = 0,
                 workspace_bytes: int = WORKSPACE_BYTES,
                 graph_workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """``graph_rows``: pure-decode steps of 1..graph_rows rows are planned for CUDA graph
        capture (0: none); ``workspace_bytes``, ``graph_workspace_bytes``: FlashInfer's float
        scratch for the eager wrappers and the graph ones (workspace_bytes)."""
        super().__init__(device)
        self.reference = TorchBackend(device, graph_rows=graph_rows)
        self.graph_rows = graph_rows
        self.heads = 0  # query heads per rank: the executor sets it once the model is loaded
        self.quantised = False
        self.torch_path = ""  # why the pools run the torch path ("" when FlashInfer's)
        self.tensor_cores = False  # decode on FlashInfer's tensor-core kernel (tensor_cores)
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.graph_workspace_bytes = graph_workspace_bytes  # graph wrappers' scratch, if any
        self._graph_workspace = (torch.empty(graph_workspace_bytes, dtype=torch.uint8,
                                             device=device) if graph_rows else None)
        self._decode: Any = None  # built by allocate_kv, once the GQA group is known
        self._group = 0
        # per wrapper, an event recorded after its last plan's copies (id(wrapper) -> event)
        self._planned: dict[int, Any] = {}
        # FA2 for prefill, not "auto" (FA3 on Hopper): FA2's prefill module is the one the
        # tensor-core decode also runs, so a first load JIT-compiles one attention module, not
        # two; FA3's templates are the slowest to build. What FA3 would save on long prompts'
        # TTFT is unmeasured here.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                       backend="fa2")
        self._graph_wrappers: dict[int, _GraphWrapper] = {}
        self._graph_indices: torch.Tensor | None = None  # every graph wrapper's pages

    def describe(self) -> str:
        version = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
        if self.torch_path:
            ref = self.reference
            on = [p for p, f in (("writes", ref.quant_write), ("decode", ref.quant_decode),
                                 ("prefill", ref.quant_prefill)) if f]
            return f"{version}; {self.torch_path}: torch path" + (
                f" (Triton: {', '.join(on)})" if on else "")
        if not self.pools:
            return version
        kernel = "tensor cores" if self.tensor_cores else "CUDA cores"
        return f"{version}; decode on {kernel} (GQA group {self._group})"

    def allocate_kv(self, layers: list[AttentionSpec], num_blocks: int, block_size: int, *,
                    storage: torch.dtype | None, compute: torch.dtype) -> list[PagedKV]:
        self._graph_wrappers = {}  # their index buffer is sized by the pool
        self._graph_indices = None
        # the decode wrappers are made again below; the prefill one lives on, and so does
        # the wait for its last plan's copies
        self._planned = {k: e for k, e in self._planned.items() if k == id(self._prefill)}
        self.pools = self.reference.pools = []  # a quantised pool's are the torch path's
        if not layers:  # a pool freed (the load's probe pool): nothing chosen, nothing said
            return self.pools
        self.quantised = storage is None
        self.torch_path = ("quantised KV" if storage is None else
                           f"KV {_name(storage)} with {_name(compute)} queries"
                           if storage != compute else "")
        if self.torch_path:  # a pool FlashInfer's kernels do not read: the torch path's
            log.info("kernels.flashinfer_torch_path", reason=self.torch_path)
            # no FlashInfer graph wrapper: no scratch for one (its graphs read its own buffers)
            self._graph_workspace = None
            self.pools = self.reference.allocate_kv(layers, num_blocks, block_size,
                                                    storage=storage, compute=compute)
            # a quantised pool's writes, decode rows and prefill chunks: Triton where agreed
            quant_decode.choose(self.reference, layers[0] if storage is None else None,
                                self.heads, compute)
            return self.pools
        ws = self._graph_workspace  # none back from the torch path; another size: wider
        if self.graph_rows and (ws is None or ws.numel() != self.graph_workspace_bytes):
            self._graph_workspace = ws = None  # graphs (set_graph_rows): the old freed first
            self._graph_workspace = torch.empty(self.graph_workspace_bytes, dtype=torch.uint8,
                                                device=self.device)
        self._group = self.heads // max(1, layers[0].kv_heads)
        self.tensor_cores = tensor_cores(self._group)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.tensor_cores)
        log.info("kernels.flashinfer_decode", group=self._group, tensor_cores=self.tensor_cores)
        self.pools = [NhdKV(num_blocks, block_size, s.kv_heads, s.head_dim, storage=storage,
                            compute=compute, kv_dtype=s.kv_dtype, device=self.device)
                      for s in layers]
        self._kv_dtype = storage
        self._q_dtype = compute
        # One page-index buffer every graph wrapper reads (graph_rows x pool blocks: rows
        # may share prefix blocks), where one each held graph_rows^2 x blocks in all; each
        # step's plan copies its pages in on the stream, after the replays before it read.
        self._graph_indices = torch.zeros(max(1, self.graph_rows) * num_blocks,
                                          dtype=torch.int32, device=self.device)
        return self.pools

    # ---- per step ------------------------------------------------------------------------

    def plan(self, step: StepPlan) -> CudaMetadata | TorchMetadata:
        if not self.pools or self.torch_path:
            return self.reference.plan(step)
        return self._plan(step)

    def _plan_wrapper(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """wrapper.plan, once its last plan's copies have run. FlashInfer's plan writes a
        pinned host buffer of the wrapper's own and copies it to the device without
        waiting; the engine's lookahead plans a step while the one before runs. Only the
        wrapper planned waits: an MTP head's pass planned between steps (on the prefill
        wrapper) must not make the next decode step's plan wait for the step in flight."""
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        event = done or copies_done_event(self.device)
        if event is not None:  # (a stand-in FlashInfer's tests plan on the CPU)
            event.record()
            self._planned[id(wrapper)] = event

    def _plan(self, step: StepPlan) -> CudaMetadata:
        bs = step.block_size
        lens = [p + 1 for p in step.decode_positions] + [r.num_computed + r.end - r.start
                                                         for r in step.prefills]
        tables = list(step.decode_tables) + [r.block_table for r in step.prefills]
        indptr, indices, last = [0], [], []
        for table, n in zip(tables, lens, strict=True):
            used = used_blocks(table, n, bs, step.num_blocks)
            indices.extend(used)
            indptr.append(len(indices))
            last.append(n - (len(used) - 1) * bs)
        if any(not 0 <= b < step.num_blocks for b in indices):
            raise ValueError(f"block table holds a block outside the pool of {step.num_blocks} "
                             "blocks")
        b = step.num_decode
        graph = not step.prefills and b <= self.graph_rows
        rows, positions = list(range(b)), list(step.decode_positions)
        for j, r in enumerate(step.prefills):
            rows.extend([b + j] * (r.end - r.start))
            positions.extend(range(r.num_computed, r.num_computed + r.end - r.start))
        qo: list[int] = []  # the prefill wrapper's query offsets: decode rows take one each
        if step.prefills:
            qo = list(range(b + 1))
            for r in step.prefills:
                qo.append(qo[-1] + r.end - r.start)
        # One host list, pinned, and one copy of it to the device that does not wait: the
        # layout FlashInfer's plan reads on the host (indptr, last page lengths, query
        # offsets: it copies them into its buffers from pinned memory, async too) and the
        # device part (pages, each flat row's batch row and position). A copy from pageable
        # memory would hold the host until the device drained its queue (host syncs a step).
        # (the prefill plan's kv lengths too: given none, FlashInfer makes them in pageable
        # memory and copies them from there each step)
        kv_lens = lens if step.prefills else []
        host = pinned(indptr + last + qo + indices + rows + positions + kv_lens, torch.int32,
                      self.device)
        dev = host.to(self.device, non_blocking=True)
        at = list(accumulate([0, len(indptr), len(last), len(qo), len(indices), len(rows),
                              len(positions), len(kv_lens)]))
        indptr_h, last_h, qo_h = host[at[0]:at[1]], host[at[1]:at[2]], host[at[2]:at[3]]
        indices_d, rows_d, positions_d = dev[at[3]:at[4]], dev[at[4]:at[5]], dev[at[5]:at[6]]
        kvh, d = self.pools[0].num_kv_heads, self.pools[0].head_dim
        common = dict(q_data_type=self._q_dtype, kv_data_type=self._kv_dtype)
        if graph:
            # the graph's buffers: the wrapper's plan fills its three, this the positions
            g = self._graph_wrapper(b)
            g.append.positions.copy_(positions_d)
            self._plan_wrapper(g.wrapper, indptr_h, indices_d, last_h, self.heads, kvh, d, bs,
                               pos_encoding_mode="NONE", **common)
            return CudaMetadata(backend=self, append=g.append, num_decode=b, wrapper=g.wrapper,
                                graph_rows=b)
        append = KvAppend(batch_indices=rows_d, positions=positions_d, indices=indices_d,
                          indptr=dev[at[0]:at[1]], last_page_len=dev[at[1]:at[2]])
        meta = CudaMetadata(backend=self, append=append, num_decode=b)
        if not step.prefills:
            meta.wrapper = self._decode
            pinned_range(b + 1, self.device)
            self._plan_wrapper(meta.wrapper, indptr_h, indices_d, last_h, self.heads, kvh, d,
                               bs, pos_encoding_mode="NONE", **common)
            return meta
        self._plan_wrapper(self._prefill, qo_h, indptr_h, indices_d, last_h, self.heads, kvh,
                           d, bs, causal=True, seq_lens=host[at[6]:at[7]], **common)
        meta.wrapper = self._prefill
        return meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: CudaMetadata) -> torch.Tensor:
        kv, w = self.pools[layer], meta.append
        # k, v are the pool's dtype (a pool of another dtype runs the torch path) and
        # contiguous in their last dim (the kernel takes the row and head strides)
        flashinfer.append_paged_kv_cache(k, v, w.batch_indices, w.positions,
                                         (kv.k_cache, kv.v_cache), w.indices, w.indptr,
                                         w.last_page_len, "NHD")
        return meta.wrapper.run(q.contiguous(), (kv.k_cache, kv.v_cache))

    # ---- CUDA graphs ---------------------------------------------------------------------

    def static_meta(self, b: int) -> CudaMetadata | TorchMetadata:
        """The metadata a captured b-row decode step runs with: the graph wrapper and the
        static buffers of its KV append, which ``plan`` fills for each step (a quantised
        pool's torch path: its own, TorchBackend.static_meta)."""
        if self.torch_path:
            return self.reference.static_meta(b)
        g = self._graph_wrapper(b)
        return CudaMetadata(backend=self, append=g.append, num_decode=b, wrapper=g.wrapper,
                            graph_rows=b)

    def _graph_wrapper(self, b: int) -> _GraphWrapper:
        g = self._graph_wrappers.get(b)
        if g is None:
            dev, i32 = self.device, torch.int32
            assert self._graph_indices is not None, "graph wrappers come after allocate_kv"
            assert self._graph_workspace is not None, "graph wrappers need graph_rows"
            append = KvAppend(
                batch_indices=torch.arange(b, dtype=i32, device=dev),  # row i is token i's
                positions=torch.zeros(b, dtype=i32, device=dev),
                indices=self._graph_indices,
                indptr=torch.zeros(b + 1, dtype=i32, device=dev),
                last_page_len=torch.zeros(b, dtype=i32, device=dev))
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._graph_workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores, paged_kv_indptr_buffer=append.indptr,
                paged_kv_indices_buffer=append.indices,
                paged_kv_last_page_len_buffer=append.last_page_len)
            g = self._graph_wrappers[b] = _GraphWrapper(wrapper, append)
        return g


def pinned_range(n: int, device: torch.device) -> None:
    """FlashInfer 0.6.13's eager decode plan copies its query offsets from a cached pageable
    arange (``_get_range_buf(batch_size + 1, "cpu")``, by power of two): a copy that waits
    for the device each step. Its entry for ``n`` made here first, pinned (never written:
    a queued copy may read it still); a FlashInfer without that cache is left alone."""
    utils, size = getattr(flashinfer, "utils", None), 1 << (n - 1).bit_length()
    cache, key = getattr(utils, "_cache_buf", None), (f"range_{size}", "cpu")
    if isinstance(cache, dict) and hasattr(utils, "_get_range_buf") and (
            key not in cache or (device.type == "cuda" and not cache[key].is_pinned())):
        cache[key] = pinned(range(size), torch.int32, device)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
