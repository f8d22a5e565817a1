"""llama.cpp's tensor names and layouts put back into the Hugging Face tensors our models load.

Each llama.cpp tensor name maps to the HF name (:func:`hf_name`); llama-architecture
``attn_q`` / ``attn_k`` rows, which llama.cpp's converter permutes for its rotary
layout, are put back (:func:`unpermute`). The hybrid and MoE families' transforms
are hybrid.py's; :func:`tensor_pieces` answers for every family.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from helexa.checkpoint.gguf import HYBRID_ARCHITECTURES, GgufError
from helexa.neuron.formats.gguf import hybrid as hyb

_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = ("rope_freqs.weight",)  # rope comes from the config


def hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> the checkpoint name our models load (None: not a weight)."""
    if name in _SKIPPED:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    raise GgufError(f"tensor {name!r}: not a tensor of the dense llama/qwen families")


def unpermute(rows: torch.Tensor | np.ndarray, heads: int) -> Any:
    """Undo llama.cpp's ``permute`` of attn_q / attn_k rows (convert_hf_to_gguf.py:
    ``w.reshape(heads, 2, rows // heads // 2, ...).swapaxes(1, 2)``): per head, rows
    back from interleaved pairs to the two rotary halves. Any row-wise data (raw blocks)."""
    n = rows.shape[0]
    rest = tuple(rows.shape[1:])
    return rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2).reshape(n, *rest)


def tensor_pieces(name: str, type_name: str, raw: np.ndarray, arch: str,
                  cfg: dict[str, Any]) -> Iterator[tuple[str, hyb.Value]]:
    """(HF name, value in the HF layout) of each tensor one GGUF tensor holds: the dense
    families here, the hybrid and MoE ones in hybrid.py."""
    if arch in HYBRID_ARCHITECTURES:
        yield from hyb.hybrid_pieces(name, type_name, raw, arch, cfg)
        return
    hf = hf_name(name)
    if hf is None:
        return
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias",
                                          "attn_k.bias")):
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        raw = unpermute(np.asarray(raw), heads)
    yield hf, hyb.value_of(name, type_name, raw)


def names_of(name: str, shape: tuple[int, ...], arch: str) -> list[str]:
    """The HF names a GGUF tensor fills (its data not read)."""
    if arch in HYBRID_ARCHITECTURES:
        return hyb.hf_names(name, shape)
    hf = hf_name(name)
    return [] if hf is None else [hf]
