"""GGUF checkpoints: where the file is, the model's config, and the op each tensor runs on.

A model ``path`` may be a ``.gguf`` file or a folder holding exactly one (and no
safetensors). Hugging Face files beside it win: ``config.json`` over the GGUF
metadata, ``tokenizer.json`` over ``tokenizer.ggml.*`` (docs/quantization.md).
Shared by the neuron (loading) and ``helexa plan`` (weight bytes), so the rule of
which tensor type lands on which op (:func:`layout_of`) has one owner.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from helexa.checkpoint.gguf_families import (
    EXPERTS,
    FUSED,
    HYBRID_ARCHITECTURES,
    ROW_PARALLEL,
    SPLIT_PARAMS,
    family_config,
    part_of,
    stays_quantised,
)

GGUF_SUFFIX = ".gguf"
FLOAT_TYPES = ("F32", "F16", "BF16")
# type -> (op, sub-block the scale covers, zeros): docs/quantization.md's table.
QUANT_TYPES: dict[str, tuple[str, int, bool]] = {
    "Q8_0": ("int8g", 32, False),  # w = d * q
    "Q6_K": ("int8g", 16, False),  # w = d * sc * (q - 32)
    "Q5_K": ("int8g", 32, True),  # w = d * sc * q - dmin * m
    "Q4_K": ("int4", 32, True),  # as Q5_K with 4 bits: tinygemm's int4 op
}
# llama.cpp's architecture name -> the transformers one our loader builds.
DENSE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM"}
ARCHITECTURES = {**DENSE_ARCHITECTURES,
                 **{k: cls for k, (cls, _) in HYBRID_ARCHITECTURES.items()}}
INT4_ROW_MULTIPLE = 16  # helexa/kernels/quant.py: the int4 packer's rows per rank


class GgufError(ValueError):
    """A GGUF file (or folder) this loader cannot serve; the message says what is wrong."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file of a model path: the path itself, or the one ``.gguf`` in a folder
    without safetensors; None for a safetensors checkpoint."""
    p = Path(path)
    if p.suffix == GGUF_SUFFIX:
        if not p.is_file():
            raise GgufError(f"{p}: no such GGUF file")
        return p
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return None
    found = sorted(p.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise GgufError(f"{p}: {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                        "give the model's path as the one to serve")
    return found[0] if found else None


def model_path_error(path: str | Path) -> str | None:
    """Why ``path`` is not a model to load (neither a checkpoint folder nor a GGUF file),
    or None when it is one."""
    try:
        gguf = find_gguf(path)
    except GgufError as e:
        return str(e)
    if gguf is None and not (Path(path) / "config.json").exists():
        return f"{path}: no config.json (expected a checkpoint folder or a .gguf file)"
    return None


def model_folder(path: str | Path) -> Path:
    """Where a model's side files (config.json, tokenizer.json) are: the folder itself,
    or the folder of a ``.gguf`` file."""
    p = Path(path)
    return p.parent if p.suffix == GGUF_SUFFIX else p


@lru_cache(maxsize=4)
def reader(path: Path) -> Any:
    """The file's GGUFReader (memory-mapped: opening reads only the header)."""
    from gguf import GGUFReader

    return GGUFReader(path)


def metadata(path: Path, key: str, default: Any = None) -> Any:
    field = reader(path).get_field(key)
    return default if field is None else field.contents()


def tensor_types(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type name, [rows, cols] as torch orders them)."""
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in reader(path).tensors}


def type_summary(path: Path) -> str:
    """The file's weight types, most common first (for `helexa plan`): "Q4_K, Q6_K, F32"."""
    counts: dict[str, int] = {}
    for typ, _ in tensor_types(path).values():
        counts[typ] = counts.get(typ, 0) + 1
    return ", ".join(sorted(counts, key=lambda t: -counts[t]))


