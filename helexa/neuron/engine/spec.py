"""EngineSpec: everything an engine process needs to start, as one msgspec struct.

The daemon builds it from the neuron config and the model's plan (KV
arithmetic from helexa.plan) and hands it to the spawned engine process, so
the engine never reads TOML. `limits` are the runtime knobs the config sets
(`limits_from_config`); a reload or a profile switch sends the whole set again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from helexa.config.schema import (
    ModelEntry,
    NeuronConfig,
    ProfileConfig,
    Speculation,
    resolve_speculation,
)
from helexa.neuron.engine import messages

if TYPE_CHECKING:
    from helexa.neuron.engine.runner import Runner


def limits_from_config(cfg: NeuronConfig, profile: ProfileConfig | None = None,
                       entry: ModelEntry | None = None) -> messages.Limits:
    """Every runtime knob of a model from a helexa.config.schema.NeuronConfig: each Limits
    field from the [admission], [kv] or [engine] key of its name, its profile's where that
    overrides it, and the speculation that applies (resolve_speculation: [engine] < the
    model's [[models]] entry < its profile; docs/speculation.md)."""
    keys = set(messages.Limits.__struct_fields__) - set(Speculation.__struct_fields__)
    values: dict[str, Any] = {}
    for section in (cfg.admission, cfg.kv, cfg.engine):
        values.update({k: v for k, v in msgspec.structs.asdict(section).items() if k in keys})
    if profile is not None:
        values.update({k: v for k, v in msgspec.structs.asdict(profile).items()
                       if k in keys and v is not None})
    speculation = resolve_speculation(cfg.engine, entry, profile)
    return messages.Limits(**values, **msgspec.structs.asdict(speculation))


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    model_dir: str = ""
    devices: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    devices_key: str = "server.devices"  # the config key that names them, for messages
    dtype: str = "auto"  # weights: auto | fp32 | fp16 | bf16
    tp: int = 1
    num_blocks: int
    block_size: int = 16
    kv_dtype: str = "auto"
    bytes_per_token: int = 0  # per card, from helexa.plan (0 when unknown: ledger in blocks only)
    context: int  # most prompt + output tokens of one request
    max_output_tokens: int | None = None  # advertised output cap (None = context - 1)
    prefix_cache: bool = True  # hybrid models: only with snapshot slots (see check_pool)
    prefix_sharing: str = "principal"  # kv.prefix_sharing: principal | global
    # Hybrid models: per-request linear-attention state slots and their bytes per card
    # (helexa.plan's fixed_bytes); 0 = plan did not say (the runner's own figure is used).
    num_state_slots: int = 0
    fixed_bytes: int = 0
    # Hybrid models' prefix snapshots (snapshot_pool.py): slots of fixed_bytes each beside the
    # state slots (None: two per state slot), and their spacing inside a long prompt.
    num_snapshot_slots: int | None = None
    prefix_checkpoint_tokens: int = 4096
    # kv.host_cache_mb: host memory for the prefix cache's host tier, the whole model's
    # (each tensor-parallel rank keeps 1/tp of it); 0 = none (host_tier.py).
    host_cache_mb: int = 0
    torch_threads: int | None = None
    attention_backend: str = "auto"  # helexa/kernels/backends/__init__.py
    cuda_graphs: bool = True
    quantize: str = "none"  # helexa/neuron/formats/quantise.py: none | int8 | int4
    quant_group_size: int = 128
    # Pool layers for the checkpoint's MTP head as the plan counted them (helexa.plan:
    # its config.json's mtp_num_hidden_layers); None = the checkpoint's own config.json.
    mtp_kv_layers: int | None = None
    limits: messages.Limits = messages.Limits()
    # what the runner is built for at load, the most of any profile (NeuronConfig
    # step_ceilings): decode rows (graphs captured, state rows) and a step's tokens (the
    # pool measured beside such a step); 0 = the limits'
    max_slots_ceiling: int = 0
    max_batched_tokens_ceiling: int = 0
    # the most drafts a verification row checks, of every speculation the model may run
    # (helexa plan's spec_k): the pool is measured beside such a step's logits too
    spec_k_ceiling: int = 0
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

    @property
    def snapshot_every_tokens(self) -> int:
        """prefix_checkpoint_tokens rounded down to whole blocks (at least one)."""
        return max(self.block_size, self.prefix_checkpoint_tokens // self.block_size
                   * self.block_size)

    def snapshot_slots(self, num_state_slots: int) -> int:
        """The snapshot slots a hybrid model's runner carves (0 with the prefix cache off)."""
        if not self.prefix_cache:
            return 0
        if self.num_snapshot_slots is None:
            return 2 * num_state_slots
        return self.num_snapshot_slots


def check_pool(spec: EngineSpec, runner: Runner) -> EngineSpec:
    """The spec as the engine runs it, after checking the runner holds the linear-attention
    state the plan counted (KV bytes per block are the runner's own check, memory_plan.py).

    Plan and runner must agree on a hybrid model's fixed bytes per request, else the
    ledger would report memory that is not there: the load fails, naming both figures.
    A cached full-attention prefix is useless to a hybrid model without the
    linear-attention state at the same position: it serves with the prefix cache on
    only where its runner holds snapshot slots (docs/architecture.md, "Hybrid models").
    """
    fixed = runner.fixed_bytes_per_request
    if not fixed:
        return msgspec.structs.replace(spec, num_snapshot_slots=0)
    if spec.fixed_bytes and spec.fixed_bytes != fixed:
        raise ValueError(f"{spec.model_id}: the plan counts {spec.fixed_bytes} fixed bytes per "
                         f"request, the model runner holds {fixed}")
    snaps = getattr(runner, "num_snapshot_slots", 0)
    return msgspec.structs.replace(spec, prefix_cache=spec.prefix_cache and snaps > 0,
                                   fixed_bytes=fixed, num_state_slots=runner.num_state_slots,
                                   num_snapshot_slots=snaps if spec.prefix_cache else 0)
