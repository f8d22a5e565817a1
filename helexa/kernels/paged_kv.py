"""Paged KV storage: one layer's K and V pool, addressed by flat slot.

Cache layout, per layer: K and V tensors seen as [num_blocks, block_size, kv_heads, head_dim],
stored head-major (each kv head's slots contiguous: a head's run of slots is one
contiguous [T, head_dim] matrix, what SDPA reads fastest). Token ``t`` of a
sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``
of the flattened [num_slots, kv_heads, head_dim] view. A pool holds what its layer's
memory statement counts (helexa/checkpoint/layer_memory.py AttentionSpec: K and V of
``bytes_per_token`` per token), which the model runner checks against the plan at load.
The cuda backend's plain-dtype pools keep FlashInfer's token-major pages (:class:`NhdKV`).
"""

from __future__ import annotations

import torch

from helexa.kernels import kv_quant


class PagedKV:
    """One layer's K and V pool, addressed by flat slot.

    Plain kv dtypes keep K and V head-major ([kv_heads, num_slots, head_dim] storage),
    seen as [num_blocks, block_size, kv_heads, head_dim] (``k_cache`` / ``v_cache``),
    flat [num_slots, kv_heads, head_dim] (``k_slots`` / ``v_slots``) and
    [1, kv_heads, num_slots, head_dim] (``k_heads`` / ``v_heads``) views. Quantised ones (fp8_e4m3, int8, int4) keep
    kernels.kv_quant's data + per-token-head scales, quantised on write and
    dequantised to the compute dtype on gather.
    """

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 kv_dtype: str, storage: torch.dtype | None, compute: torch.dtype,
                 device: torch.device | str) -> None:
        self.kv_dtype, self.head_dim, self.compute = kv_dtype, head_dim, compute
        self.num_kv_heads = kv_heads
        self.quantized = kv_quant.is_quantized(kv_dtype)
        if self.quantized:
            spec = kv_quant.quant_spec(kv_dtype, head_dim)
            self.k_data, self.k_scale = kv_quant.allocate(spec, num_blocks, block_size, kv_heads,
                                                          device)
            self.v_data, self.v_scale = kv_quant.allocate(spec, num_blocks, block_size, kv_heads,
                                                          device)
            self.k_cache, self.v_cache = self.k_data, self.v_data
            self.nbytes = 2 * (self.k_data.nbytes + self.k_scale.nbytes)
        else:
            shape = (1, kv_heads, num_blocks * block_size, head_dim)
            # Zeroed, so padded gather rows (masked out) never hold NaN/inf.
            # [1, kv_heads, num_slots, head_dim]: a run of slots is one narrow away from the
            # layout SDPA takes, contiguous per head.
            self.k_heads = torch.zeros(shape, dtype=storage, device=device)
            self.v_heads = torch.zeros(shape, dtype=storage, device=device)
            self.k_slots = self.k_heads[0].transpose(0, 1)  # [num_slots, kv_heads, head_dim]
            self.v_slots = self.v_heads[0].transpose(0, 1)
            self.k_cache = self.k_slots.unflatten(0, (num_blocks, block_size))
            self.v_cache = self.v_slots.unflatten(0, (num_blocks, block_size))
            self.nbytes = 2 * self.k_heads.nbytes

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' k, v [N, kv_heads, head_dim] at their slots."""
        if self.quantized:
            kv_quant.write_quantized(self.k_data, self.k_scale, slot_mapping, k, self.kv_dtype)
            kv_quant.write_quantized(self.v_data, self.v_scale, slot_mapping, v, self.kv_dtype)
        else:
            write_kv(self.k_slots, self.v_slots, slot_mapping, k, v)

    def span(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [start, start + length): views when plain (no copy)."""
        if self.quantized:
            return self.gather(torch.arange(start, start + length, device=self.k_data.device))
        k = self.k_slots.narrow(0, start, length)
        v = self.v_slots.narrow(0, start, length)
        if k.dtype != self.compute:
            k, v = k.to(self.compute), v.to(self.compute)
        return k, v

    def span_heads(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As span, shaped [1, kv_heads, length, head_dim] for SDPA."""
        if self.quantized or self.k_cache.dtype != self.compute:
            k, v = self.span(start, length)
            return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        return self.k_heads.narrow(2, start, length), self.v_heads.narrow(2, start, length)

    def gather_heads(self, slots: torch.Tensor,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given slots head-major: [kv_heads, len(slots), head_dim] in the compute
        dtype, into ``out`` (buffers of at least that many elements) when given."""
        if self.quantized or self.k_heads.dtype != self.compute:
            k, v = self.gather(slots)
            return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        if out is None:
            return self.k_heads[0].index_select(1, slots), self.v_heads[0].index_select(1, slots)
        n = self.k_heads.shape[1] * slots.numel() * self.head_dim
        k = out[0].view(-1)[:n].view(self.k_heads.shape[1], slots.numel(), self.head_dim)
        v = out[1].view(-1)[:n].view(k.shape)
        torch.index_select(self.k_heads[0], 1, slots, out=k)
        torch.index_select(self.v_heads[0], 1, slots, out=v)
        return k, v

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the given slots: [len(slots), kv_heads, head_dim] in the compute dtype."""
        if self.quantized:
            return (kv_quant.gather_dequantized(self.k_data, self.k_scale, slots, self.kv_dtype,
                                                self.head_dim, self.compute),
                    kv_quant.gather_dequantized(self.v_data, self.v_scale, slots, self.kv_dtype,
                                                self.head_dim, self.compute))
        k, v = self.k_slots.index_select(0, slots), self.v_slots.index_select(0, slots)
        if k.dtype != self.compute:
            k, v = k.to(self.compute), v.to(self.compute)
        return k, v


class NhdKV(PagedKV):
    """A plain-dtype pool in FlashInfer's NHD page layout, the cuda backend's
    (backends/cuda.py): [num_blocks, block_size, kv_heads, head_dim], token-major where
    PagedKV is head-major; the same flat slots."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 storage: torch.dtype, compute: torch.dtype, kv_dtype: str,
                 device: torch.device) -> None:
        self.kv_dtype, self.head_dim, self.compute = kv_dtype, head_dim, compute
        self.num_kv_heads, self.quantized = kv_heads, False
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=storage, device=device)
        self.v_cache = torch.zeros(shape, dtype=storage, device=device)
        self.k_slots = self.k_cache.view(-1, kv_heads, head_dim)
        self.v_slots = self.v_cache.view(-1, kv_heads, head_dim)
        # [1, kv_heads, num_slots, head_dim] views, as PagedKV has (strided here)
        self.k_heads = self.k_slots.transpose(0, 1).unsqueeze(0)
        self.v_heads = self.v_slots.transpose(0, 1).unsqueeze(0)
        self.nbytes = 2 * self.k_cache.nbytes


def write_kv(k_slots: torch.Tensor, v_slots: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' k, v [N, kv_heads, head_dim] at their slots.

    k_slots / v_slots are a layer's caches viewed flat: [num_slots, kv_heads, head_dim].
    """
    if k.dtype != k_slots.dtype:
        k, v = k.to(k_slots.dtype), v.to(v_slots.dtype)
    k_slots.index_copy_(0, slot_mapping, k)
    v_slots.index_copy_(0, slot_mapping, v)

