"""GGUF tensors on our ops (torch-free): the layout each layer takes and its bytes per card.

Which tensor type lands on which op (:func:`layout_of`: docs/quantization.md's table)
has one owner, read by the neuron's loading (helexa/neuron/formats/gguf/) and by
``helexa plan`` (:func:`weight_bytes_per_card`), so the plan counts what a loaded
engine holds. The part tables say which of our layers each llama.cpp tensor fills
and how a rank splits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.checkpoint.gguf import GgufError, metadata, tensor_types

FLOAT_TYPES = ("F32", "F16", "BF16")
# type -> (op, sub-block the scale covers, zeros): docs/quantization.md's table.
QUANT_TYPES: dict[str, tuple[str, int, bool]] = {
    "Q8_0": ("int8g", 32, False),  # w = d * q
    "Q6_K": ("int8g", 16, False),  # w = d * sc * (q - 32)
    "Q5_K": ("int8g", 32, True),  # w = d * sc * q - dmin * m
    "Q4_K": ("int4", 32, True),  # as Q5_K with 4 bits: tinygemm's int4 op
}
INT4_ROW_MULTIPLE = 16  # helexa/kernels/quant.py: the int4 packer's rows per rank


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


# ---------------------------------------------------------------- which layer a tensor fills


# Parts fused into one of our layers (the layout is chosen over all of them together).
FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up",
         "ffn_up": "gate_up", "attn_qkv": "in_proj", "attn_gate": "in_proj",
         "ssm_beta": "in_proj", "ssm_alpha": "in_proj", "ssm_ba": "in_proj",
         "ffn_gate_shexp": "shared_gate_up", "ffn_up_shexp": "shared_gate_up"}
ROW_PARALLEL = ("attn_output", "ffn_down", "ssm_out", "ffn_down_shexp")  # inputs split
# Float parameters split by rank along their first dim (the linear-attention heads').
SPLIT_PARAMS = ("ssm_conv1d", "ssm_a", "ssm_dt")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")


def part_of(name: str) -> tuple[int, str] | None:
    """(layer, part) of ``blk.N.part.weight`` (or ``blk.N.ssm_a``); None for top tensors."""
    pieces = name.split(".")
    if pieces[0] != "blk":
        return None
    return int(pieces[1]), pieces[2]


def reorders_value_heads(arch: str, cfg: dict[str, Any]) -> bool:
    """Whether llama.cpp's converter reordered this file's linear-attention value heads
    from grouped by key head to tiled (Qwen3.5, where value heads outnumber key heads)."""
    return (arch in ("qwen35", "qwen35moe")
            and int(cfg["linear_num_key_heads"]) != int(cfg["linear_num_value_heads"]))


def stays_quantised(arch: str, part: str, typ: str, cfg: dict[str, Any]) -> bool:
    """Whether a quantised tensor keeps its values on an op. Qwen3.5's ``ssm_out`` has its
    input columns reordered by value head: put back in the unpacked form when a value
    head's columns are whole sub-blocks of the type, else dequantised and float."""
    if typ not in QUANT_TYPES or part != "ssm_out" or not reorders_value_heads(arch, cfg):
        return True
    return int(cfg["linear_value_head_dim"]) % QUANT_TYPES[typ][1] == 0


@dataclass(frozen=True)
class CardLayer:
    """One of our matmul layers as a card holds it: its layout, [rows, cols] on the card,
    ``count`` of them (an expert stack's experts). ``lookup``: the embedding (rows gathered);
    ``tied``: a head that runs the embedding's table (its bytes are the embedding's)."""

    name: str
    layout: Layout
    rows: int
    cols: int
    count: int = 1
    lookup: bool = False
    tied: bool = False


