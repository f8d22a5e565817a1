"""EngineSpec: everything an engine process needs to start, as one msgspec struct.

The daemon builds it from the neuron config and the model's plan (KV
arithmetic from helexa.plan) and hands it to the spawned engine process, so
the engine never reads TOML. `limits` are the knobs the config sets, over
DEFAULT_LIMITS (`full_limits` gives a `Limits` with every knob set); runtime
changes arrive later as partial `SetLimits` and are merged with `merge_limits`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from helexa.config.schema import ModelEntry, NeuronConfig, ProfileConfig
from helexa.neuron.engine import messages

AnyLimits = TypeVar("AnyLimits", messages.Limits, messages.SetLimits)


def merge_limits(current: AnyLimits, update: messages.SetLimits | None) -> AnyLimits:
    """`current` with every knob that `update` sets replaced."""
    if update is None:
        return current
    changed = {f: v for f in update.__struct_fields__ if (v := getattr(update, f)) is not None}
    return msgspec.structs.replace(current, **changed)


_SPEC_FIELDS = ("speculation", "spec_k", "spec_full_below", "spec_off_above",
                "spec_min_acceptance", "spec_keep_acceptance")


def _speculation_of(section: Any) -> dict[str, Any]:
    """The speculation settings an [engine] section or a [[models]] entry holds."""
    return {name: getattr(section, name) for name in _SPEC_FIELDS}


def limits_from_config(cfg: NeuronConfig, profile: ProfileConfig | None = None,
                       entry: ModelEntry | None = None) -> messages.SetLimits:
    """All runtime knobs from a helexa.config.schema.NeuronConfig: [admission], [kv], [engine], then
    the model's own [[models]] speculation settings, then its profile (docs/speculation.md)."""
    adm, kv, eng = cfg.admission, cfg.kv, cfg.engine
    limits = messages.SetLimits(
        max_in_flight=adm.max_in_flight,
        max_queue_depth=adm.max_queue_depth,
        max_per_principal=adm.max_per_principal,
        anon_max_in_flight=adm.anon_max_in_flight,
        kv_max_wait_secs=adm.kv_max_wait_secs,
        max_slots=eng.max_slots,
        max_batched_tokens=eng.max_batched_tokens,
        prefill_chunk_tokens=eng.prefill_chunk_tokens,
        default_output_tokens=kv.default_output_tokens,
        **_speculation_of(eng),
    )
    if entry is not None:
        limits = merge_limits(limits, messages.SetLimits(**_speculation_of(entry)))
    if profile is not None:
        limits = merge_limits(limits, messages.SetLimits(
            max_in_flight=profile.max_in_flight,
            max_slots=profile.max_slots,
            max_batched_tokens=profile.max_batched_tokens,
            default_output_tokens=profile.default_output_tokens,
            speculation=profile.speculation,
            spec_k=profile.spec_k,
        ))
    return limits


# Every knob at helexa.config.schema's defaults ([admission], [kv], [engine]).
DEFAULT_LIMITS = msgspec.convert(msgspec.to_builtins(limits_from_config(NeuronConfig())),
                                 messages.Limits)


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    model_dir: str = ""
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    dtype: str = "auto"  # weights: auto | fp32 | fp16 | bf16
    tp: int = 1
    num_blocks: int
    block_size: int = 16
    kv_dtype: str = "auto"
    bytes_per_token: int = 0  # per card, from helexa.plan (0 when unknown: ledger in blocks only)
    context: int  # most prompt + output tokens of one request
    max_output_tokens: int | None = None  # advertised output cap (None = context - 1)
    prefix_cache: bool = True  # forced off for hybrid models (see check_pool)
    # Hybrid models: per-request linear-attention state slots and their bytes per card
    # (helexa.plan's fixed_bytes); 0 = plan did not say (the runner's own figure is used).
    num_state_slots: int = 0
    fixed_bytes: int = 0
    torch_threads: int | None = None
    attention_backend: str = "auto"  # helexa/kernels/backends/__init__.py
    cuda_graphs: bool = True
    quantize: str = "none"  # helexa/neuron/formats/quantise.py: none | int8 | int4
    quant_group_size: int = 128
    # Pool layers for the checkpoint's MTP head as the plan counted them (helexa.plan:
    # its config.json's mtp_num_hidden_layers); None = the checkpoint's own config.json.
    mtp_kv_layers: int | None = None
    limits: messages.SetLimits = messages.SetLimits()  # over DEFAULT_LIMITS (full_limits)
    # speculation = "draft:<id>" (docs/speculation.md): the draft checkpoint, loaded with the
    # model; its KV's share of bytes_per_token (its layers share each request's blocks).
    draft_model_id: str = ""
    draft_model_dir: str = ""
    draft_bytes_per_token: int = 0

    @property
    def device(self) -> str:
        return self.devices[0] if self.devices else "cpu"

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


def full_limits(partial: messages.SetLimits | None = None) -> messages.Limits:
    """DEFAULT_LIMITS overlaid with `partial`: every knob set."""
    return merge_limits(DEFAULT_LIMITS, partial)


def check_pool(spec: EngineSpec, runner: Any) -> EngineSpec:
    """The spec as the engine runs it, after checking the runner holds the linear-attention
    state the plan counted (KV bytes per block are the runner's own check, memory_plan.py).

    Plan and runner must agree on a hybrid model's fixed bytes per request, else the
    ledger would report memory that is not there: the load fails, naming both figures.
    A hybrid model serves with the prefix cache off: a cached full-attention prefix is
    useless without the linear-attention state at the same position, which the pool
    does not snapshot (docs/architecture.md, "Hybrid models").
    """
    fixed = int(getattr(runner, "fixed_bytes_per_request", 0) or 0)
    if not fixed:
        return spec
    if spec.fixed_bytes and spec.fixed_bytes != fixed:
        raise ValueError(f"{spec.model_id}: the plan counts {spec.fixed_bytes} fixed bytes per "
                         f"request, the model runner holds {fixed}")
    return msgspec.structs.replace(spec, prefix_cache=False, fixed_bytes=fixed,
                                   num_state_slots=int(runner.num_state_slots))
