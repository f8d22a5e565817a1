"""What a model costs per card, in bytes, from its shape: KV per token, fixed and held
state per request (sums of its layers' own statements, layer_memory.py), weights.
`helexa plan`, the pool's sizing and the ledger all read these.

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
    graph_pool_bytes (engine.cuda_graphs) = max_slots × (           # the largest decode batch
        vocab × (4 + 4 + weight bytes)                 # logits: shared out, fp32, as computed
        + weight bytes × (4 × hidden + (heads + 2 × kv_heads)/tp × head_dim
                          + 2 × intermediate/tp)       # one layer's live activations
        + (hybrids) 2 × v_heads/tp × k_dim × v_dim × 4 )  # one layer's gathered states, fp32
      + (MoE) max(min(max_slots, experts // top_k) × top_k × 3 × moe_intermediate/tp
                  × hidden,              # one layer's expert copies (moe_experts.py, gathered)
                  experts × max_slots × (3 × moe_intermediate/tp + hidden))  # or its batched
                  × weight bytes         # products (masked), where max_slots is past gathering
      + max_slots × (8 MiB               # each graph's FlashInfer wrapper: its int workspace
                     + 4 × pool blocks)  # their one page-index buffer (cuda.py), int32
      + flashinfer_graph_workspace_bytes(heads/tp, kv_heads/tp, head_dim, max_slots)
                                         # the graph wrappers' one float scratch: 256 MiB,
                                         # or their split-kv plans' where more
        (a quantised pool, whose graphs run the torch path's Triton kernels, in place of
        the three wrapper lines: torch_ref.py static_meta, kernels/cuda/quant_decode.py)
        max_slots × (4 × pool blocks + 12)  # each graph's pages (int32), context, slots
      + (SPLIT_PROGRAMS + max_slots × kv_heads/tp) × group × (pow2(head_dim) + 1) × 4
                                         # one layer's split scratch: partial outputs, fp32
      + (hybrids) linear-attention layers × v_heads/tp × k_dim × v_dim × weight bytes
                                         # the state pool's scratch slot, FlashInfer's
                                         # padding rows' (flashinfer_gdn.fi_rows): made
                                         # only where its pool decode runs (bf16, heads of
                                         # 128 x 128, Hopper on), counted here for any
                                         # hybrid; with graphs off, in the headroom uncounted
    (an estimate of what one shared pool holds for the largest captured batch, the smaller
    batches reusing it, and what the graphs' wrappers hold beside it; not measured on a GPU)
    allreduce_workspace_bytes (tp > 1 on CUDA: the fused all-reduce + add + RMSNorm,
        helexa/kernels/backends/cuda_comm.py) = 4 × tp × rows × hidden × 2
        + tp × 256 × 4                       # FlashInfer 0.6.13's three symmetric buffers
    rows = fused_allreduce_rows(max_slots) = max(128, max_slots)  # 128: its one-shot limit

On CUDA the activation headroom holds, besides those two and a vision tower's peak and
embedding cache, what helexa/checkpoint/step_memory.py counts (B = weight bytes, H =
hidden, heads, kv_heads, linear-attention heads and widths per card, N = tokens):
    step_bytes = N × (largest layer kind's bytes a token + 3 × 8   # ids, positions, slots
                      + 2 × rotary_dim × B)                       # the torch rotation's rows
                 + logits_rows × (H × B + vocab × 4 + B × (vocab/tp + (tp > 1) × (vocab/tp × tp
                                  + vocab)))          # rows gathered, head slice(s), fp32
                 + (hybrids) min(max_slots, N) × v_heads × k_dim × v_dim × (B + 8)  # states
      N = engine.max_batched_tokens, logits_rows = max_slots × (1 + spec_k); an MoE model on
      CUDA takes the larger of that and a 256-row step (moe_experts.SYNC_FREE_MAX_ROWS)
      holding moe_expert_bytes at min(256, N) rows (its masked or gathered form, eager)
    held = 3 × H × B   # decoder_stack's input, stream and the layer before's output
    dense MLP      = held + (2 × H + 3 × intermediate) × B  # stream and normed output after
                                                           # the add; gate/up, SiLU-and-mul
    MoE MLP        = held + 3 × H × B + 4 × experts + 12 × top_k   # output; router probs
                     + max(3 × H + 4 × moe_inter, 2 × H + 4 × shared_inter) × B  # looped
                     # form: one expert's rows (at most every token), gate/up, SiLU, product
    full attention = held + (H + (q_factor × heads + 2 × kv_heads) × head_dim
                     + 3 × (heads + kv_heads) × head_dim + (2 q_factor − 1) × heads × head_dim) × B
                     # q, k, v; normed, rotated q and k; output (gated: sigmoid, product)
    Gated DeltaNet = held + (conv + v_heads × v_dim + 2 v_heads    # in_proj's output
                     + 2 × conv) × B                                # conv output, its buffer
                     + 4 × (2 × k_heads × k_dim + 2 × v_heads + v_heads × v_dim)  # fp32 q k g β o
                     + (2 × k_heads × k_dim + v_heads × v_dim + v_heads) × B  # fla's inputs
                     + v_heads × (4 + (64 + k_dim + 3 × v_dim + k_dim × v_dim / 64) × B)
                     # fla-core 0.6.0's chunk intermediates: g cumsum, A, w, u, v_new, o, h
      conv = 2 × k_heads × k_dim + v_heads × v_dim
    flashinfer_eager = flashinfer_workspace_bytes(heads/kv_heads, head_dim)  # >= 256 MiB
                       + 8 MiB × (1 prefill wrapper + 1 decode wrapper where the pool is
                                  FlashInfer's)
    rope_table = positions × rotary_dim × (2 × B + 4)  # cos, sin; FlashInfer's fp32 table
                                                       # (where its rope takes the head)
      positions = the model's reach where graphs freeze the table, else its doubling
      growth to the context
    nccl_margin (tp > 1) = 1 GiB   # NCCL's buffers and the CUDA context: not computable,
                                   # a stated margin (step_memory.NCCL_MARGIN_BYTES)
    sampling = min(N, logits_rows) × vocab × (4 + 50)  # fp32 logits; the sampler's sort,
                                   # probabilities and logprobs (50 B a logit, measured on CPU)
    need = max(step_bytes, vision encoder, sampling) + embedding cache + graph_pool_bytes
           + allreduce_workspace_bytes + flashinfer_eager + rope_table + nccl_margin
"""

