"""Weight bytes per card of a quantised model, as helexa/neuron/formats/ lays them out.

Layout (docs/quantization.md): int8 = one byte a weight plus one scale a row in
the model's dtype; int4 = half a byte a weight plus a scale and a zero per
group of ``group_size`` inputs; grouped int8 (``int8g``, checkpoints only) = one
byte a weight plus a scale per group (``int8g-asym``: and a zero). quantize = "int8" makes every linear, the LM head
and the embedding int8; "int4" makes the decoder's linears int4 and keeps the
head and the embedding int8. Norms stay in the model's dtype. Only the model's
dtype bytes (``elt``) come from outside; everything else from the shape.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helexa.checkpoint.shape import ModelShape


INT4_OP_GROUPS = (256, 128, 64, 32)  # helexa/kernels/quant.py: a wider group is split into these


def checkpoint_quantization(config_json: dict) -> tuple[str, int, bool] | None:
    """(kind, group size the op runs, inputs reordered) of a checkpoint quantised in the
    file (compressed-tensors, GPTQ, AWQ: docs/quantization.md), None for a float one. Their
    LM head and embedding stay float."""
    qc = config_json.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        w = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights") or {}
        bits, group = int(w.get("num_bits", 4)), w.get("group_size")
        sym = bool(w.get("symmetric", True))
        kind = "int4" if bits != 8 else _int8_kind(sym, bool(group))
        return kind, int(group or 0), False
    if method in ("gptq", "awq"):
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        # GPTQ 8 bits: a symmetric file's zeros are all 128 and none are kept
        kind = "int4" if bits != 8 else _int8_kind(bool(qc.get("sym", True)), group != -1)
        return kind, (0 if group == -1 else group), bool(qc.get("desc_act", False))
    return None


def _int8_kind(sym: bool, grouped: bool) -> str:
    """Which int8 layout an 8-bit checkpoint loads into (helexa/neuron/formats/methods.py)."""
    return "int8g-asym" if not sym else "int8g" if grouped else "int8"


def linear_bytes(rows: int, cols: int, kind: str, group_size: int, elt: int) -> int:
    """One [rows, cols] weight on one card: packed values, scales and zeros."""
    if kind == "int8":
        return rows * cols + rows * elt
    if kind == "int4":
        group = group_size if group_size in INT4_OP_GROUPS else next(
            (g for g in INT4_OP_GROUPS if cols % g == 0), 32)  # 0: per channel, split
        return rows * cols // 2 + 2 * elt * rows * math.ceil(cols / group)
    if kind in ("int8g", "int8g-asym"):  # group 0: one group a row (per channel)
        per_group = elt * (2 if kind == "int8g-asym" else 1)
        groups = math.ceil(cols / group_size) if group_size else min(cols, 1)
        return rows * cols + per_group * rows * groups
    return rows * cols * elt


def quantized_weight_bytes_per_card(s: ModelShape, tp: int, elt: int, kind: str,
                                    group_size: int, *, float_heads: bool = False,
                                    reordered: bool = False) -> int:
    """Bytes one card holds of a model quantised with ``kind`` (int8 or int4): at load
    (head and embedding int8), or in the checkpoint (``float_heads``; ``reordered``: an
    act-order layer keeps its input order, 8 bytes an input)."""
    h, hd = s.hidden_size, s.head_dim
    kv_card = math.ceil(s.num_kv_heads / tp)

    def lin(rows: int, cols: int) -> int:
        return linear_bytes(rows, cols, kind, group_size, elt) + (8 * cols if reordered else 0)

    q_rows = s.num_heads * hd * (2 if s.attn_output_gate else 1) // tp
    attn = lin(q_rows + 2 * kv_card * hd, h) + lin(h, s.num_heads * hd // tp)
    if s.num_experts:  # experts as linears of their own; the router stays float
        mlp = (s.num_experts * (lin(2 * s.moe_intermediate_size // tp, h)
                                + lin(h, s.moe_intermediate_size // tp))
               + h * s.num_experts * elt
               + lin(2 * s.shared_expert_intermediate_size // tp, h)
               + lin(h, s.shared_expert_intermediate_size // tp))
    else:
        mlp = lin(2 * s.intermediate_size // tp, h) + lin(h, s.intermediate_size // tp)
    k_dim = s.linear_num_key_heads * s.linear_key_head_dim
    v_dim = s.linear_num_value_heads * s.linear_value_head_dim
    conv_dim = 2 * k_dim + v_dim
    linear_attn = (lin((conv_dim + v_dim + 2 * s.linear_num_value_heads) // tp, h)
                   + lin(h, v_dim // tp)
                   + (conv_dim * s.linear_conv_kernel_dim // tp + 2 * s.linear_num_value_heads
                      + s.linear_value_head_dim) * elt)
    rows = math.ceil(s.vocab_size / tp)
    head = rows * h * elt if float_heads else rows * h + rows * elt  # int8 rows + a scale each
    heads = head * (1 if s.tie_word_embeddings else 2)
    norms = (s.num_layers * 2 * h + h + s.full_attention_layers * 2 * hd) * elt
    tower = 0
    if s.vision is not None:  # the vision tower stays float (quant.attach leaves it)
        split, whole = s.vision.param_split(tp)
        tower = (math.ceil(split / tp) + whole) * elt
    return (heads + norms + s.num_layers * mlp + s.full_attention_layers * attn
            + s.linear_attention_layers * linear_attn + tower)
