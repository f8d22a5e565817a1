"""KV-pool arithmetic: what a model costs per card and how much context a pool buys.

Used by `helexa plan FILE…`, by `helexa config check` (a configured context
the pool cannot hold is a config error) and by the neuron and engine to size
the pool at load. Everything here comes from a model's config.json alone, so
planning needs no weights and no device.

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
    num_blocks  = kv_budget_bytes // (block_size × bytes_per_token)
    pool_tokens = num_blocks × block_size

The recurrent state is kept in the model's dtype (as vLLM's default
mamba_ssm_cache_dtype = auto does). Fixed bytes are not blocks of the pool,
but they come out of the same memory: a request of `context` tokens must fit
blocks + fixed bytes in the budget, and the trade table (context each of 1, 2,
4, 8 concurrent full-length sessions) subtracts every session's fixed bytes.
Where the config speculates (the engine section or a profile), a hybrid's
state slot also sets aside room for the verification row it may hold until
its request's next step (held_bytes, at the largest spec_k configured;
docs/speculation.md): not in the ledger, like activations, but out of the
budget.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.config import (
    ConfigError,
    ModelEntry,
    NeuronConfig,
    draft_model_id,
    load_neuron_config,
    resolve_path,
)
from helexa.gguf_meta import GgufError, find_gguf, read_config, type_summary
from helexa.gguf_meta import weight_bytes_per_card as gguf_weight_bytes_per_card
from helexa.plan_weights import checkpoint_quantization, quantized_weight_bytes_per_card

MIB = 1024 * 1024
TRADE_SESSIONS = (1, 2, 4, 8)
ELT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
QUANT_GROUP = 32  # int4 elements sharing one fp32 scale
_DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "fp32": "fp32", "bfloat16": "bf16",
                "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16"}
# Sliding-window layers are counted as full: a conservative figure (they
# need at most the window), and no model served here has them.
_ATTENTION_LAYERS = {"full_attention", "attention", "sliding_attention"}


class PlanError(ConfigError):
    """A model that cannot be planned as configured; the message shows the arithmetic."""


class UnknownBudget(PlanError):
    """Neither a KV budget nor the device memory is known (a live device can tell)."""


def dtype_name(name: str) -> str:
    """`bfloat16`, `torch.bfloat16`, `bf16` → `bf16` (fp32, bf16, fp16)."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}")
    return _DTYPE_NAMES[key]


# ---------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a checkpoint that decide its memory, from config.json."""

    architecture: str
    model_type: str
    num_layers: int
    full_attention_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str  # fp32 | bf16 | fp16
    tie_word_embeddings: bool
    param_count: int
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0  # linear-attention (gated delta-rule) fields, 0 = dense
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_layers: int = 0  # multi-token-prediction layers config.json declares

    @property
    def linear_attention_layers(self) -> int:
        return self.num_layers - self.full_attention_layers


def read_model_shape(config_json: Path | str | dict) -> ModelShape:
    """Shape of a model from its config.json (a path or the parsed dict).

    Multimodal checkpoints keep the language model under `text_config`; only
    that part is read (a vision tower is small beside it and not counted).
    """
    raw = config_json if isinstance(config_json, dict) else json.loads(Path(config_json).read_text())
    c = {**raw, **raw.get("text_config", {})}
    layers = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    if c.get("layer_types"):
        full = sum(1 for t in c["layer_types"] if t in _ATTENTION_LAYERS)
    elif c.get("full_attention_interval"):  # layer i is full attention when (i+1) % k == 0
        full = layers // int(c["full_attention_interval"])
    else:
        full = layers
    dtype = c.get("dtype") or c.get("torch_dtype") or raw.get("torch_dtype") or "float32"
    linear = full < layers
    max_pos = int(c.get("max_position_embeddings") or 0)
    shape = ModelShape(
        architecture=(raw.get("architectures") or [c.get("model_type", "?")])[0],
        model_type=str(raw.get("model_type", "?")),
        num_layers=layers, full_attention_layers=full, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, hidden_size=hidden, intermediate_size=int(c.get("intermediate_size") or 0),
        vocab_size=int(c["vocab_size"]), max_position_embeddings=max_pos,
        torch_dtype=dtype_name(dtype),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        param_count=0,
        attn_output_gate=bool(c.get("attn_output_gate", c.get("model_type", "").startswith(
            ("qwen3_next", "qwen3_5")))),
        linear_num_key_heads=int(c.get("linear_num_key_heads", 0)) if linear else 0,
        linear_num_value_heads=int(c.get("linear_num_value_heads", 0)) if linear else 0,
        linear_key_head_dim=int(c.get("linear_key_head_dim", 0)) if linear else 0,
        linear_value_head_dim=int(c.get("linear_value_head_dim", 0)) if linear else 0,
        linear_conv_kernel_dim=int(c.get("linear_conv_kernel_dim", 0)) if linear else 0,
        num_experts=int(c.get("num_experts") or c.get("num_local_experts") or 0),
        # Mixtral names the expert width intermediate_size; Qwen-MoE has its own key.
        moe_intermediate_size=int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
        mtp_layers=int(c.get("mtp_num_hidden_layers") or 0),
    )
    sharded, replicated = _param_split(shape, tp=1)
    return _replace(shape, param_count=sharded + replicated)


