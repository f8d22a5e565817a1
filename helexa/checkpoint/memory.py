"""What a model costs per card, in bytes, from its shape: KV per token, fixed and held
state per request, weights. `helexa plan`, the pool's sizing and the ledger all read these.

Per card, with tp-way tensor parallelism:

    bytes_per_token = 2 (K and V) × full-attention layers × kv_heads_per_card
                      × kv_token_head_bytes(kv_dtype, head_dim)
    (where the config speculates with "mtp", a checkpoint's multi-token-prediction
    layers, config.json `mtp_num_hidden_layers`, count as full-attention layers:
    their KV is in the pool, docs/speculation.md)
    kv_heads_per_card = ceil(kv_heads / tp)  (1, i.e. replicated, when tp > kv_heads)
    fixed_bytes (hybrids) = linear-attention layers × state_bytes ×
        ( v_heads/tp × k_dim × v_dim                       # recurrent (delta-rule) state
        + (2 × k_heads × k_dim + v_heads × v_dim)/tp × (conv_kernel − 1) )  # conv window
    held_bytes (hybrids) = (spec_k + 1) × linear-attention layers × (
        (2 × k_heads × k_dim + v_heads × v_dim)/tp × state_bytes   # conv inputs
        + k_heads/tp × k_dim × 4 + v_heads/tp × v_dim × state_bytes  # k (fp32), v
        + 2 × v_heads/tp × 4 )                                      # g, beta (fp32)
"""

from __future__ import annotations

import math

from helexa.checkpoint.shape import ELT_BYTES, ModelShape, dtype_name, param_split
from helexa.checkpoint.weights import quantized_weight_bytes_per_card

QUANT_GROUP = 32  # int4 elements sharing one fp32 scale


def kv_token_head_bytes(kv_dtype: str, head_dim: int, model_dtype: str) -> int:
    """Bytes one token's K (or V) of one head takes in the cache, scales included."""
    kv = dtype_name(model_dtype) if kv_dtype == "auto" else kv_dtype
    if kv in ELT_BYTES:
        return ELT_BYTES[kv] * head_dim
    if kv in ("fp8_e4m3", "int8"):
        return head_dim + 4  # 1 B per element + one fp32 scale per token-head
    if kv == "int4":
        return (head_dim + 1) // 2 + 4 * math.ceil(head_dim / QUANT_GROUP)
    raise ValueError(f"kv_dtype: expected auto, fp32, fp16, bf16, fp8_e4m3, int8 or int4, got {kv!r}")


def kv_heads_per_card(shape: ModelShape, tp: int) -> int:
    return math.ceil(shape.num_kv_heads / tp)


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_dtype: str, mtp_layers: int = 0) -> int:
    """KV bytes one token takes on each card: full-attention layers, and `mtp_layers`
    of the MTP head where the pool holds them (helexa.plan: where a speculation names mtp)."""
    return (2 * (shape.full_attention_layers + mtp_layers) * kv_heads_per_card(shape, tp)
            * kv_token_head_bytes(kv_dtype, shape.head_dim, shape.torch_dtype))


def fixed_bytes_per_request(shape: ModelShape, tp: int, dtype: str | None = None) -> int:
    """Per-request state that does not grow with tokens (linear-attention layers); 0 for dense.
    Kept in the weights' dtype (`dtype`, default the checkpoint's)."""
    if not shape.linear_attention_layers or not shape.linear_num_value_heads:
        return 0
    k_heads, v_heads = shape.linear_num_key_heads, shape.linear_num_value_heads
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    recurrent = math.ceil(v_heads / tp) * dk * dv
    conv = math.ceil((2 * k_heads * dk + v_heads * dv) / tp) * max(shape.linear_conv_kernel_dim - 1, 0)
    return (shape.linear_attention_layers * (recurrent + conv)
            * ELT_BYTES[dtype_name(dtype or shape.torch_dtype)])


def held_bytes_per_request(shape: ModelShape, tp: int, spec_k: int,
                           dtype: str | None = None) -> int:
    """Room for the one verification row of spec_k + 1 positions a hybrid's state slot may
    hold (helexa/neuron/models/linear_state.py); 0 for dense. Float parts in `dtype` (default the
    checkpoint's), the normalised keys and the gates in fp32, as the layer keeps them."""
    if not shape.linear_attention_layers or not shape.linear_num_value_heads or spec_k <= 0:
        return 0
    k_heads, v_heads = shape.linear_num_key_heads, shape.linear_num_value_heads
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    elt = ELT_BYTES[dtype_name(dtype or shape.torch_dtype)]
    channels = math.ceil((2 * k_heads * dk + v_heads * dv) / tp)
    position = (channels * elt + math.ceil(k_heads / tp) * dk * 4
                + math.ceil(v_heads / tp) * (dv * elt + 2 * 4))
    return (spec_k + 1) * shape.linear_attention_layers * position


def weight_bytes_per_card(shape: ModelShape, tp: int, weight_dtype: str,
                          quantize: str = "none", group_size: int = 128) -> int:
    """Weight bytes one card holds; ``quantize`` (int8, int4) as quantised at load."""
    if quantize != "none":
        return quantized_weight_bytes_per_card(shape, tp, ELT_BYTES[dtype_name(weight_dtype)],
                                               quantize, group_size)
    sharded, replicated = param_split(shape, tp)
    return (math.ceil(sharded / tp) + replicated) * ELT_BYTES[dtype_name(weight_dtype)]
