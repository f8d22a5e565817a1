"""Which parameter each checkpoint tensor fills, and what a load must have filled.

A checkpoint names q/k/v, gate/up and every expert apart; our layers fuse them, so a
tensor maps to (our parameter, shard id). A model with its own ``checkpoint_map``
(the hybrid families) decides; else its ``packed_modules`` rename fused parts. Every
format's loading (safetensors streaming, GGUF) maps names here and checks here.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class MissingTensor(Exception):
    """A tensor the model needs is not in the checkpoint."""


def target(name: str, model: nn.Module) -> tuple[str, Any] | None:
    """(our parameter name, shard id) of checkpoint tensor ``name``; None: skip it;
    ("", None): keep it whole, unsharded, in ``model.extra_tensors``."""
    mapper = getattr(model, "checkpoint_map", None)
    if mapper is not None:
        return mapper(name)
    packed = getattr(model, "packed_modules", {})
    for src, (dst, shard) in packed.items():
        token = f".{src}."
        if token in name:
            return name.replace(token, f".{dst}."), shard
    return name, None


def expected_tensors(model: nn.Module, *, tie_word_embeddings: bool) -> dict[tuple[str, object], str]:
    """Every (parameter, shard) loading must fill, and the checkpoint name that fills it."""
    own = getattr(model, "expected_shards", None)
    if own is not None:
        return own()
    params = dict(model.named_parameters(remove_duplicate=False))
    expected: dict[tuple[str, object], str] = {}
    packed = getattr(model, "packed_modules", {})
    for pname in params:
        if tie_word_embeddings and pname == "lm_head.weight":
            continue
        shards = [(src, shard) for src, (dst, shard) in packed.items() if f".{dst}." in pname]
        if shards:
            for src, shard in shards:
                dst = packed[src][0]
                expected[(pname, shard)] = pname.replace(f".{dst}.", f".{src}.")
        else:
            expected[(pname, None)] = pname
    return expected


def check_loaded(expected: dict[tuple[str, object], str], loaded: set[tuple[str, object]]) -> None:
    """MissingTensor naming (up to eight of) the checkpoint tensors loading did not fill."""
    missing = [ckpt for key, ckpt in expected.items() if key not in loaded]
    if missing:
        raise MissingTensor(
            f"checkpoint is missing {len(missing)} tensor(s): {', '.join(sorted(missing)[:8])}"
            + (" …" if len(missing) > 8 else "")
        )
