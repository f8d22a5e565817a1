"""Qwen3.5's vision tower: images (as patches) in, one vector per image token out.

As transformers' Qwen3_5VisionModel, on the parallel layers:
1. patch embedding: a Conv3d whose kernel equals its stride is one matmul over each
   flattened patch [C × T × P × P] (held as a linear, whole on every card);
2. a learned square grid of position embeddings, bilinearly interpolated (corners
   aligned) to each image's patch grid, added;
3. `depth` pre-norm blocks (LayerNorm, attention within each image with 2-D rotary on
   (row, column), LayerNorm, GELU MLP): qkv and fc1 column-parallel, proj and fc2
   row-parallel, so tensor parallelism splits the heads as in the text model;
4. the merger: LayerNorm, then each merge² block of patches (consecutive in the
   input's order, patches.py) concatenated and projected into the text model's width.

Checkpoint names (`model.visual.*`) are our parameter names under `visual.`; the fused
qkv is split per rank by its q | k | v thirds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helexa.checkpoint.vision_shape import VisionShape
from helexa.neuron.models.layers import (
    ColumnParallelLinear,
    HotModule,
    RowParallelLinear,
    SliceGetter,
    _copy_checked,
    _set_loader,
    replicated_loader,
)

_ACT = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu}


class FusedQKVColumnLinear(ColumnParallelLinear):
    """[q | k | v] in one checkpoint tensor; each rank holds its heads' rows of all three."""

    def __init__(self, dim: int, **kw: Any) -> None:
        super().__init__(dim, 3 * dim, bias=True, **kw)
        self.dim = dim

    def weight_loader(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        per = self.dim // self.tp_size
        start = self.tp_rank * per
        parts = [loaded[i * self.dim + start: i * self.dim + start + per] for i in range(3)]
        _copy_checked(param.data, torch.cat(parts), "vision qkv shard")


class LayerNorm(HotModule):
    def __init__(self, size: int, *, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = _set_loader(nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                               requires_grad=False), replicated_loader)
        self.bias = _set_loader(nn.Parameter(torch.zeros(size, dtype=dtype, device=device),
                                             requires_grad=False), replicated_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-6)


class PatchEmbed(HotModule):
    def __init__(self, v: VisionShape, *, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = _set_loader(nn.Parameter(torch.empty(v.hidden_size, v.patch_dim,
                                                           dtype=dtype, device=device),
                                               requires_grad=False), self._load_kernel)
        self.bias = _set_loader(nn.Parameter(torch.empty(v.hidden_size, dtype=dtype,
                                                         device=device), requires_grad=False),
                                replicated_loader)

    def _load_kernel(self, param: nn.Parameter, loaded: SliceGetter, shard_id: Any = None) -> None:
        kernel = loaded[:]  # [hidden, C, T, P, P]: a stride-P conv is a matmul per patch
        _copy_checked(param.data, kernel.reshape(kernel.shape[0], -1), "patch embedding")

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight, self.bias)


class VisionAttention(HotModule):
    def __init__(self, v: VisionShape, **kw: Any) -> None:
        super().__init__()
        self.qkv = FusedQKVColumnLinear(v.hidden_size, **kw)
        self.proj = RowParallelLinear(v.hidden_size, v.hidden_size, bias=True, **kw)
        self.num_heads = v.num_heads // kw["tp_size"]
        self.head_dim = v.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n, h, d = x.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv(x).view(n, 3, h, d).unbind(1)
        q, k = _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)
        out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
        start = 0
        for length in lengths:  # each image attends to itself only, both ways
            s = slice(start, start + length)
            # [1, heads, n, d]: 4-D is what the fused (flash) kernels take; 3-D falls back
            # to the math path, which materialises n × n scores
            out[s] = F.scaled_dot_product_attention(
                *(t[s].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))[0].transpose(0, 1)
            start += length
        return self.proj(out.reshape(n, h * d))


class VisionBlock(HotModule):
    def __init__(self, v: VisionShape, **kw: Any) -> None:
        super().__init__()
        norm_kw = {"dtype": kw["dtype"], "device": kw["device"]}
        self.norm1 = LayerNorm(v.hidden_size, **norm_kw)
        self.attn = VisionAttention(v, **kw)
        self.norm2 = LayerNorm(v.hidden_size, **norm_kw)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size, _ACT[v.hidden_act], **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin_signed, lengths)
        return x + self.mlp(self.norm2(x))


class VisionMLP(HotModule):
    def __init__(self, width: int, inner: int, act: Any, out: int | None = None,
                 **kw: Any) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(width, inner, bias=True, **kw)
        self.linear_fc2 = RowParallelLinear(inner, out or width, bias=True, **kw)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Merger(VisionMLP):
    """LayerNorm, then each merge² block of patches as one row through the MLP (exact GELU)."""

    def __init__(self, v: VisionShape, **kw: Any) -> None:
        super().__init__(v.merged_size, v.merged_size, F.gelu, v.out_hidden_size, **kw)
        self.merged = v.merged_size
        self.norm = LayerNorm(v.hidden_size, dtype=kw["dtype"], device=kw["device"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x).view(-1, self.merged))


