"""The ``cuda`` attention backend: FlashInfer's paged kernels over the block tables.

Installed with the optional extra (``pip install -e '.[cuda]'``); this module
imports without it and ``available()`` says whether it can run. Nothing on CPU
or in the default tests needs it.

- Pool: plain kv dtypes as contiguous NHD pages, [num_blocks, block_size,
  kv_heads, head_dim] for K and for V, the layout FlashInfer reads; a token's
  flat slot (block * block_size + offset) is the same as on every backend.
  Quantised kv dtypes (per-token-head scales, helexa/kernels/kv_quant.py) are not a
  FlashInfer format: those pools run the torch backend's path.
- Per step, one ``plan`` on host-side index arrays (no device-to-host copy):
  a pure-decode step through BatchDecodeWithPagedKVCacheWrapper, any step with
  a prefill chunk through BatchPrefillWithPagedKVCacheWrapper (causal, queries
  aligned to the end of their context, so a chunk over cached context needs no
  mask and decode rows ride along with q_len 1). K/V are written with one
  index_copy_ per layer; attention reads the pages in place, no gather.
- CUDA graphs (``engine.cuda_graphs``, tp = 1): a pure-decode step of b rows,
  1 <= b <= max_slots, is captured the first time that b is seen (with its own
  cuda-graph decode wrapper over fixed index buffers) and replayed after: the
  step's ids, positions and slots copied into static inputs, the wrapper
  re-planned, the graph replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from helexa.kernels.attention import AttentionMetadata, PagedKV
from helexa.kernels.backends.base import StepPlan
from helexa.kernels.backends.torch_ref import TorchBackend, _used_blocks

try:  # the optional extra
    import flashinfer

    _IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available", said why
    flashinfer = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's scratch, per wrapper family
log = structlog.get_logger(component="kernels")


def available() -> bool:
    return flashinfer is not None and torch.cuda.is_available()


def import_error() -> str:
    return _IMPORT_ERROR or ("no CUDA device" if not torch.cuda.is_available() else "")


class NhdKV(PagedKV):
    """A plain-dtype pool in FlashInfer's NHD page layout (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 storage: torch.dtype, compute: torch.dtype, kv_dtype: str,
                 device: torch.device) -> None:
        self.kv_dtype, self.head_dim, self.compute = kv_dtype, head_dim, compute
        self.num_kv_heads, self.quantized, self.mirror = kv_heads, False, None
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=storage, device=device)
        self.v_cache = torch.zeros(shape, dtype=storage, device=device)
        self.k_slots = self.k_cache.view(-1, kv_heads, head_dim)
        self.v_slots = self.v_cache.view(-1, kv_heads, head_dim)
        # [1, kv_heads, num_slots, head_dim] views, as PagedKV has (strided here)
        self.k_heads = self.k_slots.transpose(0, 1).unsqueeze(0)
        self.v_heads = self.v_slots.transpose(0, 1).unsqueeze(0)
        self.nbytes = 2 * self.k_cache.nbytes


@dataclass
class CudaMeta(AttentionMetadata):
    wrapper: Any = None  # the planned FlashInfer wrapper every layer runs
    graph_rows: int = 0  # a pure-decode step of this many rows (0: none)


@dataclass
class _Graph:
    graph: Any
    wrapper: Any
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor | None = None


