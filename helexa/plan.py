"""KV-pool arithmetic: what a model costs per card and how much context a pool buys.

Used by `helexa plan FILE…`, by `helexa config check` (a configured context
the pool cannot hold is a config error) and by the neuron and engine to size
the pool at load. Everything here comes from a model's config.json alone, so
planning needs no weights and no device.

The byte formulas are helexa/checkpoint/memory.py's; the pool:

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

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from helexa.budget import host_tier_size, state_slots
from helexa.checkpoint.gguf import GgufError, find_gguf, read_config, type_summary
from helexa.checkpoint.gguf_layout import measures_activations
from helexa.checkpoint.gguf_layout import weight_bytes_per_card as gguf_weight_bytes_per_card
from helexa.checkpoint.kv_path import torch_path_kv
from helexa.checkpoint.layers_present import missing_layers
from helexa.checkpoint.memory import (
    cuda_graph_plan,
    fixed_bytes_per_request,
    format_bytes,
    fused_allreduce_plan,
    held_bytes_per_request,
    kv_bytes_per_token,
    on_cuda,
    tokens_each,
    weight_bytes_per_card,
)
from helexa.checkpoint.mmproj import find_mmproj
from helexa.checkpoint.shape import (
    ELT_BYTES,
    ModelShape,
    dtype_name,
    max_positions,
    read_model_shape,
)
from helexa.checkpoint.step_memory import (
    ActivationNeed,
    activation_need,
    rope_positions,
)
from helexa.checkpoint.vision_shape import max_image_patches, tower_loads
from helexa.checkpoint.weights import checkpoint_quantization, quantized_weight_bytes_per_card
from helexa.config.schema import (
    ModelEntry,
    NeuronConfig,
    Speculation,
    resolve_path,
    resolve_speculation,
)
from helexa.plan_sources import PlanError, UnknownBudget, draft_costs, model_config_path

MIB = 1024 * 1024
TRADE_SESSIONS = (1, 2, 4, 8)


def speculations(cfg: NeuronConfig, entry: ModelEntry | None = None) -> list[Speculation]:
    """The speculation the model runs without a profile and under each profile
    (resolve_speculation): the pool is planned for all of them, so a profile switch
    needs no re-plan. A reload that turns speculation on where the config did not plan
    it takes a hybrid's held rows from the activation headroom instead (a few MiB each)
    and refuses the MTP head (its pool layer is missing)."""
    return [resolve_speculation(cfg.engine, entry, p) for p in (None, *cfg.profiles.values())]


# ---------------------------------------------------------------------- plans


@dataclass(frozen=True)
class ModelPlan:
    """One model's pool as configured on one neuron; all byte figures are per card."""

    model_id: str
    tp: int
    weight_dtype: str  # float_dtype and notes, for the printout
    float_dtype: str  # the weights' and activations' (fp32 | bf16 | fp16)
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
    # Hybrids with the prefix cache on: prefix snapshot slots (fixed_bytes each), out of what
    # the state slots and one full-context request leave (up to kv.prefix_snapshots).
    num_snapshot_slots: int = 0
    # a draft model's share of weight_bytes_per_card and bytes_per_token (its KV in our blocks)
    draft_model_id: str = ""
    draft_weight_bytes: int = 0
    draft_bytes_per_token: int = 0
    mtp_kv_layers: int = 0  # pool layers for the MTP head (where a speculation names mtp)
    spec_k: int = 0  # the most drafts a verification row checks, of every speculation it runs
    # engine.cuda_graphs: decode batches 1..graph_rows captured at load; their pool (estimate)
    graph_rows: int = 0
    graph_pool_bytes: int = 0
    graphs_off: str = ""  # why engine.cuda_graphs captures nothing (memory.cuda_graph_plan)
    # tp > 1 on CUDA: the fused all-reduce's workspace, in the headroom too (cuda_comm.py)
    allreduce_rows: int = 0
    allreduce_workspace_bytes: int = 0
    headroom_bytes: int = 0
    vision_peak_bytes: int = 0  # in the headroom: the tower's activations + embedding cache
    # kv.host_cache_mb: the prefix cache's host tier, per card (host memory, not the pool's
    # budget): blocks and snapshots in the pool's own mix (budget.host_tier_size).
    host_bytes_per_card: int = 0
    host_blocks: int = 0
    host_snapshots: int = 0
    activation: ActivationNeed | None = None  # CUDA: the headroom's terms (step_memory.py)