@dataclass
class TowerState:
    """An encoding part-way: the hidden state after `done` blocks, and what blocks read."""

    x: torch.Tensor
    cos: torch.Tensor
    sin_signed: torch.Tensor
    lengths: list[int]
    done: int = 0  # blocks run so far


class VisionTower(nn.Module):
    """patches [N, C × T × P × P] of images with patch grids `grids` -> [N / merge², out]."""

    def __init__(self, v: VisionShape, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        super().__init__()
        if v.num_heads % tp_size or v.hidden_size % tp_size:
            raise ValueError(f"vision tower: {v.num_heads} heads not divisible by tp={tp_size}")
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.shape = v
        self.patch_embed = PatchEmbed(v, dtype=dtype, device=device)
        self.pos_embed = _set_loader(nn.Parameter(torch.empty(
            v.num_position_embeddings, v.hidden_size, dtype=dtype, device=device),
            requires_grad=False), replicated_loader)
        self.side = int(v.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(v, **kw) for _ in range(v.depth))
        self.merger = Merger(v, **kw)
        half = v.head_dim // 2  # h and w each rotate a quarter of the head's frequencies
        self.inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float)
                                                / half)).to(device)

    @staticmethod
    def parameter_of(name: str) -> str | None:
        """Our parameter (under the tower) of checkpoint tensor `name`, None if not the tower's."""
        for root in ("model.visual.", "visual."):
            if name.startswith(root):
                name = name[len(root):]
                return "pos_embed" if name == "pos_embed.weight" else name.replace(
                    "patch_embed.proj.", "patch_embed.")
        return None

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        state = self.embed(patches, grids)
        self.run_blocks(state, 0, len(self.blocks))
        return self.merger(state.x)

    def embed(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> TowerState:
        """The tower's input (patch embedding and position grid) and what every block reads:
        `forward` is embed, run_blocks over all blocks, merger. The engine runs the blocks a
        few at a time over several steps (engine/encoder_steps.py): the same operations in
        the same order, so the same output."""
        x = self.patch_embed(patches)
        x = x + self.position_grid(grids).to(x.dtype)
        cos, sin_signed = self.rotary(grids, x.device)
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # one frame attends to itself
        return TowerState(x, cos, sin_signed, lengths)

    def run_blocks(self, state: TowerState, start: int, end: int) -> None:
        """Blocks [start, end) over `state`, which must have run exactly blocks [0, start)."""
        if state.done != start or not 0 <= start <= end <= len(self.blocks):
            raise ValueError(f"vision tower: blocks [{start}, {end}) after {state.done} of "
                             f"{len(self.blocks)}")
        for block in self.blocks[start:end]:
            state.x = block(state.x, state.cos, state.sin_signed, state.lengths)
        state.done = end

    def position_grid(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned grid resampled to each image's (h, w) patches, in merge-block order."""
        side, m = self.side, self.shape.spatial_merge_size
        table = self.pos_embed.view(side, side, -1)
        out = []
        for t, h, w in grids:
            y0, y1, fy = _taps(h, side, table.device)
            x0, x1, fx = _taps(w, side, table.device)
            # a few output rows at a time: one row's resampling spans the table's width
            # (side), more than the image's for a narrow one, so the whole image's held
            # side / w times the grid; the same products either way
            step = min(h, max(m, (h * w) // side // m * m))
            parts = []
            for a in range(0, h, step):
                b = min(h, a + step)
                rows = (table[y0[a:b]] * (1 - fy[a:b])[:, None, None]
                        + table[y1[a:b]] * fy[a:b, None, None])
                parts.append(rows[:, x0] * (1 - fx)[None, :, None]
                             + rows[:, x1] * fx[None, :, None])
            grid = torch.cat(parts) if len(parts) > 1 else parts[0]
            grid = grid.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)
            out.append(grid.repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids: list[tuple[int, int, int]], device: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-carrying sin [N, 1, head_dim] (fp32) of each patch's (row, column)."""
        m = self.shape.spatial_merge_size
        rows, cols = [], []
        for t, h, w in grids:
            r = torch.arange(h, device=device)[:, None].expand(h, w)
            c = torch.arange(w, device=device)[None, :].expand(h, w)
            rows.append(r.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
            cols.append(c.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t))
        freqs = torch.cat([torch.cat(rows)[:, None] * self.inv_freq,
                           torch.cat(cols)[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout over the whole head
        sign = torch.ones(emb.shape[-1], device=device)
        sign[: emb.shape[-1] // 2] = -1.0
        return emb.cos()[:, None], (emb.sin() * sign)[:, None]


def _taps(n: int, side: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (corners aligned) of n target points over a side-long grid."""
    src = torch.arange(n, device=device, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    lo = src.floor().long().clamp(0, side - 1)
    return lo, (lo + 1).clamp(max=side - 1), src - lo


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary in fp32, as transformers' apply_rotary_pos_emb_vision: the same
    products and sums, in place, so that two fp32 copies of x are live at once (the
    encoder's headroom, checkpoint/vision_shape.py, counts two), not four."""
    xf = x.to(torch.float32, copy=True)
    rolled = torch.roll(xf, xf.shape[-1] // 2, dims=-1)
    return xf.mul_(cos).addcmul_(rolled, sin_signed).to(x.dtype)
