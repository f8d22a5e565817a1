"""`helexa plan FILE…`: print each model's pool arithmetic (helexa/plan.py) and the trade table."""

from __future__ import annotations

import argparse
import sys

from helexa.checkpoint.kv_path import FLOAT_KV
from helexa.checkpoint.memory import FI_WRAPPER_INT_BYTES, format_bytes, kv_heads_per_card
from helexa.checkpoint.shape import ELT_BYTES, dtype_name
from helexa.checkpoint.step_memory import SAMPLING_BYTES_PER_LOGIT, need_sum
from helexa.config.schema import AdmissionConfig, ConfigError, KvConfig, load_neuron_config
from helexa.plan import ModelPlan, PlanError, plan_model

# a quantised pool's graphs run the torch path's Triton kernels, captured where they serve
QUANT_GRAPHS = " (quantised KV: where its Triton write and decode kernels serve)"


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
        f"    weights per card    {format_bytes(p.weight_bytes_per_card)} ({p.weight_dtype})",
        f"    KV per token/card   {p.bytes_per_token:,} B ({format_bytes(p.bytes_per_token)}) = 2 × {layers}"
        f" × {heads} kv heads × {per_head:,} B ({p.kv_dtype}, head_dim {s.head_dim})"
        + (f" + {p.draft_bytes_per_token:,} B draft" if p.draft_model_id else ""),
        *([f"    draft model         {p.draft_model_id}: {format_bytes(p.draft_weight_bytes)} weights, "
           f"{p.draft_bytes_per_token:,} B KV per token (counted in both figures above)"]
          if p.draft_model_id else []),
        f"    fixed per request   {p.fixed_bytes:,} B ({format_bytes(p.fixed_bytes)})"
        + (f": recurrent + conv state of {s.linear_attention_layers} linear-attention layers"
           if p.fixed_bytes else ""),
        f"    KV budget per card  {format_bytes(p.kv_budget_bytes)} ({p.budget_source})",
        f"    pool                {p.num_blocks:,} blocks × {p.block_size} = {p.pool_tokens:,} tokens"
        + (f"; served as {p.num_state_slots} state slots (one per request in flight) + "
           f"{p.blocks_beside_state:,} blocks" if p.num_state_slots else ""),
    ]
    if p.fixed_bytes:
        lines.append(
            f"    prefix snapshots    {p.num_snapshot_slots} × {p.fixed_bytes:,} B = "
            f"{format_bytes(p.num_snapshot_slots * p.fixed_bytes)}: the linear-attention state at "
            "a block boundary, one per prefix-cache hit point" if p.num_snapshot_slots else
            f"    prefix snapshots    none fit ({p.fixed_bytes:,} B each) beside the state slots "
            "and one full context: the prefix cache is off for this model (lower context or "
            "admission.max_in_flight, or raise kv_budget_mb)")
    if p.host_blocks:
        lines.append(
            f"    host tier           {format_bytes(p.host_bytes_per_card)} of host memory per card "
            f"(kv.host_cache_mb / tp): {p.host_blocks:,} blocks = "
            f"{p.host_blocks * p.block_size:,} tokens"
            + (f" + {p.host_snapshots} prefix snapshots" if p.host_snapshots else "")
            + "; evicted prefixes wait there and are copied back on a hit")
    if p.held_bytes:
        lines.append(f"    speculation room    {p.held_bytes:,} B ({format_bytes(p.held_bytes)}) per"
                     " state slot: one verification row's inputs, for rollback")
    if p.graph_rows:
        lines.append(f"    CUDA graph pool     {format_bytes(p.graph_pool_bytes)} (estimate, with the"
                     f" graphs' attention buffers) for decode batches {p.graph_rows}..1 captured"
                     f" at load{QUANT_GRAPHS if p.kv_dtype not in FLOAT_KV else ''}, in the"
                     " activation headroom")
    if p.graphs_off:
        lines.append(f"    CUDA graphs         none: {p.graphs_off} runs FlashInfer's torch path on"
                     " a cuda backend, every decode step eagerly")
    if p.allreduce_rows:
        lines.append(f"    all-reduce space    {format_bytes(p.allreduce_workspace_bytes)} for the "
                     f"fused all-reduce + RMSNorm of steps up to {p.allreduce_rows} rows (where "
                     "FlashInfer's runs), in the activation headroom")
    if p.activation is not None:
        lines += headroom_lines(p)
    lines += [
        f"    advertised          context {p.context:,}  input {p.input:,}  output {p.output:,}"
        f"  (model positions {p.max_position_embeddings:,})",
        "    sessions  tokens each",
    ]
    lines += [f"    {n:>8}  {t:>11,}" for n, t in p.trade]
    return "\n".join(lines)


