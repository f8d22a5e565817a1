"""The products every quantised format installs: a layer's packed weight on one op.

A format's method ends by installing one of these as the layer's ``kernel``
(x -> x @ W^T + b, as ParallelLinearBase calls it) over buffers in the one layout
of each op in helexa/kernels/quant.py: int8 (a scale a row), grouped int8 (``w = q *
scale + zero`` per contiguous group) or tinygemm int4. An embedding table gathers
int8 rows instead (``lookup``). The kernels hold only references to their layer's
buffers; the device backend may read them (helexa/kernels/backends/cpu.py measures
grouped int8's decode kernels at load).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from helexa.kernels import quant as qk
from helexa.kernels.cuda import int4_tiles
from helexa.neuron.models import deferred
from helexa.neuron.models.layers import TensorSlice


class QuantConfigError(ValueError):
    """A quantisation that this model's shapes (or this tp) cannot take."""


class Int8Linear:
    """kernel(x, bias) for an int8 layer; holds nothing but references to its buffers."""

    def __init__(self, mod: nn.Module, perm: torch.Tensor | None = None) -> None:
        self.mod = mod
        self.perm = perm  # GPTQ act-order: inputs gathered into the weight's column order

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int8_linear(x, self.mod.qweight, self.mod.qscales, bias)

    def prepare(self, max_num_seqs: int) -> None:
        """On CUDA: the grouped int8 kernel it runs on (one group a row) proves itself and
        compiles for this layer now, not in a graph capture or the first request's step."""
        if self.mod.qweight.device.type == "cuda":
            _warm(self, self.mod.qweight.shape[1], self.mod.qscales, max_num_seqs)

    def dequantized(self) -> torch.Tensor:
        return qk.dequantize_int8(self.mod.qweight, self.mod.qscales)


def _warm(kernel: Any, k: int, scales: torch.Tensor, max_num_seqs: int) -> None:
    """One call of ``kernel`` at one row and at two (the row buckets the CPU kernels
    measure), each of k zero inputs in the scales' dtype."""
    with torch.inference_mode():
        for rows in sorted({1, min(max_num_seqs, 2)}):
            kernel(torch.zeros(rows, k, dtype=scales.dtype, device=scales.device), None)


class Int4Linear:
    kind = "int4"  # (the executor's describe: not a grouped int8 product)

    def __init__(self, mod: nn.Module, group_size: int, q: torch.Tensor,
                 perm: torch.Tensor | None = None) -> None:
        self.mod, self.group_size, self.n = mod, group_size, q.shape[0]
        self.perm = perm  # GPTQ act-order: inputs gathered into group order first

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int4_linear(x, self.mod.qweight, self.group_size, self.n,
                              self.mod.qscales_zeros, bias)

    def prepare(self, max_num_seqs: int) -> None:
        """On CUDA: the tiles a prefill chunk's rows take prove themselves for this layer's
        kind now (helexa/kernels/cuda/int4_tiles.py), not in the first request's prefill."""
        int4_tiles.prepare(self.mod.qweight, self.group_size, qk.int4_pack_cuda)


