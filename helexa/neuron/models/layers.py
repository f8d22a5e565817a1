"""Tensor-parallel layer classes with per-parameter weight loaders.

Each parameter carries ``weight_loader(param, loaded, shard_id)`` where ``loaded`` is a
lazy slice of the checkpoint tensor (safetensors' ``safe_open(...).get_slice(name)``, or a
:class:`TensorSlice` around a torch tensor) so a rank reads only the rows/columns it owns
and never materialises the full tensor (linear weights may start on meta: deferred.py).
With tp_size = 1 every layer is plain single-device code; with tp_size > 1 the
row-parallel and vocab-parallel layers all-reduce and the LM head all-gathers.

A row-parallel product a residual add and an RMSNorm follow (every attention, linear
attention, MLP and MoE output of a decoder layer) is built with ``defer=True``: it
returns its partial sums, and the norm's :meth:`RMSNorm.add` reduces them, adds the
residual stream and normalises, ``(norm(x + Σ y), x + Σ y)``: the plain path is one
all-reduce, an add and the norm; a device may install one kernel for all three
(``RMSNorm.fused``: FlashInfer's on CUDA, helexa/kernels/backends/cuda_comm.py). A decoder
layer therefore takes its normed input and the residual stream and hands the next norm
its output (the vLLM layout): ``forward(h, x) -> (y, x)``, the model's loop calling
:func:`decoder_stack`.

Sharding (vLLM / gpt-fast style):
- ColumnParallelLinear: output features split; no communication.
- RowParallelLinear: input features split; all-reduce of the partial sums.
- QKVParallelLinear: q heads split; kv heads split, or replicated when
  tp_size > num_kv_heads (rank r then holds kv head r * kv_heads // tp_size).
- MergedColumnParallelLinear: gate and up fused, each split by rank.
- VocabParallelEmbedding / ParallelLMHead: vocab rows split by rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helexa.kernels.backends.executor import LinearSite
from helexa.kernels.norm import rms_norm
from helexa.neuron.models import deferred

# Bytes each rank sends into collectives (tp > 1), for bench/tp.py; a plain int add per call.
COMM_STATS = {"bytes": 0}


def all_reduce(t: torch.Tensor) -> None:
    COMM_STATS["bytes"] += t.numel() * t.element_size()
    dist.all_reduce(t)


class SliceGetter(Protocol):
    """What a weight loader reads from: safetensors' PySafeSlice satisfies it."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