class CudaBackend(TorchBackend):
    name = "cuda"

    def __init__(self, device: torch.device, *, cuda_graphs: bool = True, max_num_seqs: int = 8,
                 tp_size: int = 1) -> None:
        super().__init__(device)
        self.use_graphs = cuda_graphs and tp_size == 1
        self.max_rows = max_num_seqs
        self.heads = 0
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._graph_workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graphs: dict[int, _Graph] = {}
        self._model: torch.nn.Module | None = None

    def describe(self) -> str:
        graphs = f"graphs for 1..{self.max_rows} rows" if self.use_graphs else "no graphs"
        quant = " (quantised KV: torch path)" if self.pools and self.pools[0].quantized else ""
        return f"cuda (flashinfer {getattr(flashinfer, '__version__', '?')}, {graphs}){quant}"

    def prepare_model(self, model: Any, *, max_num_seqs: int,
                      max_batched_tokens: int, tp_size: int) -> None:
        self._model = model
        layers = model.attention_layers
        self.heads = layers[0].num_heads
        if self.use_graphs:  # a captured graph holds the rotary table's address: never grow it
            model.rotary.ensure(model.cfg.max_position_embeddings)

    def allocate_kv(self, layers: list[tuple[int, int]], num_blocks: int, block_size: int, *,
                    kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype
                    ) -> list[PagedKV]:
        self._graphs = {}  # graphs hold the old pools' addresses
        self.pools = []
        if storage is None:  # quantised: the torch path's pools
            return super().allocate_kv(layers, num_blocks, block_size, kv_dtype=kv_dtype,
                                       storage=storage, compute=compute)
        self.pools = [NhdKV(num_blocks, block_size, kvh, d, storage=storage, compute=compute,
                            kv_dtype=kv_dtype, device=self.device) for kvh, d in layers]
        self._kv_dtype = storage
        self._q_dtype = compute
        self._graph_index_cap = max(1, self.max_rows) * num_blocks
        return self.pools

    # ---- per step ------------------------------------------------------------------------

    def plan(self, step: StepPlan) -> AttentionMetadata:
        if not self.pools or self.pools[0].quantized:
            return super().plan(step)
        bs = step.block_size
        lens = [p + 1 for p in step.decode_positions] + [r.num_computed + r.end - r.start
                                                         for r in step.prefills]
        tables = list(step.decode_tables) + [r.block_table for r in step.prefills]
        indptr, indices, last = [0], [], []
        for table, n in zip(tables, lens, strict=True):
            used = _used_blocks(table, n, bs, step.num_blocks)
            indices.extend(used)
            indptr.append(len(indices))
            last.append(n - (len(used) - 1) * bs)
        if any(not 0 <= b < step.num_blocks for b in indices):
            raise ValueError(f"block table holds a block outside the pool of {step.num_blocks} "
                             "blocks")
        i32 = torch.int32
        indptr_t, last_t = torch.tensor(indptr, dtype=i32), torch.tensor(last, dtype=i32)
        indices_t = torch.tensor(indices, dtype=i32)
        meta = CudaMeta(slot_mapping=step.slot_mapping, backend=self, num_decode=step.num_decode)
        kvh, d = self.pools[0].num_kv_heads, self.pools[0].head_dim
        common = dict(q_data_type=self._q_dtype, kv_data_type=self._kv_dtype)
        if not step.prefills:
            b = step.num_decode
            if self.use_graphs and b <= self.max_rows:
                meta.graph_rows = b
                meta.wrapper = self._graph_wrapper(b)
            else:
                meta.wrapper = self._decode
            meta.wrapper.plan(indptr_t, indices_t.to(self.device), last_t, self.heads, kvh, d,
                              bs, pos_encoding_mode="NONE", **common)
            return meta
        qo = [0]
        for _ in step.decode_positions:
            qo.append(qo[-1] + 1)
        for r in step.prefills:
            qo.append(qo[-1] + r.end - r.start)
        self._prefill.plan(torch.tensor(qo, dtype=i32), indptr_t, indices_t.to(self.device),
                           last_t, self.heads, kvh, d, bs, causal=True, **common)
        meta.wrapper = self._prefill
        return meta

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        if not isinstance(meta, CudaMeta):  # quantised pool: the torch path
            return super().forward(layer, q, k, v, meta)
        kv = self.pools[layer]
        kv.k_slots.index_copy_(0, meta.slot_mapping, k.to(kv.k_slots.dtype))
        kv.v_slots.index_copy_(0, meta.slot_mapping, v.to(kv.v_slots.dtype))
        return meta.wrapper.run(q.contiguous(), (kv.k_cache, kv.v_cache))

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: Any, logits_rows: torch.Tensor | None) -> torch.Tensor:
        b = getattr(meta, "graph_rows", 0)
        if not b or logits_rows is not None:
            return model(input_ids, positions, meta, logits_rows)
        g = self._graphs.get(b)
        if g is None or g.graph is None:
            g = self._capture(model, b, input_ids, positions, meta)
        g.ids.copy_(input_ids)
        g.positions.copy_(positions)
        g.slots.copy_(meta.slot_mapping)
        g.graph.replay()
        assert g.out is not None  # set by the capture
        return g.out.clone()  # the static output is overwritten by the next replay

    # ---- CUDA graphs ---------------------------------------------------------------------

    def _graph_wrapper(self, b: int) -> Any:
        g = self._graphs.get(b)
        if g is None:
            dev, i32 = self.device, torch.int32
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._graph_workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=i32, device=dev),
                paged_kv_indices_buffer=torch.zeros(self._graph_index_cap, dtype=i32,
                                                    device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=i32, device=dev))
            ids, positions, slots = (torch.zeros(b, dtype=torch.long, device=dev)
                                     for _ in range(3))
            g = self._graphs[b] = _Graph(None, wrapper, ids, positions, slots)
        return g.wrapper

    def _capture(self, model: torch.nn.Module, b: int, input_ids: torch.Tensor,
                 positions: torch.Tensor, meta: CudaMeta) -> _Graph:
        """Capture a b-row decode step over this step's (already planned) inputs."""
        g = self._graphs[b]
        g.ids.copy_(input_ids)
        g.positions.copy_(positions)
        g.slots.copy_(meta.slot_mapping)
        static = CudaMeta(slot_mapping=g.slots, backend=self, num_decode=b, wrapper=g.wrapper,
                          graph_rows=b)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up off the capture (allocator, lazy inits)
            model(g.ids, g.positions, static, None)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g.out = model(g.ids, g.positions, static, None)
        g.graph = graph
        log.info("kernels.cuda_graph_captured", rows=b)
        return g