def card_layers(path: Path, cfg: dict[str, Any], tp: int) -> tuple[list[CardLayer], int]:
    """The layers one card holds of a GGUF model (the layouts helexa/neuron/formats/gguf/
    loads, from the part tables above), and the float values beside them (norms, biases,
    routers, the linear-attention parameters)."""
    tensors = tensor_types(path)
    text = {**cfg, **cfg.get("text_config", {})}  # an HF config beside it may be the wrapper
    arch = metadata(path, "general.architecture")
    heads = int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    kv_card = -(-kv // tp)

    def part_rows(part: str, rows: int) -> int:
        return rows // kv * kv_card if part in ("attn_k", "attn_v") else rows // tp

    layers: list[CardLayer] = []
    floats = 0
    fused: dict[tuple[int, str], list[tuple[str, str, tuple[int, ...]]]] = {}
    stacks: dict[tuple[int, bool], list[tuple[str, tuple[int, ...]]]] = {}
    for name, (typ, shape) in tensors.items():
        where = part_of(name)
        if where is None:
            continue  # the embedding and head: below
        layer, part = where
        numel = math.prod(shape)
        if part in SPLIT_PARAMS:  # float, split by the linear-attention heads
            floats += numel // tp
        elif name.endswith(".bias") or part not in (*FUSED, *ROW_PARALLEL, *EXPERTS):
            floats += numel  # norms, biases, routers: float, whole on every card
        elif part in EXPERTS:  # the w13 (gate, up) and w2 (down) stacks of the MoE block
            stacks.setdefault((layer, part == "ffn_down_exps"), []).append((typ, shape))
        elif part in ROW_PARALLEL:
            rows, cols = shape
            layout = (layout_of([typ], rows=rows) if stays_quantised(arch, part, typ, text)
                      else FLOAT)
            layers.append(CardLayer(f"blk.{layer}.{part}", layout, rows, cols // tp))
        else:
            fused.setdefault((layer, FUSED[part]), []).append((part, typ, shape))
    for (layer, down), parts in stacks.items():  # [experts, rows, cols]; per expert as a layer
        e, rows, cols = parts[0][1]
        rows = rows if down else sum(shape[1] for _, shape in parts) // tp
        cols = cols // tp if down else cols
        types = [typ for typ, _ in parts]
        layout = layout_of(types, rows=rows) if all(t in QUANT_TYPES for t in types) else FLOAT
        layers.append(CardLayer(f"blk.{layer}.{'down' if down else 'gate_up'}_exps", layout,
                                rows, cols, count=e))
    for (layer, fused_name), parts in fused.items():
        rows = sum(part_rows(part, shape[0]) for part, _, shape in parts)
        layers.append(CardLayer(f"blk.{layer}.{fused_name}",
                                layout_of([typ for _, typ, _ in parts], rows=rows), rows,
                                parts[0][2][1]))
    vocab_rows = math.ceil(int(tensors["token_embd.weight"][1][0]) / tp)
    hidden = int(text["hidden_size"])
    embd = layout_of([tensors["token_embd.weight"][0]], lookup=True)
    layers.append(CardLayer("token_embd", embd, vocab_rows, hidden, lookup=True))
    if "output.weight" in tensors and not text.get("tie_word_embeddings"):
        head = layout_of([tensors["output.weight"][0]], rows=vocab_rows)
        layers.append(CardLayer("output", head, vocab_rows, hidden))
    else:
        layers.append(CardLayer("output", embd, vocab_rows, hidden, tied=True))
    norm = sum(shape[0] for name, (_, shape) in tensors.items() if name == "output_norm.weight")
    return layers, floats + norm


def weight_bytes_per_card(path: Path, cfg: dict[str, Any], tp: int, elt: int) -> int:
    """Bytes one card holds of a GGUF model: its layers (:func:`card_layers`) in their
    layouts, scales, zeros and float values ``elt`` bytes each."""
    layers, floats = card_layers(path, cfg, tp)
    return floats * elt + sum(layer.count * layout_bytes(layer.layout, layer.rows, layer.cols, elt)
                              for layer in layers if not layer.tied)


def measures_activations(gguf: Path, raw: dict[str, Any], dtype: str, devices: list[str]
                         ) -> bool:
    """Whether a neuron measures fp32 against bf16 for this model before planning it
    (helexa/neuron/activation.py): ``dtype`` auto, every device a CPU, and a file either
    dtype holds well, quantised matmul layers (the dtype changes only the scales' bytes) or
    float ones mostly F32 (bf16 rounds them, fp32 keeps them). A 16-bit float file keeps
    its ``auto`` dtype: fp32 would double it."""
    if dtype != "auto" or not devices or any(d.split(":")[0] != "cpu" for d in devices):
        return False
    layers, _ = card_layers(gguf, raw, 1)
    if any(la.layout.op != "float" for la in layers if not la.lookup):
        return True
    numel: dict[str, int] = {}
    for typ, shape in tensor_types(gguf).values():
        if len(shape) == 2:
            numel[typ] = numel.get(typ, 0) + math.prod(shape)
    return bool(numel) and max(numel, key=numel.__getitem__) == "F32"