from __future__ import annotations

import math

from helexa.checkpoint.kv_path import FLOAT_KV, SPLIT_PROGRAMS, graphs_off
from helexa.checkpoint.layer_memory import (
    QUANT_GROUP,
    LinearAttentionSpec,
    kv_token_head_bytes,
    layer_specs,
)
from helexa.checkpoint.shape import ELT_BYTES, ModelShape, dtype_name, param_split
from helexa.checkpoint.weights import quantized_weight_bytes_per_card

__all__ = ["QUANT_GROUP", "allreduce_workspace_bytes", "cuda_graph_plan",
           "fixed_bytes_per_request", "fused_allreduce_workspace",
           "flashinfer_graph_workspace_bytes", "flashinfer_workspace_bytes",
           "fused_allreduce_rows", "graph_capture_sizes",
           "graph_pool_bytes", "held_bytes_per_request",
           "kv_bytes_per_token", "kv_heads_per_card", "kv_token_head_bytes",
           "weight_bytes_per_card"]


def kv_heads_per_card(shape: ModelShape, tp: int) -> int:
    return math.ceil(shape.num_kv_heads / tp)


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_dtype: str, mtp_layers: int = 0) -> int:
    """KV bytes one token takes on each card: full-attention layers, and `mtp_layers`
    of the MTP head where the pool holds them (helexa.plan: where a speculation names mtp)."""
    return sum(s.bytes_per_token for s in layer_specs(shape, tp, kv_dtype, mtp_layers=mtp_layers))


