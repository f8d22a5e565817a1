"""llama.cpp's mmproj tensors put back into the Hugging Face tensors of Qwen3.5's tower.

convert_hf_to_gguf.py's Qwen3VLVisionModel (with gguf-py's MMPROJ tensor names) writes
``model.visual.*`` as:

- ``v.patch_embd.weight`` and ``v.patch_embd.weight.1``: the Conv3d kernel
  [hidden, C, T=2, P, P] split along T into two Conv2d kernels (stacked back here);
  ``v.patch_embd.bias``;
- ``v.position_embd.weight`` the learned grid (pos_embed);
- ``v.blk.N.{ln1, ln2, attn_qkv, attn_out, ffn_up, ffn_down}``: norm1, norm2,
  attn.qkv, attn.proj, mlp.linear_fc1, mlp.linear_fc2 (Qwen2-VL's converter split the
  qkv into ``attn_q`` / ``attn_k`` / ``attn_v``: put back together);
- ``v.post_ln``, ``mm.0``, ``mm.2``: the merger's norm, linear_fc1, linear_fc2.

Any other tensor is refused by name: the file holds a tower ours does not run. The
metadata (and the shapes) are checked before, by helexa/checkpoint/mmproj.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from helexa.checkpoint.gguf import GgufError, reader
from helexa.neuron.formats.gguf.hybrid import as_float, value_of

_ROOT = "model.visual."
_BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj",
          "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}
_TOP = {"v.patch_embd.bias": "patch_embed.proj.bias", "v.position_embd.weight": "pos_embed.weight",
        "v.post_ln.weight": "merger.norm.weight", "v.post_ln.bias": "merger.norm.bias",
        "mm.0.weight": "merger.linear_fc1.weight", "mm.0.bias": "merger.linear_fc1.bias",
        "mm.2.weight": "merger.linear_fc2.weight", "mm.2.bias": "merger.linear_fc2.bias"}
_SPLIT_QKV = re.compile(r"v\.blk\.(\d+)\.attn_([qkv])\.(weight|bias)")


def hf_name(name: str) -> str:
    """The HF name of one mmproj tensor (the split patch kernel and q / k / v aside)."""
    if name in _TOP:
        return _ROOT + _TOP[name]
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _BLOCK:
        return f"{_ROOT}blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    raise GgufError(f"tensor {name!r}: not a tensor of the Qwen3-VL merger tower "
                    "(clip.projector_type qwen3vl_merger)")


def mmproj_pieces(path: Path) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(HF name, float tensor in the HF layout, bytes read) of every tower tensor in the
    file; a tensor held back to join its parts yields with the last of them."""
    kernel: dict[int, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for t in reader(path).tensors:
        value = as_float(value_of(t.name, t.tensor_type.name, t.data))
        nbytes = int(t.n_bytes)
        if t.name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            kernel[int(t.name.endswith(".1"))] = value  # frame t of [hidden, C, P, P]
            if len(kernel) == 2:  # the Conv3d kernel [hidden, C, T, P, P] again
                yield _ROOT + "patch_embed.proj.weight", torch.stack([kernel[0], kernel[1]], 2), nbytes
            else:
                yield "", value, nbytes  # bytes read, nothing to load yet
            continue
        m = _SPLIT_QKV.fullmatch(t.name)
        if m:
            parts = qkv.setdefault((m.group(1), m.group(3)), {})
            parts[m.group(2)] = value
            if len(parts) == 3:
                name = f"{_ROOT}blocks.{m.group(1)}.attn.qkv.{m.group(3)}"
                yield name, torch.cat([parts["q"], parts["k"], parts["v"]]), nbytes
            else:
                yield "", value, nbytes
            continue
        yield hf_name(t.name), value, nbytes
    if len(kernel) == 1:  # temporal_patch_size 1: one frame, T = 1
        yield _ROOT + "patch_embed.proj.weight", kernel[0].unsqueeze(2), 0