def _replace(shape: ModelShape, **kw: Any) -> ModelShape:
    from dataclasses import replace
    return replace(shape, **kw)


def _param_split(s: ModelShape, tp: int) -> tuple[int, int]:
    """(parameters split over tp cards, parameters every card holds) — per card for the second."""
    h, hd = s.hidden_size, s.head_dim
    kv_card = math.ceil(s.num_kv_heads / tp)
    q_out = s.num_heads * hd * (2 if s.attn_output_gate else 1)  # the gate doubles q_proj
    attn = h * q_out + s.num_heads * hd * h  # q, o: split over cards
    attn_kv_card = 2 * h * kv_card * hd  # k, v: per card (replicated when tp > kv heads)
    if s.num_experts:
        mlp = (s.num_experts * 3 * h * s.moe_intermediate_size + h * s.num_experts  # + router
               + 3 * h * s.shared_expert_intermediate_size)
    else:
        mlp = 3 * h * s.intermediate_size
    k_dim = s.linear_num_key_heads * s.linear_key_head_dim
    v_dim = s.linear_num_value_heads * s.linear_value_head_dim
    conv_dim = 2 * k_dim + v_dim
    lin = (h * (conv_dim + v_dim + 2 * s.linear_num_value_heads)  # in_proj qkv, z, b, a
           + conv_dim * s.linear_conv_kernel_dim + v_dim * h + 2 * s.linear_num_value_heads)
    heads = s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    sharded = (heads + s.num_layers * mlp + s.full_attention_layers * attn
               + s.linear_attention_layers * lin)
    replicated = (s.full_attention_layers * (attn_kv_card + 2 * hd)  # + q/k norms
                  + s.num_layers * 2 * h + h + s.linear_attention_layers * s.linear_value_head_dim)
    return sharded, replicated


