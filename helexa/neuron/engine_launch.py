"""Starting a resident model's engine: its EngineSpec, its tokenizer, its process.

`build_spec` turns a model's plan (helexa.plan) and the config in force into
the `EngineSpec` its engine process is started with (helexa/neuron/engine/spec.py),
records the linear-attention state slots the plan carved out of the pool and what
its runner is built for, and holds its limits within them (within_ceilings, as a
reload does: a hybrid's max_in_flight no more than its state slots).
`start_engine` and `load_tokenizer` are what `Residency` uses unless a test
hands it fakes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helexa.config.schema import NeuronConfig
from helexa.neuron.limits import within_ceilings
from helexa.neuron.resident_model import ResidentModel
from helexa.plan import state_slots


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's Tokenizer (helexa/neuron/tokenizer.py)."""
    from helexa.neuron.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def build_spec(cfg: NeuronConfig, r: ResidentModel, model_dir: Path,
               draft_dir: Path | None = None) -> Any:
    """The EngineSpec of a resident model from its plan and the config in force; `draft_dir`
    is the checkpoint of the draft model its plan counts (speculation = "draft:<id>")."""
    from helexa.neuron.engine.spec import EngineSpec

    plan = r.plan
    max_in_flight = r.admission.max_in_flight if r.admission else cfg.admission.max_in_flight
    num_blocks, slots = state_slots(plan, max_in_flight or 1)
    r.num_state_slots = slots
    r.step_ceilings = cfg.step_ceilings(r.profile)
    if r.admission is not None:  # the ceilings a reload applies, at load too: a hybrid runs
        r.admission, _ = within_ceilings(r.admission, r)  # no more than its state slots
    return EngineSpec(
        model_id=r.model_id, model_dir=str(model_dir), devices=r.devices,
        devices_key=cfg.devices_key(r.entry),
        dtype=r.load_entry.dtype, tp=r.entry.tp, num_blocks=num_blocks,
        num_state_slots=slots, fixed_bytes=plan.fixed_bytes,
        block_size=plan.block_size, kv_dtype=plan.kv_dtype,
        bytes_per_token=plan.bytes_per_token, context=plan.context,
        max_output_tokens=plan.output, prefix_cache=cfg.kv.prefix_cache,
        num_snapshot_slots=plan.num_snapshot_slots,
        prefix_checkpoint_tokens=cfg.kv.prefix_checkpoint_tokens,
        prefix_sharing=cfg.kv.prefix_sharing, host_cache_mb=cfg.kv.host_cache_mb,
        torch_threads=cfg.engine.torch_threads, limits=r.admission,
        attention_backend=cfg.engine.attention_backend, cuda_graphs=cfg.engine.cuda_graphs,
        quantize=r.entry.quantize, quant_group_size=r.entry.quant_group_size,
        draft_model_id=plan.draft_model_id, draft_model_dir=str(draft_dir or ""),
        draft_bytes_per_token=plan.draft_bytes_per_token, mtp_kv_layers=plan.mtp_kv_layers,
        max_slots_ceiling=r.step_ceilings[0], max_batched_tokens_ceiling=r.step_ceilings[1],
        spec_k_ceiling=plan.spec_k)


async def start_engine(spec: Any, **callbacks: Any) -> Any:
    """The model's engine process, started and loaded (helexa/neuron/engine/client.py)."""
    from helexa.neuron.engine.client import EngineClient

    return await EngineClient.start(spec, **callbacks)