def headroom_lines(p: ModelPlan) -> list[str]:
    """What else a CUDA card holds in the activation headroom (step_memory.py), and the
    verdict: whether the headroom holds it all."""
    a = p.activation
    assert a is not None and p.shape is not None
    st, rd = a.step, p.shape.rotary_dim or p.shape.head_dim
    elt = ELT_BYTES[dtype_name(p.float_dtype)]
    lines = [
        f"    text step           {format_bytes(st.total)} (estimate) for {st.tokens:,} tokens "
        f"(engine.max_batched_tokens) × {st.per_token:,} B, a {st.layer} layer's live "
        f"activations a token, + {st.logits_rows:,} rows' logits {format_bytes(st.logits)}"
        + (f" + {st.sequences} sequences' recurrent states {format_bytes(st.states)}"
           if st.states else "")
        + (f"; MoE steps of up to {st.sync_free_rows} rows hold "
           f"{format_bytes(st.sync_free)} more in their sync-free expert form" if st.sync_free
           else ""),
        f"    sampling            {format_bytes(a.sampling)}: {st.logits_rows:,} rows × "
        f"{p.shape.vocab_size:,} logits × (4 B + {SAMPLING_BYTES_PER_LOGIT} B the sampler's, "
        "measured on CPU: a full sort for top-p, logprobs), after the step's forward",
        f"    FlashInfer          {format_bytes(a.flashinfer)}: the eager wrappers' float "
        f"workspace {format_bytes(a.flashinfer - a.flashinfer_ints * FI_WRAPPER_INT_BYTES)} + "
        + (f"{a.flashinfer_ints} int workspaces" if a.flashinfer_ints > 1 else "an int workspace")
        + f" of {format_bytes(FI_WRAPPER_INT_BYTES)}",
        f"    rotary table        {format_bytes(a.rope)}: {a.rope_positions:,} positions × {rd}"
        f" rotary dims × (cos and sin {2 * elt} B"
        + (" + FlashInfer's fp32 table 4 B)" if a.rope > a.rope_positions * rd * 2 * elt else ")"),
    ]
    if a.comm:
        lines.append(f"    NCCL and context    {format_bytes(a.comm)} at tp = {p.tp}: a stated "
                     "margin, not computable (NCCL's buffers and the CUDA context, 0.5 to 1.6 "
                     "GB a card: NVIDIA/nccl#964, #864)")
    fits = a.total <= p.headroom_bytes
    lines.append(f"    activation need     {need_sum(a)}: "
                 + ("inside" if fits else "MORE than") + " the "
                 f"{format_bytes(p.headroom_bytes)} activation headroom"
                 + ("" if fits else f" (raise kv.activation_headroom_mb to {a.headroom_mb:,} MiB)")
                 + ("; the load measures a worst-case step and sizes the pool to what is left"
                    if p.tp == 1 else "; the load measures a worst-case step on every card "
                    "and sizes the pool to what is left, the least any card holds"))
    return lines


def admission_line(adm: AdmissionConfig) -> str:
    """Which in-flight limit an anonymous caller meets (the router's callers without a key;
    all of them where it has none, as under `helexa up`)."""
    if adm.anon_max_in_flight >= adm.max_in_flight:
        rule = "the ordinary limits"
    elif adm.anon_max_in_flight == 0:
        rule = "none in flight (admission.anon_max_in_flight = 0: a key is needed)"
    else:
        rule = f"at most {adm.anon_max_in_flight} in flight together (admission.anon_max_in_flight)"
    return (f"  admission: {adm.max_in_flight} in flight per model; anonymous callers (no API "
            f"key): {rule}")


def prefix_cache_line(kv: KvConfig) -> str:
    """Whether prompts reuse cached prefixes, and whose (kv.prefix_sharing)."""
    if not kv.prefix_cache:
        return "  prefix cache: off (kv.prefix_cache = false)"
    if kv.prefix_sharing == "global":
        return ("  prefix cache: shared by all principals (kv.prefix_sharing = \"global\": a "
                "caller's cached_tokens shows whether others sent the same prefix)")
    return "  prefix cache: per principal (kv.prefix_sharing = \"principal\")"


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
        print(admission_line(cfg.admission))
        print(prefix_cache_line(cfg.kv))
        for entry in cfg.models:
            try:
                print(format_plan(plan_model(cfg, entry, path, kv_dtype=args.kv_dtype)))
            except PlanError as e:
                print(e, file=sys.stderr)
                status = 2
    return status