# ---------------------------------------------------------------- arithmetic


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
    of the MTP head where the pool holds them (plan_mtp_layers)."""
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
    hold (neuron/models/linear_state.py); 0 for dense. Float parts in `dtype` (default the
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


def planned_spec_k(cfg: NeuronConfig, entry: ModelEntry | None = None) -> int:
    """The largest spec_k of the engine section (over it, `entry`'s own speculation and
    spec_k) and the profiles that speculate (0: none does). A reload that turns speculation
    on where the config did not plan it takes the held rows from the activation headroom
    instead (a few MiB each)."""
    engine = cfg.engine
    own = entry.speculation if entry is not None and entry.speculation is not None else None
    speculation = own or engine.speculation
    k = entry.spec_k if entry is not None and entry.spec_k is not None else engine.spec_k
    ks = [k] if speculation != "off" else []
    for p in cfg.profiles.values():
        if (p.speculation or speculation) != "off":
            ks.append(p.spec_k if p.spec_k is not None else k)
    return max(ks, default=0)


def plan_mtp_layers(cfg: NeuronConfig, entry: ModelEntry, shape: ModelShape) -> int:
    """Pool layers for the model's MTP head: the layers its config.json declares where
    the config drafts with it (speculation = "mtp" for this model: the entry's own, else
    the engine section's, or a profile's), else 0 (nothing to pay for; speculation =
    "mtp" is then refused)."""
    named = [entry.speculation or cfg.engine.speculation]
    named += [p.speculation for p in cfg.profiles.values()]
    return shape.mtp_layers if "mtp" in named else 0


def weight_bytes_per_card(shape: ModelShape, tp: int, weight_dtype: str,
                          quantize: str = "none", group_size: int = 128) -> int:
    """Weight bytes one card holds; ``quantize`` (int8, int4) as quantised at load."""
    if quantize != "none":
        return quantized_weight_bytes_per_card(shape, tp, ELT_BYTES[dtype_name(weight_dtype)],
                                               quantize, group_size)
    sharded, replicated = _param_split(shape, tp)
    return (math.ceil(sharded / tp) + replicated) * ELT_BYTES[dtype_name(weight_dtype)]


def max_positions(config_json: dict) -> int:
    """Positions the model can address: max_position_embeddings, or its rope-scaled reach."""
    c = {**config_json, **config_json.get("text_config", {})}
    mpe = int(c.get("max_position_embeddings") or 0)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if factor and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        orig = int(rope.get("original_max_position_embeddings") or mpe)
        return max(mpe, int(orig * float(factor)))
    return mpe


# ---------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ModelPlan:
    """One model's pool as configured on one neuron; all byte figures are per card."""

    model_id: str
    tp: int
    weight_dtype: str
    kv_dtype: str  # resolved, never "auto"
    weight_bytes_per_card: int
    bytes_per_token: int
    fixed_bytes: int
    block_size: int
    kv_budget_bytes: int
    num_blocks: int
    pool_tokens: int
    max_position_embeddings: int
    context: int
    input: int
    output: int
    trade: list[tuple[int, int]]  # (concurrent full-length sessions, tokens each)
    budget_source: str = ""  # how kv_budget_bytes was found, for the printout
    shape: ModelShape | None = None
    # Hybrids: linear-attention state slots the engine sets aside (one per request in
    # flight) and the blocks left beside them (state_slots); 0 and num_blocks for dense.
    num_state_slots: int = 0
    blocks_beside_state: int = 0
    held_bytes: int = 0  # hybrids: a slot's room for a held verification row (not in the ledger)
    # A draft model (speculation = "draft:<id>"): its share of weight_bytes_per_card and of
    # bytes_per_token (its layers' KV shares each request's blocks); 0 without one.
    draft_model_id: str = ""
    draft_weight_bytes: int = 0
    draft_bytes_per_token: int = 0
    mtp_kv_layers: int = 0  # pool layers for the MTP head (plan_mtp_layers)


def model_config_path(config_file: str | Path, entry: ModelEntry) -> Path:
    """The config.json used to plan an entry: `config`, else `path`/config.json."""
    if entry.config is not None:
        return resolve_path(config_file, entry.config)
    assert entry.path is not None  # ModelEntry guarantees one of them
    return resolve_path(config_file, entry.path) / "config.json"


def _key(cfg: NeuronConfig, entry: ModelEntry, field: str) -> str:
    i = next((i for i, m in enumerate(cfg.models) if m is entry or m.id == entry.id), None)
    return f"models[{i}].{field}" if i is not None else f"models.{entry.id}.{field}"