def _key(cfg: NeuronConfig, entry: ModelEntry, field: str) -> str:
    i = next((i for i, m in enumerate(cfg.models) if m is entry or m.id == entry.id), None)
    return f"models[{i}].{field}" if i is not None else f"models.{entry.id}.{field}"


def plan_model(cfg: NeuronConfig, entry: ModelEntry, config_file: str | Path, *,
               kv_dtype: str | None = None, device_memory_mb: int | None = None,
               step_ceilings: tuple[int, int] | None = None) -> ModelPlan:
    """Plan one catalogue entry; raises PlanError (with the arithmetic) if it cannot work.

    `kv_dtype` overrides the configured one (profile, then [kv]);
    `device_memory_mb` overrides server.device_memory_mb (a live device's size);
    `step_ceilings` the decode rows and step tokens the runner is built for (a resident
    model's, widened by a switch: helexa/neuron/profile_switch.py; NeuronConfig's by default).
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
    mmproj = None  # a GGUF model's vision tower: llama.cpp's mmproj file beside it
    try:
        raw = read_config(gguf) if gguf is not None else json.loads(cfg_path.read_text())
        mmproj = find_mmproj(gguf) if gguf is not None else None
        shape = read_model_shape(raw)
        text_only = mmproj is None if gguf is not None else not tower_loads(cfg_path.parent)
        if shape.vision is not None and text_only:
            shape = replace(shape, vision=None)  # it loads text only: no tower to hold
    except GgufError as e:  # an mmproj that does not fit names its file and field
        raise PlanError(f"{where('path')}: {e}") from None
    except FileNotFoundError:
        field = "config" if entry.config is not None else "path"
        raise PlanError(f"{where(field)}: expected a model config.json, no file {cfg_path}") from None
    except (KeyError, ValueError, TypeError) as e:
        raise PlanError(f"{where('config')}: {cfg_path}: unreadable model config ({e!r})") from None
    if entry.path is not None:  # tensors to count (planning from config.json alone: none)
        try:
            why = missing_layers(shape.num_layers, gguf,
                                 Path(resolve_path(config_file, entry.path)))
        except (GgufError, ValueError, OSError) as e:
            raise PlanError(f"{where('path')}: {e}") from None
        if why:
            raise PlanError(f"{where('path')}: {why}")
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
    if gguf is not None:  # each tensor on its op (helexa/checkpoint/gguf_layout.py)
        if entry.quantize != "none":
            raise PlanError(f"{where('quantize')}: expected \"none\" for a GGUF file, which "
                            f"keeps its own quantisation, got {entry.quantize!r}")
        try:
            weights = gguf_weight_bytes_per_card(gguf, raw, tp, ELT_BYTES[dtype_name(weight_dtype)])
        except (GgufError, KeyError) as e:
            raise PlanError(f"{where('path')}: {gguf}: {e}") from None
        types = type_summary(gguf)
        weight_dtype += f", GGUF {types}"
        if measures_activations(gguf, raw, entry.dtype, cfg.devices_of(entry)):
            weight_dtype += "; on CPU the neuron runs fp32 or bf16 as it measures at load"
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
    encoder = cache = 0  # the tower's activations, its embedding cache (vision_shape.py)
    if shape.vision is not None:  # in the weights above, float: say how much of them
        split, whole = shape.vision.param_split(tp)
        elt = ELT_BYTES[dtype_name(float_dtype)]
        tower = (math.ceil(split / tp) + whole) * elt
        if mmproj is not None:  # not in the GGUF's bytes above: loaded float from its file
            weights += tower
        weight_dtype += f"; vision tower {format_bytes(tower)}" + (
            f" from {mmproj.name}" if mmproj is not None else "")
        patches = max_image_patches(gguf or cfg_path.parent, shape.vision)
        encoder, cache = (shape.vision.encoder_activation_bytes(patches, tp, elt),
                          shape.vision.embedding_cache_bytes(patches, elt))
    specs = speculations(cfg, entry)
    # pool layers for the MTP head where a speculation drafts with it (else "mtp" is refused)
    mtp_layers = shape.mtp_layers if any(s.method == "mtp" for s in specs) else 0
    per_token = kv_bytes_per_token(shape, tp, kv, mtp_layers)
    draft_id = specs[0].draft_model  # a draft model is per model: never a profile's
    draft_weights = draft_per_token = 0
    if draft_id:  # its weights and KV come out of the same card (tp = 1)
        draft_weights, draft_per_token = draft_costs(cfg, config_file, draft_id, kv,
                                                     float_dtype, where)
        weights += draft_weights
        per_token += draft_per_token
        weight_dtype += f"; + draft {draft_id} {format_bytes(draft_weights)}"

    device_mb = device_memory_mb or cfg.server.device_memory_mb
    # the tower's activations go before the text model's; the embedding cache stays
    headroom = max(cfg.kv.activation_headroom_mb * MIB, encoder) + cache
    within = " within it" if headroom - cache > encoder else ""
    headroom_text = f"{math.ceil(headroom / MIB):,} MiB headroom" + (
        f" (the vision encoder's {math.ceil(encoder / MIB):,} MiB{within}, and its embedding"
        f" cache's {math.ceil(cache / MIB):,} MiB)" if encoder else "")
    budget_mb = entry.kv_budget_mb or cfg.kv.kv_budget_mb
    budget_key = "kv_budget_mb" if entry.kv_budget_mb else "kv.kv_budget_mb"
    if budget_mb is not None:
        budget = budget_mb * MIB
        source = f"{budget_mb:,} MiB kv_budget_mb"
        if device_mb and weights + budget + headroom > device_mb * MIB:
            raise PlanError(
                f"{where(budget_key)}: expected weights + KV + headroom within {device_mb:,} MiB "
                f"per card, got {weights / MIB:,.0f} + {budget_mb:,} + {headroom_text}")
    elif device_mb:
        usable = int(device_mb * MIB * cfg.kv.memory_fraction)
        budget = usable - weights - headroom
        source = (f"{device_mb:,} MiB × {cfg.kv.memory_fraction} − {weights / MIB:,.0f} MiB weights "
                  f"− {headroom_text}")
        if budget < bs * per_token + fixed:
            raise PlanError(f"{where('tp')}: expected the weights to leave room for KV: {source} = "
                            f"{budget / MIB:,.0f} MiB, less than one block")
    else:
        raise UnknownBudget(f"{where('kv_budget_mb')}: expected kv_budget_mb (the model's or "
                            f"kv.kv_budget_mb) or server.device_memory_mb to plan `{entry.id}` "
                            "without a device")

    block_bytes = bs * per_token
    num_blocks = budget // block_bytes
    pool_tokens = num_blocks * bs
    positions = max_positions(raw)
    spec_k = max((s.spec_k for s in specs if s.method != "off"), default=0)
    held = held_bytes_per_request(shape, tp, spec_k, float_dtype)
    slot = fixed + held  # what one request's state slot takes from the budget
    single = tokens_each(budget, 1, block_bytes, bs, slot)
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
        if fixed and cfg.kv.prefix_cache:  # a hybrid's prefix snapshots first, at most 1/8
            snapshot_room = min(cfg.kv.prefix_snapshots, budget // 8 // fixed) * fixed
            single = tokens_each(budget - snapshot_room, 1, block_bytes, bs, slot)
        context = (min(positions, single) if positions else single) // bs * bs
        if context < 2:
            raise PlanError(f"{where(budget_key)}: expected room for at least one block, "
                            f"got {budget / MIB:,.1f} MiB for {block_bytes:,} B blocks")
    if (entry.max_output_tokens or 0) > context - 1:  # it would be advertised cut, silently
        room = f"one request's room in the pool {single:,} tokens ({source})"
        why = (f"{_key(cfg, entry, 'context')} = {context:,}" if entry.context is not None else
               f"context {context:,} = " + (f"min({room}, model positions {positions:,})"
                                            if positions else room) + f" in blocks of {bs}")
        raise PlanError(f"{where('max_output_tokens')}: expected at most context - 1 = "
                        f"{context - 1:,} ({why}), got {entry.max_output_tokens:,}")
    output = entry.max_output_tokens or context - 1
    trade = [(n, min(context, tokens_each(budget, n, block_bytes, bs, slot)))
             for n in TRADE_SESSIONS]
    plan = ModelPlan(
        model_id=entry.id, tp=tp, weight_dtype=weight_dtype, float_dtype=float_dtype, kv_dtype=kv,
        weight_bytes_per_card=weights, bytes_per_token=per_token, fixed_bytes=fixed,
        block_size=bs, kv_budget_bytes=budget, num_blocks=num_blocks, pool_tokens=pool_tokens,
        max_position_embeddings=positions, context=context, input=context - 1, output=output,
        trade=trade, budget_source=source, shape=shape, held_bytes=held,
        draft_model_id=draft_id, draft_weight_bytes=draft_weights,
        draft_bytes_per_token=draft_per_token, mtp_kv_layers=mtp_layers, spec_k=spec_k)
    blocks, slots = state_slots(plan, cfg.admission.max_in_flight)
    if fixed and cfg.kv.prefix_cache:
        # prefix snapshots come after the state slots: what is left beside them and one
        # request of `context` tokens, up to kv.prefix_snapshots
        room = budget - math.ceil(context / bs) * block_bytes - slots * slot
        plan = replace(plan, num_snapshot_slots=max(0, min(cfg.kv.prefix_snapshots, room // fixed)))
        blocks, slots = state_slots(plan, cfg.admission.max_in_flight)
    # graphs for every profile's batches (a switch needs no reload) and a step of its own
    # profile's tokens: NeuronConfig.step_ceilings, what the runner is built for
    max_slots, max_tokens = step_ceilings or cfg.step_ceilings(entry.profile or "")
    devices = cfg.devices_of(entry)
    ar_rows, ar_bytes = fused_allreduce_plan(shape, tp, max_slots, devices)
    host_bytes = cfg.kv.host_cache_mb * MIB // tp if cfg.kv.prefix_cache and (
        not fixed or plan.num_snapshot_slots) else 0
    host_blocks, host_snaps = host_tier_size(host_bytes, blocks, block_bytes,
                                             plan.num_snapshot_slots, fixed)
    graph_rows, graphs_off, graphs = cuda_graph_plan(shape, tp, max_slots * cfg.engine.cuda_graphs,
                                                     kv, float_dtype, plan.num_blocks, devices)
    need = None
    if on_cuda(devices):  # what the headroom holds beside the weights and KV (step_memory.py)
        need = activation_need(
            shape, tp, ELT_BYTES[dtype_name(float_dtype)], tokens=max_tokens,
            logits_rows=max_slots * (1 + spec_k), sequences=max_slots, encoder=encoder, cache=cache,
            positions=rope_positions(shape, positions, context, cfg.engine.cuda_graphs),
            graphs=graphs, allreduce=ar_bytes, flashinfer_pool=not torch_path_kv(kv, float_dtype))
        # a verdict, not a refusal: the load measures a worst-case step on every card and
        # sizes the pool to what is left, the planned pool its ceiling (pool_probe.py)
    return replace(plan, num_state_slots=slots, blocks_beside_state=blocks, graphs_off=graphs_off,
                   graph_rows=graph_rows, headroom_bytes=headroom, graph_pool_bytes=graphs,
                   vision_peak_bytes=encoder + cache, allreduce_rows=ar_rows,
                   allreduce_workspace_bytes=ar_bytes, host_blocks=host_blocks,
                   host_bytes_per_card=host_bytes if host_blocks else 0, host_snapshots=host_snaps,
                   activation=need)


def check_neuron_config(path: str | Path, cfg: NeuronConfig) -> list[ModelPlan]:
    """Plan every model of a neuron config; raises PlanError on the first that cannot work.

    A profile that switches the KV dtype re-plans the pool at runtime, so
    each model is also planned under every such profile. A model on CUDA cards with
    neither kv_budget_mb nor device_memory_mb is skipped here (the neuron asks the cards);
    on a CPU nothing can tell, so UnknownBudget is raised as the load would.
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
            if not on_cuda(cfg.devices_of(entry)):
                raise
    return plans