def fixed_bytes_per_request(shape: ModelShape, tp: int, dtype: str | None = None) -> int:
    """Per-request state that does not grow with tokens (linear-attention layers); 0 for dense.
    Kept in the weights' dtype (`dtype`, default the checkpoint's)."""
    return sum(s.fixed_bytes_per_request for s in layer_specs(shape, tp, "auto", dtype))


def held_bytes_per_request(shape: ModelShape, tp: int, spec_k: int,
                           dtype: str | None = None) -> int:
    """Room for the one verification row of spec_k + 1 positions a hybrid's state slot may
    hold (helexa/kernels/linear_state.py); 0 for dense. Float parts in `dtype` (default the
    checkpoint's), the normalised keys and the gates in fp32, as the layer keeps them."""
    return sum(s.held_bytes(spec_k) for s in layer_specs(shape, tp, "auto", dtype)
               if isinstance(s, LinearAttentionSpec))


def weight_bytes_per_card(shape: ModelShape, tp: int, weight_dtype: str,
                          quantize: str = "none", group_size: int = 128) -> int:
    """Weight bytes one card holds; ``quantize`` (int8, int4) as quantised at load."""
    if quantize != "none":
        return quantized_weight_bytes_per_card(shape, tp, ELT_BYTES[dtype_name(weight_dtype)],
                                               quantize, group_size)
    sharded, replicated = param_split(shape, tp)
    return (math.ceil(sharded / tp) + replicated) * ELT_BYTES[dtype_name(weight_dtype)]