def _tokens_each(budget: int, sessions: int, block_bytes: int, block_size: int, fixed: int) -> int:
    """Tokens each of `sessions` equal requests can hold: whole blocks after their fixed state."""
    free = budget - sessions * fixed
    return 0 if free <= 0 else (free // block_bytes // sessions) * block_size


def plan_model(cfg: NeuronConfig, entry: ModelEntry, config_file: str | Path, *,
               kv_dtype: str | None = None, device_memory_mb: int | None = None) -> ModelPlan:
    """Plan one catalogue entry; raises PlanError (with the arithmetic) if it cannot work.

    `kv_dtype` overrides the configured one (profile, then [kv]);
    `device_memory_mb` overrides server.device_memory_mb (a live device's size).
    """
    def where(field: str) -> str:  # `file: models[i].field` (or a [kv] key) for messages
        return f"{config_file}: {field if '.' in field else _key(cfg, entry, field)}"

    cfg_path = model_config_path(config_file, entry)
    gguf = None
    if entry.config is None:  # a GGUF file (or a folder of one): config beside it or inside
        assert entry.path is not None
        try:
            gguf = find_gguf(resolve_path(config_file, entry.path))
        except GgufError as e:
            raise PlanError(f"{where('path')}: {e}") from None
    try:
        raw = read_config(gguf) if gguf is not None else json.loads(cfg_path.read_text())
        shape = read_model_shape(raw)
    except FileNotFoundError:
        field = "config" if entry.config is not None else "path"
        raise PlanError(f"{where(field)}: expected a model config.json, no file {cfg_path}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise PlanError(f"{where('config')}: {cfg_path}: unreadable model config ({e!r})") from None
    tp, bs = entry.tp, cfg.kv.block_size
    if shape.num_heads % tp or (shape.num_kv_heads % tp and tp % shape.num_kv_heads):
        raise PlanError(f"{where('tp')}: expected a divisor of the {shape.num_heads} attention heads "
                        f"that divides or is a multiple of the {shape.num_kv_heads} kv heads, got {tp}")
    weight_dtype = shape.torch_dtype if entry.dtype == "auto" else entry.dtype
    float_dtype = weight_dtype  # weight_dtype gains notes for the printout below
    profile = cfg.profiles.get(entry.profile) if entry.profile else None
    kv = kv_dtype or (profile.kv_dtype if profile and profile.kv_dtype else None) or cfg.kv.kv_dtype
    kv = weight_dtype if kv == "auto" else kv
    weights = weight_bytes_per_card(shape, tp, weight_dtype, entry.quantize, entry.quant_group_size)
    # linear-attention state in the model's float dtype (its activations'), quantised or not
    fixed = fixed_bytes_per_request(shape, tp, weight_dtype)
    in_file = checkpoint_quantization(raw)
    if gguf is not None:  # each tensor on its op (helexa/gguf_meta.py)
        if entry.quantize != "none":
            raise PlanError(f"{where('quantize')}: expected \"none\" for a GGUF file, which "
                            f"keeps its own quantisation, got {entry.quantize!r}")
        try:
            weights = gguf_weight_bytes_per_card(gguf, raw, tp, ELT_BYTES[dtype_name(weight_dtype)])
        except (GgufError, KeyError) as e:
            raise PlanError(f"{where('path')}: {gguf}: {e}") from None
        weight_dtype += f", GGUF {type_summary(gguf)}"
    elif in_file is not None:  # quantised in the checkpoint: its own layout, float head
        kind, group, reordered = in_file
        weights = quantized_weight_bytes_per_card(
            shape, tp, ELT_BYTES[dtype_name(weight_dtype)], kind, group, float_heads=True,
            reordered=reordered)
        weight_dtype += f", {kind} g{group or 'channel'} in the checkpoint"
    elif entry.quantize == "int4":
        weight_dtype += f", {entry.quantize} g{entry.quant_group_size}, int8 head"
    elif entry.quantize == "int8":
        weight_dtype += ", int8"
    mtp_layers = plan_mtp_layers(cfg, entry, shape)
    per_token = kv_bytes_per_token(shape, tp, kv, mtp_layers)
    draft_id = draft_model_id(entry.speculation)
    draft_weights = draft_per_token = 0
    if draft_id is not None:  # its weights and KV come out of the same card (tp = 1)
        draft_weights, draft_per_token = _draft_costs(cfg, config_file, draft_id, kv,
                                                      float_dtype, where)
        weights += draft_weights
        per_token += draft_per_token
        weight_dtype += f"; + draft {draft_id} {_size(draft_weights)}"

    device_mb = device_memory_mb or cfg.server.device_memory_mb
    headroom = cfg.kv.activation_headroom_mb * MIB
    budget_mb = entry.kv_budget_mb or cfg.kv.kv_budget_mb
    budget_key = "kv_budget_mb" if entry.kv_budget_mb else "kv.kv_budget_mb"
    if budget_mb is not None:
        budget = budget_mb * MIB
        source = f"{budget_mb:,} MiB kv_budget_mb"
        if device_mb and weights + budget + headroom > device_mb * MIB:
            raise PlanError(
                f"{where(budget_key)}: expected weights + KV + headroom within {device_mb:,} MiB "
                f"per card, got {weights / MIB:,.0f} + {budget_mb:,} + {headroom // MIB:,} MiB")
    elif device_mb:
        usable = int(device_mb * MIB * cfg.kv.memory_fraction)
        budget = usable - weights - headroom
        source = (f"{device_mb:,} MiB × {cfg.kv.memory_fraction} − {weights / MIB:,.0f} MiB weights "
                  f"− {headroom // MIB:,} MiB headroom")
        if budget < bs * per_token + fixed:
            raise PlanError(f"{where('tp')}: expected the weights to leave room for KV: {source} = "
                            f"{budget / MIB:,.0f} MiB, less than one block")
    else:
        raise UnknownBudget(f"{where('kv.kv_budget_mb')}: expected kv_budget_mb or "
                            f"server.device_memory_mb to plan without a device")

    block_bytes = bs * per_token
    num_blocks = budget // block_bytes
    pool_tokens = num_blocks * bs
    positions = max_positions(raw)
    held = held_bytes_per_request(shape, tp, planned_spec_k(cfg, entry), float_dtype)
    slot = fixed + held  # what one request's state slot takes from the budget
    single = _tokens_each(budget, 1, block_bytes, bs, slot)
    if entry.context is not None:
        context = entry.context
        need_blocks = math.ceil(context / bs)
        if positions and context > positions:
            raise PlanError(f"{where('context')}: expected at most the model's {positions:,} "
                            f"positions, got {context:,}")
        if need_blocks > num_blocks or need_blocks * block_bytes + slot > budget:
            raise PlanError(
                f"{where('context')}: expected at most {min(single, pool_tokens):,} tokens: "
                f"{context:,} tokens need {need_blocks:,} blocks × {bs} × {per_token:,} B"
                f" + {slot:,} B fixed = {(need_blocks * block_bytes + slot) / MIB:,.1f} MiB, "
                f"but the pool holds {num_blocks:,} blocks ({budget / MIB:,.1f} MiB: {source})")
    else:
        context = (min(positions, single) if positions else single) // bs * bs
        if context < 2:
            raise PlanError(f"{where(budget_key)}: expected room for at least one block, "
                            f"got {budget / MIB:,.1f} MiB for {block_bytes:,} B blocks")
    output = min(entry.max_output_tokens or context - 1, context - 1)
    trade = [(n, min(context, _tokens_each(budget, n, block_bytes, bs, slot)))
             for n in TRADE_SESSIONS]
    plan = ModelPlan(
        model_id=entry.id, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv,
        weight_bytes_per_card=weights, bytes_per_token=per_token, fixed_bytes=fixed,
        block_size=bs, kv_budget_bytes=budget, num_blocks=num_blocks, pool_tokens=pool_tokens,
        max_position_embeddings=positions, context=context, input=context - 1, output=output,
        trade=trade, budget_source=source, shape=shape, held_bytes=held,
        draft_model_id=draft_id or "", draft_weight_bytes=draft_weights,
        draft_bytes_per_token=draft_per_token, mtp_kv_layers=mtp_layers)
    blocks, slots = state_slots(plan, cfg.admission.max_in_flight)
    return _replace(plan, num_state_slots=slots, blocks_beside_state=blocks)


def _draft_costs(cfg: NeuronConfig, config_file: str | Path, draft_id: str, kv_dtype: str,
                 weight_dtype: str, where: Any) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of a draft model run in the target's weight and KV
    dtypes, unsharded (docs/speculation.md)."""
    try:
        d = cfg.model(draft_id)
    except KeyError:
        raise PlanError(f"{where('speculation')}: no [[models]] entry `{draft_id}`") from None
    d_path = model_config_path(config_file, d)
    try:
        d_shape = read_model_shape(json.loads(d_path.read_text()))
    except FileNotFoundError:
        raise PlanError(f"{where('speculation')}: draft model `{draft_id}`: expected a model "
                        f"config.json, no file {d_path}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise PlanError(f"{where('speculation')}: draft model `{draft_id}`: {d_path}: "
                        f"unreadable model config ({e!r})") from None
    return (weight_bytes_per_card(d_shape, 1, weight_dtype),
            kv_bytes_per_token(d_shape, 1, kv_dtype))


def state_slots(plan: ModelPlan, max_in_flight: int) -> tuple[int, int]:
    """(KV blocks, state slots) a hybrid model's budget is split into; (num_blocks, 0) for
    a dense one.

    The engine holds one linear-attention state slot per request in flight, allocated at
    load beside the blocks and out of the same budget: `max_in_flight` slots, fewer if
    that would leave less than one request of `context` tokens, never fewer than one.
    Each slot also sets aside its held_bytes (a speculative verification row it may hold).
    """
    if not plan.fixed_bytes:
        return plan.num_blocks, 0
    block_bytes = plan.block_size * plan.bytes_per_token
    context_bytes = math.ceil(plan.context / plan.block_size) * block_bytes
    per_slot = plan.fixed_bytes + plan.held_bytes
    slots = max(1, min(max_in_flight, (plan.kv_budget_bytes - context_bytes) // per_slot))
    return (plan.kv_budget_bytes - slots * per_slot) // block_bytes, slots


def check_neuron_config(path: str | Path, cfg: NeuronConfig) -> list[ModelPlan]:
    """Plan every model of a neuron config; raises PlanError on the first that cannot work.

    A profile that switches the KV dtype re-plans the pool at runtime, so
    each model is also planned under every such profile. A model whose budget
    depends on a live device's memory is skipped here.
    """
    plans = []
    for entry in cfg.models:
        try:
            plans.append(plan_model(cfg, entry, path))
            for name, profile in cfg.profiles.items():
                if profile.kv_dtype is None:
                    continue
                try:
                    plan_model(cfg, entry, path, kv_dtype=profile.kv_dtype)
                except PlanError as e:
                    raise PlanError(f"{e} (under [profiles.{name}] kv_dtype = "
                                    f"{profile.kv_dtype!r})") from None
        except UnknownBudget:
            continue
    return plans


# ------------------------------------------------------------------- printing


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_plan(p: ModelPlan) -> str:
    s = p.shape
    assert s is not None
    heads = kv_heads_per_card(s, p.tp)
    per_head = (p.bytes_per_token - p.draft_bytes_per_token) // max(
        1, 2 * (s.full_attention_layers + p.mtp_kv_layers) * heads)
    layers = (f"{s.full_attention_layers} full-attention layers" if s.linear_attention_layers == 0
              else f"{s.full_attention_layers} of {s.num_layers} layers full attention")
    if p.mtp_kv_layers:
        layers = f"({layers} + {p.mtp_kv_layers} MTP)"
    lines = [
        f"  {p.model_id}  ({s.architecture}, {_count(s.param_count)} params, tp={p.tp})",
        f"    weights per card    {_size(p.weight_bytes_per_card)} ({p.weight_dtype})",
        f"    KV per token/card   {p.bytes_per_token:,} B ({_size(p.bytes_per_token)}) = 2 × {layers}"
        f" × {heads} kv heads × {per_head:,} B ({p.kv_dtype}, head_dim {s.head_dim})"
        + (f" + {p.draft_bytes_per_token:,} B draft" if p.draft_model_id else ""),
        *([f"    draft model         {p.draft_model_id}: {_size(p.draft_weight_bytes)} weights, "
           f"{p.draft_bytes_per_token:,} B KV per token (counted in both figures above)"]
          if p.draft_model_id else []),
        f"    fixed per request   {p.fixed_bytes:,} B ({_size(p.fixed_bytes)})"
        + (f": recurrent + conv state of {s.linear_attention_layers} linear-attention layers"
           if p.fixed_bytes else ""),
        f"    KV budget per card  {_size(p.kv_budget_bytes)} ({p.budget_source})",
        f"    pool                {p.num_blocks:,} blocks × {p.block_size} = {p.pool_tokens:,} tokens"
        + (f"; served as {p.num_state_slots} state slots (one per request in flight) + "
           f"{p.blocks_beside_state:,} blocks" if p.num_state_slots else ""),
    ]
    if p.held_bytes:
        lines.append(f"    speculation room    {p.held_bytes:,} B ({_size(p.held_bytes)}) per"
                     " state slot: one verification row's inputs, for rollback")
    lines += [
        f"    advertised          context {p.context:,}  input {p.input:,}  output {p.output:,}"
        f"  (model positions {p.max_position_embeddings:,})",
        "    sessions  tokens each",
    ]
    lines += [f"    {n:>8}  {t:>11,}" for n, t in p.trade]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="helexa plan", description=(
        "Print each model's memory per card and the context its KV pool buys, from the "
        "neuron config and each model's config.json alone."))
    ap.add_argument("files", nargs="+", help="neuron config files (asset/neuron/*.toml)")
    ap.add_argument("--kv-dtype", choices=["auto", "fp32", "fp16", "bf16", "fp8_e4m3", "int8", "int4"],
                    help="plan with this KV dtype instead of the configured one")
    args = ap.parse_args(argv)
    status = 0
    for path in args.files:
        print(path)
        try:
            cfg = load_neuron_config(path)
        except ConfigError as e:
            print(e, file=sys.stderr)
            status = 2
            continue
        for entry in cfg.models:
            try:
                print(format_plan(plan_model(cfg, entry, path, kv_dtype=args.kv_dtype)))
            except PlanError as e:
                print(e, file=sys.stderr)
                status = 2
    return status