class Int8gLinear:
    """kernel(x, bias) for a grouped int8 layer (w = q * scale + zero per group)."""

    def __init__(self, mod: nn.Module, group_size: int, perm: torch.Tensor | None = None) -> None:
        self.mod, self.group_size = mod, group_size
        self.perm = perm  # GPTQ act-order: inputs gathered into group order first

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return qk.int8g_linear(x, self.mod.qweight, self.mod.qscales,
                               getattr(self.mod, "qzeros", None), self.group_size, bias)

    def prepare(self, max_num_seqs: int) -> None:
        """Make the op choose its kernels for this layer now (helexa/kernels/cpu/int8g.py measures
        at the first call of each row bucket), not in the first request's decode step."""
        _warm(self, self.mod.qweight.shape[1], self.mod.qscales, max_num_seqs)

    def dequantized(self) -> torch.Tensor:
        """The float weight [N, K] in the inputs' own order."""
        w = qk.dequantize_int8g(self.mod.qweight, self.mod.qscales,
                                getattr(self.mod, "qzeros", None), self.group_size)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def install_int4(mod: nn.Module, q: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor,
                 dtype: torch.dtype, perm: torch.Tensor | None = None) -> None:
    """q 0..15 [N, K] with ``w = (q - 8) * scale + zero`` per contiguous group [N, G] -> the
    int4 op; a group the op does not take (per channel, say) is split evenly: same values."""
    group = q.shape[1] // scale.shape[1]
    if group not in qk.INT4_GROUP_SIZES:
        op_group = next((g for g in reversed(qk.INT4_GROUP_SIZES) if group % g == 0), None)
        if op_group is None:
            raise QuantConfigError(f"int4 group of {group} inputs: the int4 op takes "
                                   f"groups of {qk.INT4_GROUP_SIZES}")
        scale = scale.repeat_interleave(group // op_group, dim=1)
        zeros = zeros.repeat_interleave(group // op_group, dim=1)
        group = op_group
    mod.register_buffer("qweight", qk.int4_pack(q), persistent=False)
    mod.register_buffer("qscales_zeros", qk.int4_scales_zeros(scale, zeros, dtype),
                        persistent=False)
    if perm is not None:
        mod.register_buffer("qperm", perm, persistent=False)
    mod.kernel = Int4Linear(mod, group, q, perm)


def install_int8g(mod: nn.Module, q: torch.Tensor, scale: torch.Tensor,
                  zeros: torch.Tensor | None, dtype: torch.dtype,
                  perm: torch.Tensor | None = None) -> None:
    """int8 q [N, K] with ``w = q * scale + zero`` per contiguous group [N, G] -> the grouped
    int8 op (helexa/kernels/quant.py); one group per row is the per-channel op when symmetric.
    ``perm``: GPTQ act-order, q's columns are the inputs in that order."""
    group = q.shape[1] // scale.shape[1]
    if group * scale.shape[1] != q.shape[1]:
        raise QuantConfigError(f"grouped int8: {q.shape[1]} inputs are not {scale.shape[1]} "
                               "whole groups")
    if perm is not None:
        mod.register_buffer("qperm", perm, persistent=False)
    if zeros is None and scale.shape[1] == 1:
        mod.register_buffer("qweight", q.contiguous(), persistent=False)
        mod.register_buffer("qscales", scale[:, 0].to(dtype).contiguous(), persistent=False)
        mod.kernel = Int8Linear(mod, perm)
        return
    mod.register_buffer("qweight", q.contiguous(), persistent=False)
    mod.register_buffer("qscales", scale.to(dtype).contiguous(), persistent=False)
    if zeros is not None:
        mod.register_buffer("qzeros", zeros.to(dtype).contiguous(), persistent=False)
    mod.kernel = Int8gLinear(mod, group, perm)


class Int8Lookup:
    """Embedding rows from the int8 table: gathers int8 rows, scales only those."""

    def __init__(self, mod: nn.Module) -> None:
        self.mod = mod

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = F.embedding(ids, self.mod.qweight).to(dtype)
        return rows * self.mod.qscales[ids].to(dtype).unsqueeze(-1)


class Int8gLookup:
    """Embedding rows from a grouped int8 table: gathers int8 rows, dequantises only those."""

    def __init__(self, mod: nn.Module, group: int) -> None:
        self.mod, self.group = mod, group

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        mod = self.mod
        if dtype == torch.float32 and ids.device.type == "cpu" and mod.qscales.dim() == 2 \
                and mod.qweight.shape[-1] != mod.qscales.shape[-1] and all(
                    getattr(mod, b, mod.qscales).dtype == torch.float32
                    for b in ("qscales", "qzeros")):
            return self._numpy(ids)
        q = F.embedding(ids, mod.qweight)
        scales = mod.qscales[ids]
        if scales.dim() == ids.dim() + 1 and q.shape[-1] != scales.shape[-1]:
            rows = q.view(*ids.shape, scales.shape[-1], -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
            if hasattr(mod, "qzeros"):
                rows = rows + mod.qzeros[ids].to(dtype).unsqueeze(-1)
            return rows.view(*ids.shape, -1)
        return q.to(dtype) * scales.to(dtype).view(*ids.shape, 1)

    def _numpy(self, ids: torch.Tensor) -> torch.Tensor:
        """The same fp32 rows by numpy's indexing: a decode step's few ids took 48 µs in
        torch's five small ops and 18 µs here (the same products and sums, bit for bit)."""
        mod, i = self.mod, ids.numpy()
        groups = mod.qscales.shape[-1]
        q = mod.qweight.numpy()[i].reshape(*ids.shape, groups, -1).astype(np.float32)
        rows = q * mod.qscales.numpy()[i][..., None]  # fp32 scales and zeros (the caller's test)
        if hasattr(mod, "qzeros"):
            rows = rows + mod.qzeros.numpy()[i][..., None]
        return torch.from_numpy(rows.reshape(*ids.shape, -1))


class PackAsLoaded:
    """A packed checkpoint's layers, each packed into its op the moment the checkpoint's
    last piece of it is in. Its unpacked parts (one byte a value, and more, against the
    op's half byte for 4 bits) hold memory only from the layer's first piece on
    (deferred.until_loaded), so the load holds the packed model and the few layers in
    flight, never every layer unpacked at once: for a 72B AWQ file on one card that was
    ~70 GB before the first layer packed, against ~42 GB served. ``finish`` packs what
    is left (the same method, which runs once)."""

    def __init__(self) -> None:
        self.left: dict[int, int] = {}  # id(layer) -> its pieces not yet loaded

    def count(self, model: nn.Module, tie_word_embeddings: bool, parts: tuple[str, ...]) -> None:
        """After attach: each quantised layer's pieces to come, of its ``parts``."""
        from helexa.neuron.formats.base import LinearMethod
        from helexa.neuron.formats.tensor_map import expected_tensors

        layers = {n: m for n, m in model.named_modules()
                  if isinstance(getattr(m, "quant", None), LinearMethod)}
        for pname, _ in expected_tensors(model, tie_word_embeddings=tie_word_embeddings):
            prefix, _, leaf = pname.rpartition(".")
            if prefix in layers and leaf in parts:
                key = id(layers[prefix])
                self.left[key] = self.left.get(key, 0) + 1

    def part(self, layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             at: torch.device, load: Any) -> None:
        """Register ``layer``'s part ``name``, real at its first piece; ``load(param,
        loaded, shard)`` fills it, and the layer packs after its last."""
        p = deferred.until_loaded(shape, dtype, at)

        def loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
            load(deferred.real(layer, name), loaded, shard_id)
            left = self.left.get(id(layer))
            if left is not None:
                self.left[id(layer)] = left - 1
                if left == 1:
                    del self.left[id(layer)]
                    layer.quant.process_weights_after_loading(layer)

        p.weight_loader = loader  # type: ignore[attr-defined]
        layer.register_parameter(name, p)


def drop_float_weight(mod: nn.Module) -> tuple[torch.dtype, torch.device]:
    """Replace a layer's float weight by an empty buffer (its checkpoint holds other
    tensors in its place); the weight's (dtype, device)."""
    dtype, device = mod.weight.dtype, deferred.home(mod, mod.weight)
    del mod.weight
    mod.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)
    return dtype, device


class UnpackedSlice:
    """A SliceGetter over an unpacked checkpoint tensor (``fn`` of the whole tensor, once),
    so the layer's own weight loader takes this rank's rows or columns of it."""

    def __init__(self, sl: Any, fn: Any) -> None:
        self.sl, self.fn = sl, fn
        self._t: torch.Tensor | None = None

    def _tensor(self) -> torch.Tensor:
        if self._t is None:
            self._t = self.fn(self.sl[:])
        return self._t

    def get_shape(self) -> list[int]:
        return list(self._tensor().shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return TensorSlice(self._tensor())[index]