class HotModule(nn.Module):
    """An nn.Module whose call goes straight to forward (nn.Module's hooks cost ~5 µs a
    call, ~80 calls a decode step). These modules take no hooks."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)


class TensorSlice:
    """Adapts an in-memory tensor to the SliceGetter protocol (tests, tied weights)."""
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)


def _split_rows(loaded: SliceGetter, start: int, size: int) -> torch.Tensor:
    return loaded[start : start + size]


def _set_loader(param: nn.Parameter, loader: Any) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ParallelLinearBase(HotModule):
    """Holds weight [out_per_rank, in_per_rank] (+ optional bias) and the rank."""

    def __init__(
        self, in_per_rank: int, out_per_rank: int, bias: bool, *, tp_rank: int, tp_size: int,
        dtype: torch.dtype, device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.weight_home = tp_rank, tp_size, device
        at = deferred.place(device)  # meta while a quantised format decides (deferred.py)
        self.weight = _set_loader(
            nn.Parameter(torch.empty(out_per_rank, in_per_rank, dtype=dtype, device=at),
                         requires_grad=False),
            self.weight_loader,
        )
        self.bias = None
        if bias:
            self.bias = _set_loader(
                nn.Parameter(torch.empty(out_per_rank, dtype=dtype, device=at),
                             requires_grad=False),
                self.weight_loader,
            )

        # A device's product for this weight (helexa/kernels/backends/executor.py), same result:
        # kernel(x, bias) -> x @ W^T + bias. None: F.linear.
        self.kernel: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        # The linear method of a quantised layer (helexa/neuron/formats/base.py), set before loading;
        # once loaded it installs the layer's ``kernel`` and the float weight is freed.
        self.quant: Any = None

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        raise NotImplementedError

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ColumnParallelLinear(ParallelLinearBase):
    """y = x W^T with W's output rows split across ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if out_features % tp_size:
            raise ValueError(f"output size {out_features} not divisible by tp={tp_size}")
        super().__init__(in_features, out_features // tp_size, bias, tp_rank=tp_rank,
                         tp_size=tp_size, dtype=dtype, device=device)

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        rows = param.shape[0]
        _copy_checked(param.data, _split_rows(loaded, self.tp_rank * rows, rows), "column shard")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate/up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, **kw: Any) -> None:
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, **kw)

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        idx = int(shard_id)
        per_rank = [s // self.tp_size for s in self.out_sizes]
        offset = sum(per_rank[:idx])
        dst = param.data.narrow(0, offset, per_rank[idx])
        _copy_checked(dst, _split_rows(loaded, self.tp_rank * per_rank[idx], per_rank[idx]),
                      f"merged shard {idx}")


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: split when possible, one replicated head when tp > kv heads."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} kv heads not divisible by tp={tp_size}")
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(f"tp={tp_size} not a multiple of {num_kv_heads} kv heads")
    return 1


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; output layout per rank is [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads not divisible by tp={tp_size}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        ParallelLinearBase.__init__(self, hidden_size, out, bias, tp_rank=tp_rank,
                                    tp_size=tp_size, dtype=dtype, device=device)

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            dst_off, src_off, size = 0, self.tp_rank * q_size, q_size
        elif shard_id in ("k", "v"):
            # Replicated kv: several ranks read the same head.
            kv_head = self.tp_rank * self.total_kv_heads // self.tp_size
            if self.tp_size <= self.total_kv_heads:
                kv_head = self.tp_rank * self.num_kv_heads
            dst_off = q_size + (0 if shard_id == "k" else kv_size)
            src_off, size = kv_head * d, kv_size
        else:
            raise ValueError(f"unknown qkv shard {shard_id!r}")
        dst = param.data.narrow(0, dst_off, size)
        _copy_checked(dst, _split_rows(loaded, src_off, size), f"qkv shard {shard_id}")


class RowParallelLinear(ParallelLinearBase):
    """y = x W^T with W's input columns split; partial sums all-reduced across ranks, or
    (``defer``) left for the RMSNorm.add that follows (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, defer: bool = False) -> None:
        if in_features % tp_size:
            raise ValueError(f"input size {in_features} not divisible by tp={tp_size}")
        super().__init__(in_features // tp_size, out_features, bias, tp_rank=tp_rank,
                         tp_size=tp_size, dtype=dtype, device=device)
        self.defer = defer

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: whole, added once (rank 0) after the reduce
            _copy_checked(param.data, loaded[:], "row bias")
            return
        cols = param.shape[1]
        start = self.tp_rank * cols
        _copy_checked(param.data, loaded[:, start : start + cols], "row shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear(x, self.bias)
        y = self.linear(x, self.bias if self.tp_rank == 0 else None)
        if not self.defer:
            all_reduce(y)
        return y


class VocabParallelEmbedding(HotModule):
    """Embedding whose vocab rows are split across ranks (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _set_loader(
            nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size, dtype=dtype, device=device),
                         requires_grad=False),
            self.weight_loader,
        )
        self.dtype = dtype
        self.quant: Any = None  # as ParallelLinearBase.quant
        # lookup(ids, dtype) -> rows, for a quantised table (helexa/neuron/formats/methods.py); None: F.embedding
        self.lookup: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            return self.lookup(ids, self.dtype)
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        n = self.vocab_end - self.vocab_start
        _copy_checked(param.data[:n], loaded[self.vocab_start : self.vocab_end], "vocab shard")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(ids)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        out = self._rows(local) * mine.unsqueeze(-1).to(self.dtype)
        all_reduce(out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; logits gathered to the full vocab on every rank."""

    bias = None
    # As ParallelLinearBase.kernel (the embedding lookup keeps the plain weight).
    kernel: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.kernel(x, None) if self.kernel is not None else F.linear(x, self.weight)
        if self.tp_size == 1:
            return logits
        # Only rank 0 samples: gather the vocab slices there (other ranks get theirs back).
        logits = logits.contiguous()
        COMM_STATS["bytes"] += logits.numel() * logits.element_size()
        if self.tp_rank != 0:
            dist.gather(logits, None, dst=0)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class RMSNorm(HotModule):
    """RMSNorm over the last dim, computed in fp32 as transformers does. ``reduce``: its
    :meth:`add` receives a deferred row-parallel product's partial sums (tp > 1)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, reduce: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.reduce = reduce
        # A device's kernels (None, or a hook returning None for a step: the torch forms):
        # ``fused`` (y, x, weight | None, eps) -> (normed, summed) with the reduce (tp > 1),
        # ``add_kernel`` the same after it, ``kernel`` (x, weight | None, eps, out) -> normed.
        self.fused: Callable[..., Any] | None = None
        self.add_kernel: Callable[..., Any] | None = None
        self.kernel: Callable[..., Any] | None = None
        self.weight = _set_loader(
            nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False),
            replicated_loader,
        )
        self.folded = False  # True once the weight is folded into the next matmul

    def fold_into(self, *linears: nn.Module) -> None:
        """After loading: scale the input columns of the matmul(s) this norm feeds,
        W @ (w * x) == (W * w) @ x, so the norm itself multiplies by nothing. A quantised
        matmul keeps its checkpoint's weight (its error is the checkpoint's): the norm stays."""
        if any(getattr(lin, "quant", None) is not None for lin in linears):
            return
        with torch.no_grad():
            for lin in linears:
                lin.weight.mul_(self.weight.to(lin.weight.dtype))
        self.folded = True

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = None if self.folded else self.weight
        if self.kernel is not None and (y := self.kernel(x, weight, self.eps, out)) is not None:
            return y
        y = rms_norm(x, weight, self.eps)
        return y if out is None else out.copy_(y)

    def add(self, y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + y), x + y), y all-reduced first where ``reduce`` (its partial sums)."""
        w = None if self.folded else self.weight
        if self.fused is not None and (both := self.fused(y, x, w, self.eps)) is not None:
            return both
        if self.reduce:
            all_reduce(y)
        if self.add_kernel is not None and (both := self.add_kernel(y, x, w, self.eps)):
            return both
        x = x + y
        return self(x), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :d]) * x[..., d:] for x [..., 2d] (a merged gate/up product);
    the torch form. An MLP's ``silu_and_mul`` attribute is this unless a device's executor
    gave it a one-kernel form (cuda_fused.py)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class StackLayer(Protocol):
    """A decoder layer as :func:`decoder_stack` runs it."""

    input_layernorm: RMSNorm

    def __call__(self, h: torch.Tensor, x: torch.Tensor, *args: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


def decoder_stack(layers: Any, final_norm: RMSNorm, x: torch.Tensor, *args: Any
                  ) -> torch.Tensor:
    """Run decoder layers over the residual stream x (the embeddings): each takes its
    normed input and the stream and returns its output and the stream, which the next
    layer's input norm (the final norm after the last) adds and normalises. Returns the
    final normed hidden states."""
    stack: list[StackLayer] = list(layers)
    h = stack[0].input_layernorm(x)
    for i, layer in enumerate(stack):
        y, x = layer(h, x, *args)
        nxt = stack[i + 1].input_layernorm if i + 1 < len(stack) else final_norm
        h, x = nxt.add(y, x)
    return h


def replicated_loader(param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
    """Loader for parameters every rank holds whole (norms)."""
    _copy_checked(param.data, loaded[:], "replicated")


def linear_sites(model: nn.Module) -> list[LinearSite]:
    """The model's linear products as a device's executor sees them
    (helexa/kernels/backends/executor.py): every parallel linear and the LM head, whether
    quantised (its own op stays) and whether tied to the embedding (its layout stays)."""
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    return [LinearSite(m, quantised=m.quant is not None, tied=tied and isinstance(m, ParallelLMHead))
            for m in model.modules() if isinstance(m, ParallelLinearBase | ParallelLMHead)]