def read_config(path: str | Path) -> dict[str, Any]:
    """The model's config.json dict: the HF file beside the GGUF when there is one,
    else built from the GGUF metadata."""
    beside = model_folder(path) / "config.json"
    if beside.is_file():
        return json.loads(beside.read_text())
    gguf = find_gguf(path)
    if gguf is None:
        raise GgufError(f"{path}: no config.json and no GGUF file")
    return config_from_metadata(gguf)


def config_from_metadata(path: Path) -> dict[str, Any]:
    """A transformers-style config.json dict from ``<arch>.*`` metadata."""
    arch = metadata(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path.name}: general.architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")

    def key(name: str, default: Any = None) -> Any:
        value = metadata(path, f"{arch}.{name}", default)
        if value is None:
            raise GgufError(f"{path.name}: metadata {arch}.{name} is missing")
        return value

    tensors = tensor_types(path)
    scaling = metadata(path, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or "rope_freqs.weight" in tensors:
        raise GgufError(f"{path.name}: rope scaling {scaling!r} (or rope_freqs) is not read from "
                        "GGUF metadata: put the model's config.json beside the file")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv = metadata(path, f"{arch}.attention.head_count_kv", heads)
    head_dim = int(metadata(path, f"{arch}.attention.key_length", hidden // heads))
    hybrid = arch in HYBRID_ARCHITECTURES
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": HYBRID_ARCHITECTURES[arch][1] if hybrid else arch,
        "hidden_size": hidden, "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,  # a per-layer list has 0 for linear-attention layers
        "num_key_value_heads": int(kv if not isinstance(kv, list) else max(kv)),
        "head_dim": head_dim,
        "intermediate_size": int(metadata(path, f"{arch}.feed_forward_length", 0)
                                 if hybrid else key("feed_forward_length")),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(metadata(path, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": tensors["token_embd.weight"][1][0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if hybrid:
        cfg.update(family_config(path, arch, key,
                                 lambda name, default=None: metadata(path, f"{arch}.{name}", default),
                                 tensors, head_dim))
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear",
                               "factor": float(key("rope.scaling.factor"))}
    for name in ("bos", "eos"):
        token = metadata(path, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            cfg[f"{name}_token_id"] = int(token)
    return cfg


def _f32(value: float) -> float:
    """GGUF keeps floats as float32: 1e-6 reads back as 9.99999997e-07; its shortest
    float32 spelling is the number the converter was given."""
    import numpy as np

    return float(str(np.float32(value)))


# ---------------------------------------------------------------- the op of each tensor


@dataclass(frozen=True)
class Layout:
    """What one of our layers holds: ``float``, ``int8g`` (``w = q * scale + zero`` in
    groups of ``group`` along the input, ``zeros`` or not) or ``int4`` (tinygemm)."""

    op: str
    group: int = 0
    zeros: bool = False


FLOAT = Layout("float")


def layout_of(types: list[str], *, lookup: bool = False, rows: int = 0) -> Layout:
    """The layout of a layer whose checkpoint parts (q/k/v, gate/up: one fused layer) have
    ``types``. One type: its own op. Quantised types mixed: grouped int8 at the smallest
    group, with zeros if any part has them (every part's values, exactly). A float part among
    quantised ones: float. An embedding table (``lookup``) gathers rows, which the int4 op
    cannot: int8g; so does an int4 layer whose ``rows`` per rank the int4 packer refuses."""
    unknown = [t for t in types if t not in QUANT_TYPES and t not in FLOAT_TYPES]
    if unknown:
        raise GgufError(f"tensor type {unknown[0]} is not supported "
                        f"(supported: {', '.join([*FLOAT_TYPES, *QUANT_TYPES])})")
    if any(t in FLOAT_TYPES for t in types):
        return FLOAT
    ops = {QUANT_TYPES[t] for t in types}
    if len(ops) == 1:
        op, group, zeros = ops.pop()
        if op == "int4" and (lookup or rows % INT4_ROW_MULTIPLE):
            return Layout("int8g", group, zeros)
        return Layout(op, group, zeros)
    return Layout("int8g", min(g for _, g, _ in ops), any(z for _, _, z in ops))


def layout_bytes(layout: Layout, rows: int, cols: int, elt: int) -> int:
    """Bytes one [rows, cols] layer holds in ``layout`` (scales and zeros in the model's
    dtype, ``elt`` bytes each)."""
    if layout.op == "float":
        return rows * cols * elt
    groups = rows * (cols // layout.group)
    side = groups * elt * (2 if layout.zeros or layout.op == "int4" else 1)
    return (rows * cols // 2 if layout.op == "int4" else rows * cols) + side


def weight_bytes_per_card(path: Path, cfg: dict[str, Any], tp: int, elt: int) -> int:
    """Bytes one card holds of a GGUF model (helexa/neuron/models/quant_gguf.py's layouts): each
    of our layers from the tensors that fill it (helexa/checkpoint/gguf_families.py)."""
    tensors = tensor_types(path)
    text = {**cfg, **cfg.get("text_config", {})}  # an HF config beside it may be the wrapper
    arch = metadata(path, "general.architecture")
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    kv_card = -(-kv // tp)

    def part_rows(part: str, rows: int) -> int:
        return rows // kv * kv_card if part in ("attn_k", "attn_v") else rows // tp

    total = 0
    fused: dict[tuple[int, str], list[tuple[str, str, tuple[int, ...]]]] = {}
    stacks: dict[tuple[int, bool], list[tuple[str, tuple[int, ...]]]] = {}
    for name, (typ, shape) in tensors.items():
        where = part_of(name)
        if where is None:
            continue  # the embedding and head: below
        layer, part = where
        numel = math.prod(shape)
        if part in SPLIT_PARAMS:  # float, split by the linear-attention heads
            total += numel // tp * elt
        elif name.endswith(".bias") or part not in (*FUSED, *ROW_PARALLEL, *EXPERTS):
            total += numel * elt  # norms, biases, routers: float, whole on every card
        elif part in EXPERTS:  # the w13 (gate, up) and w2 (down) stacks of the MoE block
            stacks.setdefault((layer, part == "ffn_down_exps"), []).append((typ, shape))
        elif part in ROW_PARALLEL:
            rows, cols = shape
            layout = (layout_of([typ], rows=rows) if stays_quantised(arch, part, typ, text)
                      else FLOAT)
            total += layout_bytes(layout, rows, cols // tp, elt)
        else:
            fused.setdefault((layer, FUSED[part]), []).append((part, typ, shape))
    for (_, down), parts in stacks.items():  # [experts, rows, cols]; per expert as a layer
        e, rows, cols = parts[0][1]
        rows = rows if down else sum(shape[1] for _, shape in parts) // tp
        cols = cols // tp if down else cols
        types = [typ for typ, _ in parts]
        layout = layout_of(types, rows=rows) if all(t in QUANT_TYPES for t in types) else FLOAT
        total += e * layout_bytes(layout, rows, cols, elt)
    for parts in fused.values():
        rows = sum(part_rows(part, shape[0]) for part, _, shape in parts)
        layout = layout_of([typ for _, typ, _ in parts], rows=rows)
        total += layout_bytes(layout, rows, parts[0][2][1], elt)
    vocab_rows = math.ceil(int(tensors["token_embd.weight"][1][0]) / tp)
    hidden = int(text["hidden_size"])
    embd = layout_of([tensors["token_embd.weight"][0]], lookup=True)
    total += layout_bytes(embd, vocab_rows, hidden, elt)
    if "output.weight" in tensors and not text.get("tie_word_embeddings"):
        head = layout_of([tensors["output.weight"][0]], rows=vocab_rows)
        total += layout_bytes(head, vocab_rows, hidden, elt)
    return total + sum(shape[0] for name, (_, shape) in tensors.items()
                       if name == "output_norm.weight") * elt