def graph_capture_sizes(max_slots: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs at load, in capture order: every size
    from max_slots down to 1, largest first, so the one shared pool is sized by the largest
    and every smaller graph fits in what it already holds."""
    return list(range(max_slots, 0, -1))


FI_WRAPPER_INT_BYTES = 8 * 2**20  # FlashInfer 0.6.13: each decode wrapper's int workspace
FI_FLOAT_WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's float scratch, a wrapper family's: at least


def flashinfer_workspace_bytes(group: int, head_dim: int, sms: int = 132) -> int:
    """FlashInfer's float scratch for a GQA ``group`` at ``head_dim``: FI_FLOAT_WORKSPACE_BYTES,
    or what a split-kv prefill plan can take where that is more. Its plan puts each split's
    partial output in fp32, num_qo_heads x padded_batch_size x cta_tile_q x head_dim floats,
    the batch up to 2 CTAs an SM per kv head (scheduler.cuh, PrefillPlan): group x 2 x SMs x
    128 x head_dim x 4 bytes, over 256 MiB from a GQA group of 16 at head_dim 128 on 132 SMs
    (Qwen3-235B at tp 4), where the plan would raise 'Buffer overflow'. ``sms``: the card's
    (132 on an H100 or H200 SXM, what a plan without the card assumes)."""
    split = group * 2 * sms * 128 * (head_dim + 1) * 4  # partial outputs and their sums
    return max(FI_FLOAT_WORKSPACE_BYTES, split + 16 * 2**20)  # + the plan's smaller arrays


def flashinfer_graph_workspace_bytes(heads: int, kv_heads: int, head_dim: int, rows: int,
                                     sms: int = 132) -> int:
    """The graph decode wrappers' one float scratch, for batches of up to ``rows`` of
    ``heads`` query and ``kv_heads`` KV heads a card: FI_FLOAT_WORKSPACE_BYTES, or what
    their plans take where that is more. In graph mode FlashInfer 0.6.13 always splits
    the KV (scheduler.cuh). On tensor cores (PrefillPlan) each split keeps an fp32
    partial output of a tile of query rows: heads x padded x tile x head_dim floats,
    padded = max(2 CTAs an SM // kv_heads, ceil(rows x group / tile) + rows - 1) and the
    tile 16, 64 or 128 rows as the group passes 16 or 64 (FA2DetermineCtaTileQ): it grows
    with the batch, past 256 MiB from 340 rows of Qwen3-32B (64 heads, 8 KV, 128 dims).
    On CUDA cores (DecodePlan) the splits are at most the grid, 16 blocks an SM:
    heads x 16 x SMs // kv_heads x head_dim floats."""
    group = max(1, heads // max(1, kv_heads))
    tile = 128 if group > 64 and head_dim < 256 else 64 if group > 16 else 16
    padded = max(2 * sms // max(1, kv_heads), -(-rows * group // tile) + rows - 1)
    tensor_cores = heads * padded * tile * (head_dim + 1) * 4  # partial outputs and sums
    cuda_cores = heads * (16 * sms // max(1, kv_heads)) * (head_dim + 1) * 4
    return max(FI_FLOAT_WORKSPACE_BYTES, max(tensor_cores, cuda_cores) + 16 * 2**20)


def graph_pool_bytes(shape: ModelShape, tp: int, max_slots: int, dtype: str | None = None,
                     num_blocks: int = 0, quantised_kv: bool = False) -> int:
    """The shared CUDA-graph pool's bytes on each card for decode batches up to max_slots,
    with what the graphs' attention wrappers hold beside it for a pool of ``num_blocks``
    (``quantised_kv``: the torch path's buffers and split scratch in their place; see the
    module docstring; an estimate, in the weights' dtype, default the checkpoint's)."""
    elt = ELT_BYTES[dtype_name(dtype or shape.torch_dtype)]
    heads = math.ceil(shape.num_heads / tp) + 2 * kv_heads_per_card(shape, tp)
    inter = max(shape.intermediate_size, shape.moe_intermediate_size,
                shape.shared_expert_intermediate_size)
    per_row = shape.vocab_size * (8 + elt) + elt * (
        4 * shape.hidden_size + heads * shape.head_dim + 2 * math.ceil(inter / tp))
    if shape.linear_attention_layers:
        per_row += 2 * math.ceil(shape.linear_num_value_heads / tp) * (
            shape.linear_key_head_dim * shape.linear_value_head_dim * 4)
    # the graph wrappers' int workspaces and page indices, and their one float scratch
    kvh = kv_heads_per_card(shape, tp)
    if not max_slots:
        wrappers = 0
    elif quantised_kv:  # the torch path's buffers and one layer's split scratch
        dp = max(16, 1 << (shape.head_dim - 1).bit_length())
        group = shape.num_heads // max(1, shape.num_kv_heads)
        wrappers = max_slots * (4 * num_blocks + 12) + (
            SPLIT_PROGRAMS + max_slots * kvh) * group * (dp + 1) * 4
    else:
        wrappers = max_slots * (FI_WRAPPER_INT_BYTES + 4 * num_blocks) + (
            flashinfer_graph_workspace_bytes(math.ceil(shape.num_heads / tp), kvh,
                                             shape.head_dim, max_slots))
    scratch = shape.linear_attention_layers * math.ceil(shape.linear_num_value_heads / tp) * (
        shape.linear_key_head_dim * shape.linear_value_head_dim * elt) if max_slots else 0
    return (max_slots * per_row + moe_expert_bytes(shape, tp, max_slots, elt) + wrappers
            + scratch)


def moe_expert_bytes(shape: ModelShape, tp: int, max_slots: int, elt: int) -> int:
    """What an MoE layer's experts hold in a captured decode step (helexa/kernels/
    moe_experts.py), the larger of the two sync-free forms': the gathered form's copies of
    each (row, choice)'s gate/up and down matrices (3 x moe_intermediate/tp x hidden), for
    the largest batch it takes (rows x top_k <= experts: a quantised stack's bound, whose
    packed copies are at most the weights' dtype a value; a float stack stops at a third
    of that), and the masked form's batched products at max_slots rows, experts x rows x
    (3 x moe_intermediate/tp + hidden)."""
    k = shape.num_experts_per_tok
    if not shape.num_experts or not k:
        return 0
    inter = math.ceil(shape.moe_intermediate_size / tp)
    rows = min(max_slots, shape.num_experts // k)
    gathered = rows * k * 3 * inter * shape.hidden_size * elt
    masked = shape.num_experts * max_slots * (3 * inter + shape.hidden_size) * elt
    return max(gathered, 0 if moe_gathers(max_slots, k, shape.num_experts) else masked)


def moe_gathers(rows: int, top_k: int, experts: int, copies: int = 3) -> bool:
    """Whether a sync-free MoE step of ``rows`` rows takes the gathered form (helexa/
    kernels/moe_experts.py choose_form) rather than the masked one: while the experts'
    bytes its (row, choice) copies cost, ``copies`` reads of each (3 for float stacks, 1
    for quantised ones or where nothing is copied), stay within reading every expert once.
    helexa plan counts float stacks' 3, the most any stack costs."""
    return copies * rows * top_k <= experts


def fused_allreduce_rows(max_slots: int) -> int:
    """Steps of up to this many rows run the fused all-reduce (cuda_comm.py): every decode
    batch, and at least FlashInfer's one-shot limit of 128 rows."""
    return max(128, max_slots)


def allreduce_workspace_bytes(shape: ModelShape, tp: int, rows: int) -> int:
    """The fused all-reduce's workspace on each card at tp > 1 (0 at tp 1 or 0 rows): FlashInfer
    0.6.13's trtllm_create_ipc_workspace_for_all_reduce_fusion allocates a tp × rows ×
    hidden × 2-byte buffer, 3 Lamport buffers of the same size and tp × 256 int32 flags."""
    if tp <= 1 or rows <= 0:
        return 0
    return fused_allreduce_workspace(shape.hidden_size, tp, rows)


def fused_allreduce_workspace(hidden: int, tp: int, rows: int) -> int:
    """allreduce_workspace_bytes of a model of ``hidden`` width (cuda_comm.py checks it
    against the card's free memory before building it)."""
    return 4 * tp * rows * hidden * 2 + tp * 256 * 4


def cuda_graph_plan(shape: ModelShape, tp: int, rows: int, kv_dtype: str, float_dtype: str,
                    num_blocks: int, devices: list[str]) -> tuple[int, str, int]:
    """(rows, why none, pool bytes) of the CUDA graphs engine.cuda_graphs captures for
    decode batches 1..``rows`` (0: not asked for) on CUDA ``devices`` (none elsewhere).
    The cuda backend captures FlashInfer's decode, or a quantised pool's Triton kernels; a
    float pool of another dtype than the queries' runs the torch path, eagerly, with no
    graph (helexa/checkpoint/kv_path.py): then (0, why, 0)."""
    if not on_cuda(devices):
        rows = 0
    off = graphs_off(kv_dtype, float_dtype) if rows else ""
    rows = 0 if off else rows
    return rows, off, graph_pool_bytes(shape, tp, rows, float_dtype, num_blocks,
                                       quantised_kv=kv_dtype not in FLOAT_KV)


def on_cuda(devices: list[str]) -> bool:
    """Whether every device a model's ranks run on is a CUDA one."""
    return all(str(d).startswith("cuda") for d in devices)


def fused_allreduce_plan(shape: ModelShape, tp: int, max_slots: int,
                         devices: list[str]) -> tuple[int, int]:
    """(rows, workspace bytes per card) of the fused all-reduce: tp > 1 on CUDA devices
    only (cuda_comm.py runs it nowhere else); (0, 0) elsewhere."""
    if tp <= 1 or not on_cuda(devices):
        return 0, 0
    rows = fused_allreduce_rows(max_slots)
    return rows, allreduce_workspace_bytes(shape, tp, rows)


def format_bytes(n: float) -> str:
    """1536 → '1.5 KiB': a byte figure as `helexa plan` and its errors print it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def tokens_each(budget: int, sessions: int, block_bytes: int, block_size: int, fixed: int) -> int:
    """Tokens each of `sessions` equal requests can hold: whole blocks after their fixed state."""
    free = budget - sessions * fixed
    return 0 if free <= 0 else (free // block_bytes // sessions) * block_size
