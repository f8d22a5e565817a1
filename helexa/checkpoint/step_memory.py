"""What a CUDA card holds beside the weights, the KV pool and the decode graphs while it
serves: one step's activations at engine.max_batched_tokens, FlashInfer's eager
workspaces, the rotary table, and at tp > 1 a stated margin for NCCL and the CUDA
context. `helexa plan` adds them to the graph pool, the all-reduce workspace and the
vision tower's peak (helexa/checkpoint/memory.py) and weighs the sum against the
activation headroom (helexa/plan.py). The formulas are memory.py's docstring table's.

Activations are freed layer by layer, so a step peaks in its largest layer: each kind's
live bytes a token at its peak (layer_token_bytes, the torch forms' and fla's tensors as
the model code makes them; tests/checkpoint/test_step_memory.py checks them against what
a CPU step really holds). An estimate, not a measurement: the load measures a worst-case
step instead, on every card (helexa/neuron/engine/pool_probe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helexa.checkpoint.memory import (
    FI_WRAPPER_INT_BYTES,
    flashinfer_workspace_bytes,
    format_bytes,
    kv_heads_per_card,
    moe_gathers,
)
from helexa.checkpoint.shape import ModelShape

MIB = 2**20
# NCCL's buffers and the CUDA context at tp > 1, per card: not computable from a config.
# NVIDIA/nccl#964 measured 544 MB of NCCL buffers for a group of 2 A100s and 688 MB for
# larger ones; #864 saw about 1.6 GB for a communicator in use; beast's two RTX 5090s left
# ~707 MiB for context and NCCL together (asset/neuron/beast.toml). A margin, stated.
NCCL_MARGIN_BYTES = 1024 * MIB
FLA_CHUNK = 64  # fla-core 0.6.0's chunk of the chunked Gated DeltaNet (chunk.py chunk_size)
SYNC_FREE_MAX_ROWS = 256  # helexa/kernels/moe_experts.py: eager steps up to this run sync-free
ROPE_HEAD_DIMS = (64, 128, 256, 512)  # the head sizes FlashInfer's rope kernel is built for
INPUT_BYTES = 3 * 8  # a token's id, position and write slot, int64 (model_runner._prepare)
# Sampling a step's logits as a request asking for everything would (top-k, top-p, min-p,
# penalties, 20 logprobs: helexa/neuron/engine/sampler.py on CUDA's path, a full sort):
# its temporaries a logit beyond the fp32 logits themselves. Measured on CPU (16 rows of
# a 151,936-token vocabulary: 116 MiB at its peak, 50.2 B a logit); the load's probe
# measures it on the card (pool_probe.decode_peaks: rank 0's, the one that samples).
SAMPLING_BYTES_PER_LOGIT = 50


def layer_token_bytes(shape: ModelShape, tp: int, elt: int) -> dict[str, int]:
    """Each layer kind's live bytes a token on one card at its peak, in activations of
    ``elt`` bytes (the docstring table's formulas); kinds the model lacks are left out."""
    h, d = shape.hidden_size, shape.head_dim
    heads, kvh = math.ceil(shape.num_heads / tp), kv_heads_per_card(shape, tp)
    gated = 2 if shape.attn_output_gate else 1
    # decoder_stack holds the layer's normed input, the stream and the layer before's
    # output; the layer's add makes the stream after it and its normed output (the torch
    # forms: FlashInfer's in place on CUDA)
    held = 3 * h * elt
    out: dict[str, int] = {}
    # q, k, v, the normed and rotated q and k, the attention's output (gated: its sigmoid
    # and product) and o_proj's: as on CUDA, whose norm and rope kernels make no fp32
    # copies of q and k as the torch forms do on CPU. Not measured: no model planned here
    # peaks in its attention (the 8B's is 73% of its MLP's, the 27B's 71% of its DeltaNet's)
    out["full attention"] = held + elt * (h + (gated * heads + 2 * kvh) * d
                                          + 3 * (heads + kvh) * d + (2 * gated - 1) * heads * d)
    stream = held + 2 * h * elt
    if shape.intermediate_size and not shape.num_experts:
        out["dense MLP"] = stream + 3 * math.ceil(shape.intermediate_size / tp) * elt
    if shape.num_experts:
        e, k = shape.num_experts, shape.num_experts_per_tok
        moe, shared = (math.ceil(n / tp) for n in (shape.moe_intermediate_size,
                                                   shape.shared_expert_intermediate_size))
        # the looped form (prefill): one expert's rows at most every token, its gate/up,
        # SiLU and product; the shared expert's after; the router's fp32 probabilities
        routed = (3 * h + 4 * moe) * elt
        out["MoE MLP"] = stream + h * elt + 4 * e + 12 * k + max(
            routed, (2 * h + 4 * shared) * elt if shared else 0)
    if shape.linear_attention_layers:
        out["Gated DeltaNet"] = held + gdn_token_bytes(shape, tp, elt)
    return out


def gdn_token_bytes(shape: ModelShape, tp: int, elt: int) -> int:
    """A Gated DeltaNet layer's own live bytes a token on one card in a prefill chunk on
    fla's chunked kernel (helexa/kernels/backends/gdn.py, fla_gdn.fla_chunked_varlen)."""
    kh, vh = (math.ceil(n / tp) for n in (shape.linear_num_key_heads,
                                          shape.linear_num_value_heads))
    dk, dv = shape.linear_key_head_dim, shape.linear_value_head_dim
    conv = 2 * kh * dk + vh * dv
    return (elt * (conv + vh * dv + 2 * vh  # in_proj's output: [q | k | v], z, b, a
                   + 2 * conv)  # the conv's output and the buffer it is copied into
            + 4 * (2 * kh * dk + 2 * vh + vh * dv)  # q, k normalised, g, beta, o: fp32
            + elt * (2 * kh * dk + vh * dv + vh)  # fla's inputs: q, k cast, v contiguous, beta
            + vh * fla_chunk_bytes(dk, dv, elt))


def gdn_sequence_bytes(shape: ModelShape, tp: int, elt: int) -> int:
    """A step's sequence's recurrent states in a Gated DeltaNet layer, one card: gathered
    from its slot, in fp32 for fla, and the final state fla returns (fp32)."""
    vh = math.ceil(shape.linear_num_value_heads / tp)
    return vh * shape.linear_key_head_dim * shape.linear_value_head_dim * (elt + 8)


def fla_chunk_bytes(dk: int, dv: int, elt: int, chunk: int = FLA_CHUNK) -> int:
    """fla's chunked forward's intermediates a token and value head, alive together in
    chunk_fwd_o (fla-core 0.6.0, ops/gated_delta_rule/chunk.py): the gates' cumulative sum
    (fp32), A [chunk], w [dk], u, v_new and o [dv] each, and the chunk states h
    [dk x dv] a chunk, in the inputs' dtype."""
    return 4 + elt * (chunk + dk + 3 * dv) + elt * dk * dv // chunk


@dataclass(frozen=True)
class StepActivations:
    """One step's activations on a card (per card; see step_activations)."""

    tokens: int  # engine.max_batched_tokens
    per_token: int  # the largest layer kind's live bytes a token
    layer: str  # which kind that is
    logits_rows: int
    logits: int  # the wanted rows' logits as computed
    states: int = 0  # hybrids: the step's sequences' recurrent states in the largest layer
    sequences: int = 0  # how many sequences those are
    sync_free_rows: int = 0  # MoE on CUDA: the largest eager step an expert form holds for
    sync_free: int = 0  # its [E, N, 2I] and [E, N, H] (or gathered copies) at that many rows

    @property
    def total(self) -> int:
        return max(self.tokens * self.per_token,
                   self.sync_free_rows * self.per_token + self.sync_free) + self.logits + self.states


def step_activations(shape: ModelShape, tp: int, tokens: int, elt: int, logits_rows: int,
                     sequences: int = 1, cuda: bool = True) -> StepActivations:
    """The step of ``tokens`` tokens (prefill chunks of up to ``sequences`` sequences) whose
    ``logits_rows`` rows want logits, on one card: the largest layer's live bytes a token
    (with the step's inputs and the torch rotation's cos and sin rows), in a Gated DeltaNet
    layer each sequence's states, the logits as the LM head makes them (its slice, at
    tp > 1 the slices gathered and joined, then fp32) and on CUDA an MoE layer's
    sync-free forms at up to SYNC_FREE_MAX_ROWS rows (moe_experts.choose_form)."""
    kinds = layer_token_bytes(shape, tp, elt)
    layer = max(kinds, key=lambda kind: kinds[kind])
    rd = shape.rotary_dim or shape.head_dim
    per_token = kinds[layer] + INPUT_BYTES + 2 * rd * elt
    vocab = shape.vocab_size
    card = math.ceil(vocab / tp)
    rows = min(tokens, logits_rows)
    logits = rows * (shape.hidden_size * elt + vocab * 4 + elt * (
        card + (tp * card + vocab if tp > 1 else 0)))
    free_rows = min(SYNC_FREE_MAX_ROWS, tokens) if cuda and shape.num_experts else 0
    seqs = min(sequences, tokens) if layer == "Gated DeltaNet" else 0
    return StepActivations(tokens, per_token, layer, rows, logits,
                           seqs * gdn_sequence_bytes(shape, tp, elt), seqs, free_rows,
                           sync_free_bytes(shape, tp, free_rows, elt))


def sync_free_bytes(shape: ModelShape, tp: int, rows: int, elt: int) -> int:
    """An MoE layer's float experts in an eager CUDA step of ``rows`` rows (at most
    SYNC_FREE_MAX_ROWS), in the form moe_experts.choose_form runs: the masked form's
    [E, rows, 2I] and [E, rows, I] activations and [E, rows, H] products where 3 x rows x
    top_k > E (moe_gathers), else the gathered form's copies of each (row, choice)'s gate/up matrix
    (2I x H, the larger of its two gathers). The decode graphs' own are graph_pool_bytes'."""
    e, k = shape.num_experts, shape.num_experts_per_tok
    if not rows or not e or not k:
        return 0
    inter = math.ceil(shape.moe_intermediate_size / tp)
    if not moe_gathers(rows, k, e):
        return e * rows * (3 * inter + shape.hidden_size) * elt
    return rows * k * 2 * inter * shape.hidden_size * elt


def flashinfer_int_workspaces(flashinfer_pool: bool) -> int:
    """The eager wrappers' int workspaces: the prefill wrapper's, and the decode one's where
    the pool is FlashInfer's (a torch-path pool's decode runs no wrapper)."""
    return 2 if flashinfer_pool else 1


def flashinfer_eager_bytes(shape: ModelShape, tp: int, flashinfer_pool: bool) -> int:
    """FlashInfer's eager wrappers on one card (helexa/kernels/backends/cuda.py): their one
    float workspace (flashinfer_workspace_bytes: 256 MiB or a split-kv plan's), the prefill
    wrapper's int workspace and, where the pool is FlashInfer's (not a torch-path pool's),
    the eager decode wrapper's."""
    group = max(1, math.ceil(shape.num_heads / tp) // kv_heads_per_card(shape, tp))
    return (flashinfer_workspace_bytes(group, shape.head_dim)
            + FI_WRAPPER_INT_BYTES * flashinfer_int_workspaces(flashinfer_pool))


def rope_table_bytes(shape: ModelShape, positions: int, elt: int) -> int:
    """The rotary table on the card for ``positions`` positions (helexa/kernels/rotary.py):
    cos and signed sin rows of rotary_dim in the activations' dtype, and FlashInfer's fp32
    cos_sin_cache of rotary_dim a position where its rope kernel takes the head size."""
    rd = shape.rotary_dim or shape.head_dim
    kernel = 4 if elt == 2 and shape.head_dim in ROPE_HEAD_DIMS and rd % 2 == 0 else 0
    return positions * rd * (2 * elt + kernel)


def rope_positions(shape: ModelShape, reach: int, context: int, graphs: bool) -> int:
    """The positions the rotary table holds: the model's whole reach where CUDA graphs
    freeze it (cuda_graphs.prepare), else grown on demand from min(reach, 4,096), doubling,
    to the context at most (RotaryTable.ensure)."""
    if graphs or not context:
        return reach
    length = min(reach or 4096, 4096)
    while length < context:
        length *= 2
    return length


@dataclass(frozen=True)
class ActivationNeed:
    """What the activation headroom must hold on one CUDA card (bytes each)."""

    step: StepActivations
    encoder: int = 0  # the vision tower's peak, in an image step in place of the text's
    cache: int = 0  # the vision tower's embedding cache
    graphs: int = 0
    allreduce: int = 0
    flashinfer: int = 0
    flashinfer_ints: int = 0  # of those, the wrappers' int workspaces (FI_WRAPPER_INT_BYTES)
    rope: int = 0
    rope_positions: int = 0
    comm: int = 0  # NCCL and the CUDA context, tp > 1
    sampling: int = 0  # a step's logits sampled: the fp32 logits and the sampler's bytes

    @property
    def total(self) -> int:
        return (max(self.step.total, self.encoder, self.sampling) + self.cache + self.graphs
                + self.allreduce + self.flashinfer + self.rope + self.comm)

    @property
    def headroom_mb(self) -> int:
        """The least kv.activation_headroom_mb that holds it all (helexa/plan.py adds the
        embedding cache to the larger of it and the tower's peak)."""
        return math.ceil((self.total - self.cache) / MIB)


def activation_need(shape: ModelShape, tp: int, elt: int, *, tokens: int, logits_rows: int,
                    sequences: int, positions: int, graphs: int, allreduce: int, encoder: int, cache: int,
                    flashinfer_pool: bool) -> ActivationNeed:
    """The activation headroom's terms on one CUDA card (the rotary table of ``positions``)."""
    return ActivationNeed(
        step=step_activations(shape, tp, tokens, elt, logits_rows, sequences), encoder=encoder,
        cache=cache, graphs=graphs, allreduce=allreduce,
        flashinfer=flashinfer_eager_bytes(shape, tp, flashinfer_pool),
        flashinfer_ints=flashinfer_int_workspaces(flashinfer_pool),
        rope=rope_table_bytes(shape, positions, elt), rope_positions=positions,
        comm=NCCL_MARGIN_BYTES if tp > 1 else 0,
        sampling=min(tokens, logits_rows) * shape.vocab_size * (4 + SAMPLING_BYTES_PER_LOGIT))


def need_sum(need: ActivationNeed) -> str:
    """The headroom's terms added up, as `helexa plan` and its refusal print them."""
    step = format_bytes(need.step.total)
    peak = max(need.step.total, need.encoder, need.sampling)
    parts = [(f"the vision tower's peak {format_bytes(need.encoder)} (over the text step's "
              f"{step})" if need.encoder == peak > need.step.total else
              f"sampling {format_bytes(need.sampling)} (over the text step's {step})"
              if need.sampling == peak > need.step.total else f"text step {step}"),
             *(f"{name} {format_bytes(n)}" for name, n in (
                 ("its embedding cache", need.cache), ("graph pool", need.graphs),
                 ("all-reduce", need.allreduce), ("FlashInfer", need.flashinfer),
                 ("rotary table", need.rope), ("NCCL and context", need.comm)) if n)]
    return f"{format_bytes(need.total)} = " + " + ".join(parts)
