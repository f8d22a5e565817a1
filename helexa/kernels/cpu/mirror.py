"""CPU batched decode over a per-layer mirror of the decode rows' context.

Each layer keeps its decode rows' context as [kv_heads, B, cap, d] K and V from step to
step while the rows stay the same requests, so a step appends its new token instead of
gathering every row's whole context again (a gather of the pool, rows padded to the
longest, when the rows change). Used by the ``cpu`` attention backend
(helexa/kernels/backends/cpu.py) for steps of several decode rows over plain KV, when all
layers' mirrors fit ``MIRROR_MAX_BYTES``; it is tested against the torch reference
(tests/kernels/test_attention.py, tests/kernels/test_backend_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helexa.kernels.backends.base import StepPlan, used_blocks
from helexa.kernels.paged_kv import PagedKV

MIRROR_MAX_BYTES = 256 * 2**20  # all layers' decode mirrors together, else gather
MIRROR_STEP = 128  # mirror capacity grows in steps of this many positions


@dataclass
class DecodeMirror:
    """This step's use of the layers' mirrors."""

    fill: bool  # the rows changed: gather PaddedDecode.slots (B * cap, rows padded) into it
    write_index: torch.Tensor  # [B] row * cap + position: where each row's new K/V go


@dataclass
class PaddedDecode:
    """Decode rows padded to the longest row's T positions, read with one gather per layer
    (or through the mirror, or as a view for one row over consecutive slots)."""

    length: int  # T
    slots: torch.Tensor | None = None  # [B * T] int64, rows padded to T (with slot 0, masked)
    mask: torch.Tensor | None = None  # [B, 1, 1, T] bool, None when no row is padded
    # One decode row whose blocks are consecutive: its context is slots [start, start + T).
    start: int | None = None
    # Preallocated K and V buffers of B * T * kv_heads * head_dim elements (any shape) the
    # gather fills, shared by every layer (a fresh 1-2 MB tensor per layer page-faults).
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    mirror: DecodeMirror | None = None


def padded_decode(q: torch.Tensor, kv: PagedKV, pd: PaddedDecode,
                  k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                  mirror: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per row over its padded context: q [B, heads, d] -> [B, heads, d]; with
    ``mirror`` (this layer's [kv_heads, B, cap, d] K and V) this step's k, v [B, kv_heads, d]
    are appended to it instead of gathering. Rows on SDPA's heads axis, kv heads on its
    batch axis (the GQA group folded into the query axis: no K/V head repeated)."""
    b, heads, d = q.shape
    t = pd.length
    if pd.start is not None:  # one row, consecutive blocks: views, no copy
        kc, vc = kv.span_heads(pd.start, t)  # [1, kvh, T, d]
        kvh = kc.shape[1]
        o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), kc, vc,
                                           attn_mask=pd.mask)
        return o.view(b, heads, d)
    assert pd.slots is not None or mirror is not None, "padded decode without slots"
    if pd.mirror is not None and mirror is not None:
        mk, mv = mirror  # [kvh, B, cap, d]
        kvh = mk.shape[0]
        flat_k, flat_v = mk.view(kvh, -1, d), mv.view(kvh, -1, d)
        if pd.mirror.fill:
            torch.index_select(kv.k_heads[0], 1, pd.slots, out=flat_k)
            torch.index_select(kv.v_heads[0], 1, pd.slots, out=flat_v)
        else:
            assert k is not None and v is not None  # appended: this step's own K/V
            flat_k.index_copy_(1, pd.mirror.write_index, k.transpose(0, 1))
            flat_v.index_copy_(1, pd.mirror.write_index, v.transpose(0, 1))
        kc, vc = mk.narrow(2, 0, t), mv.narrow(2, 0, t)
    else:
        assert pd.slots is not None
        kc, vc = kv.gather_heads(pd.slots, pd.buffers)  # [kvh, B*T, d]
        kvh = kc.shape[0]
        kc, vc = kc.view(kvh, b, t, d), vc.view(kvh, b, t, d)
    mask = pd.mask
    if mask is not None:  # [B, 1, 1, T] -> rows on the heads axis
        mask = mask.view(1, b, 1, t)
    o = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d).transpose(0, 1),
                                       kc, vc, attn_mask=mask)  # [kvh, B, group, d]
    return o.transpose(0, 1).reshape(b, heads, d)


class DecodeMirrors:
    """The layers' mirrors and which decode rows they hold.

    Reused while a step's rows are the same requests (the same block-table objects, which
    the engine keeps per request: held here so none is recycled) in the same order, each one
    token further, within capacity; else refilled from the pool. What they hold is taken as
    this step's once it is planned: a step that fails must call ``forget``."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        # The rows the mirrors hold: (block-table objects, positions, capacity).
        self._rows: tuple[list[list[int]], list[int], int] | None = None

    def reset(self, num_layers: int) -> None:
        self.layers, self._rows = [None] * num_layers, None

    def forget(self) -> None:
        self._rows = None

    def plan(self, step: StepPlan, pools: list[PagedKV]) -> PaddedDecode | None:
        """This step's decode rows through the mirrors, or None (then forgotten): plain KV
        of the compute dtype and all layers' mirrors within MIRROR_MAX_BYTES."""
        held, self._rows = self._rows, None
        kv0 = pools[0]
        if kv0.quantized or kv0.k_heads.dtype != kv0.compute:
            return None
        pos_list, bs, keys = step.decode_positions, step.block_size, step.decode_tables
        b, t = len(pos_list), max(pos_list) + 1
        same = held is not None and (
            len(held[0]) == b and t <= held[2]
            and all(x is y for x, y in zip(keys, held[0], strict=True))
            and all(p == q + 1 for p, q in zip(pos_list, held[1], strict=True)))
        cap = held[2] if held is not None and same else (t // MIRROR_STEP + 2) * MIRROR_STEP
        per_layer = 2 * kv0.num_kv_heads * b * cap * kv0.head_dim * kv0.k_heads.element_size()
        if per_layer * len(pools) > MIRROR_MAX_BYTES:
            return None
        pd = PaddedDecode(length=t)
        if not same:
            shape = (kv0.num_kv_heads, b, cap, kv0.head_dim)
            for i, m in enumerate(self.layers):
                if m is None or m[0].shape != shape:
                    self.layers[i] = (torch.empty(shape, dtype=kv0.compute),
                                      torch.empty(shape, dtype=kv0.compute))
            tables = [used_blocks(tab, p + 1, bs, step.num_blocks) for tab, p in
                      zip(keys, pos_list, strict=True)]
            span = torch.arange(cap)
            table = torch.tensor([tab + [0] * (-(-cap // bs) - len(tab)) for tab in tables],
                                 dtype=torch.long)
            pd.slots = (table[:, span // bs] * bs + span % bs).view(-1)
        index = torch.tensor([i * cap + p for i, p in enumerate(pos_list)], dtype=torch.long)
        pd.mirror = DecodeMirror(fill=not same, write_index=index)
        if min(pos_list) != t - 1:  # rows shorter than the longest are masked
            ar = torch.arange(t)
            pos = torch.tensor(pos_list, dtype=torch.long)
            pd.mask = (ar[None, :] <= pos[:, None]).view(b, 1, 1, t)
        self._rows = (keys, list(pos_list), cap)
        return pd
