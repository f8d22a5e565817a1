"""What each kind of layer holds on one card, per token and per request: the one statement of
a model's memory that `helexa plan` sums and the engine allocates (as vLLM's
`v1/kv_cache_interface.py` has AttentionSpec and MambaSpec).

- A full-attention layer (``AttentionSpec``) keeps K and V of every token in the paged
  pool: ``bytes_per_token`` grows with the context, nothing is fixed per request.
- A Gated DeltaNet layer (``LinearAttentionSpec``) keeps, per request, a conv window
  [channels, kernel - 1] and a recurrent state [v_heads, k_dim, v_dim] in one state slot
  (``fixed_bytes_per_request``), whatever the context; a slot also sets room aside for the
  one speculative verification row it may hold (``held_bytes``, docs/speculation.md).

``layer_specs`` states a model's layers from its config.json shape alone (what the plan
reads); the model's own layers state theirs from the numbers they hold per card (what the
allocator reads: helexa/kernels/paged_kv.py, helexa/kernels/linear_state.py). The agreement
tests compare the two, so the plan, the pool and the ledger count one figure.
Torch-free: `helexa plan` runs without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helexa.checkpoint.shape import ELT_BYTES, ModelShape, dtype_name

QUANT_GROUP = 32  # int4 elements sharing one fp32 scale
FP32_BYTES = 4


def kv_token_head_bytes(kv_dtype: str, head_dim: int, model_dtype: str) -> int:
    """Bytes one token's K (or V) of one head takes in the cache, scales included
    (kv_dtype "auto": the model's dtype)."""
    return _token_head_bytes(dtype_name(model_dtype) if kv_dtype == "auto" else kv_dtype, head_dim)


def _token_head_bytes(kv: str, head_dim: int) -> int:
    if kv in ELT_BYTES:
        return ELT_BYTES[kv] * head_dim
    if kv in ("fp8_e4m3", "int8"):
        return head_dim + 4  # 1 B per element + one fp32 scale per token-head
    if kv == "int4":
        return (head_dim + 1) // 2 + 4 * math.ceil(head_dim / QUANT_GROUP)
    raise ValueError(f"kv_dtype: expected auto, fp32, fp16, bf16, fp8_e4m3, int8 or int4, got {kv!r}")


@dataclass(frozen=True)
class AttentionSpec:
    """One full-attention layer on one card: K and V of each token in the paged pool."""

    kv_heads: int  # on this card (replicated when tp > the model's kv heads)
    head_dim: int
    kv_dtype: str  # fp32 | bf16 | fp16 | fp8_e4m3 | int8 | int4 (never "auto")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.kv_heads * _token_head_bytes(self.kv_dtype, self.head_dim)

    @property
    def fixed_bytes_per_request(self) -> int:
        return 0


@dataclass(frozen=True)
class LinearAttentionSpec:
    """One Gated DeltaNet layer on one card: a conv window and a recurrent state per request,
    in ``dtype`` (the model's float dtype), and the inputs a held verification row keeps."""

    key_heads: int  # on this card
    value_heads: int  # on this card
    key_dim: int
    value_dim: int
    conv_channels: int  # on this card: [q | k | v] = 2 x key_heads x key_dim + value_heads x value_dim
    conv_kernel: int
    dtype: str  # fp32 | bf16 | fp16

    @property
    def conv_shape(self) -> tuple[int, int]:
        """One request's conv window: the last kernel - 1 inputs of each channel."""
        return self.conv_channels, max(self.conv_kernel - 1, 0)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        """One request's delta-rule state."""
        return self.value_heads, self.key_dim, self.value_dim

    @property
    def bytes_per_token(self) -> int:
        return 0

    @property
    def fixed_bytes_per_request(self) -> int:
        return (math.prod(self.conv_shape) + math.prod(self.recurrent_shape)) * ELT_BYTES[self.dtype]

    @property
    def held_bytes_per_position(self) -> int:
        """One position of a held verification row: its conv inputs (dtype), its normalised
        key (fp32), its value (dtype) and its gates g, beta (fp32)."""
        elt = ELT_BYTES[self.dtype]
        return (self.conv_channels * elt + self.key_heads * self.key_dim * FP32_BYTES
                + self.value_heads * (self.value_dim * elt + 2 * FP32_BYTES))

    def held_bytes(self, spec_k: int) -> int:
        """Room for the one verification row of spec_k + 1 positions a slot may hold."""
        return (spec_k + 1) * self.held_bytes_per_position if spec_k > 0 else 0


LayerSpec = AttentionSpec | LinearAttentionSpec


def layer_specs(shape: ModelShape, tp: int, kv_dtype: str, state_dtype: str | None = None,
                mtp_layers: int = 0) -> list[LayerSpec]:
    """Every layer of a model on one card of tp, by kind: its full-attention layers and
    ``mtp_layers`` of its MTP head (whose KV the pool holds, docs/speculation.md) in
    ``kv_dtype`` ("auto": the checkpoint's dtype), then its linear-attention layers with
    their state in ``state_dtype`` (default the checkpoint's)."""
    kv = dtype_name(shape.torch_dtype) if kv_dtype == "auto" else kv_dtype
    attention = AttentionSpec(math.ceil(shape.num_kv_heads / tp), shape.head_dim, kv)
    specs: list[LayerSpec] = [attention] * (shape.full_attention_layers + mtp_layers)
    if shape.linear_attention_layers and shape.linear_num_value_heads:
        k_heads, v_heads = shape.linear_num_key_heads, shape.linear_num_value_heads
        dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
        linear = LinearAttentionSpec(
            key_heads=math.ceil(k_heads / tp), value_heads=math.ceil(v_heads / tp),
            key_dim=dk, value_dim=dv, conv_channels=math.ceil((2 * k_heads * dk + v_heads * dv) / tp),
            conv_kernel=shape.linear_conv_kernel_dim,
            dtype=dtype_name(state_dtype or shape.torch_dtype))
        specs += [linear] * shape.linear_attention_layers
    return specs
