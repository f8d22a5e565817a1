"""The engine serving hybrid (Gated DeltaNet) and MoE models: state slots reserved with
the KV tokens and returned exactly once, outputs independent of batch-mates and of the
prefix cache, and the same pool figures as helexa plan."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from support.engine import assert_whole, drive

from helexa.config.schema import load_neuron_config
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.plan import plan_model, state_slots

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = m.SamplingParams(temperature=0.0)
REPO = Path(__file__).resolve().parents[3]


def core_for(model_dir: Path, *, prefix_cache: bool = True, num_blocks: int = 160,
             **limits) -> EngineCore:
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=num_blocks,
                      block_size=8, context=512, prefix_cache=prefix_cache, bytes_per_token=0,
                      limits=m.Limits(anon_max_in_flight=64, **limits))
    return EngineCore(spec)


def new(rid: str, prompt: list[int], max_tokens: int = 12) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY)


def test_pool_reserves_a_state_slot_with_the_blocks_and_returns_it_once():
    pool = BlockPool(4, 2, bytes_per_block=10, num_state_slots=2, fixed_bytes=100)
    led = pool.ledger()
    assert (led.total_bytes, led.free_bytes, led.fixed_bytes_per_request) == (240, 240, 100)
    assert pool.reserve("a", 1) and pool.state_slot("a") == 0
    assert pool.ledger().reserved_bytes == 110  # a block and a slot, neither written yet
    pool.draw("a")
    led = pool.ledger()
    assert (led.reserved_bytes, led.used_bytes, led.state_free_bytes) == (0, 110, 100)
    assert pool.reserve("b", 1) and pool.state_slot("b") == 1
    assert not pool.can_reserve(1) and not pool.reserve("c", 1)  # blocks left, no slot
    assert pool.release("a") and not pool.release("a")
    assert pool.state_slot("a") == -1 and pool.reserve("c", 1) and pool.state_slot("c") == 0
    pool.check()
    pool.release("b")
    pool.release("c")
    assert pool.ledger().free_bytes == 240
    pool.check()


def test_storm_half_abandoned_leaves_kv_and_state_whole(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    core = core_for(model_dir, max_in_flight=12, max_slots=8, max_batched_tokens=64,
                    prefill_chunk_tokens=16, max_queue_depth=64, max_per_principal=64)
    assert core.pool.num_state_slots == 12 and core.pool.fixed_bytes > 0
    rng = random.Random(4)
    requests = [new(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))],
                    rng.randrange(4, 24)) for i in range(64)]
    abandon = {r.req_id for r in requests[::2]}
    streamed: dict[str, int] = {}
    finished: dict[str, m.FinishReason] = {}
    inbound: m.ToEngine | None = m.ToEngine(new=requests)
    for _ in range(20_000):
        out = core.step(inbound)
        inbound = m.ToEngine()
        for u in out.updates:
            assert u.refused_code is None, u
            streamed[u.req_id] = streamed.get(u.req_id, 0) + len(u.new_token_ids)
            if u.finished is not None:
                finished[u.req_id] = u.finished
            elif u.req_id in abandon and streamed[u.req_id] >= 2:  # mid-stream: caller gone
                inbound.aborts.append(m.Abort(req_id=u.req_id))
        core.pool.check()
        led = core.pool.ledger()
        assert led.free_bytes + led.reserved_bytes + led.used_bytes == led.total_bytes
        held = core.pool.num_state_slots - core.pool.num_free_state_slots
        assert held == core.admission.num_in_flight <= 12
        if not core.has_work and not inbound.aborts:
            break
    assert len(finished) == 64
    aborted = {r for r, why in finished.items() if why == m.FinishReason.ABORT}
    assert aborted and aborted <= abandon
    assert all(why == m.FinishReason.LENGTH for r, why in finished.items() if r not in abandon)
    assert_whole(core, hybrid=True)


def test_outputs_do_not_depend_on_batch_mates_or_recycled_slots(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_next")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(5 + 6 * i)] for i in range(6)]
    solo = []
    core = core_for(model_dir, max_in_flight=2, max_slots=1)
    for i, p in enumerate(prompts):  # one at a time: every slot is reused by later requests
        tokens = drive(core, m.ToEngine(new=[new(f"s{i}", p)])).tokens
        solo.append(tokens[f"s{i}"])
    core = core_for(model_dir, max_in_flight=6, max_slots=6, max_batched_tokens=24,
                    prefill_chunk_tokens=7)
    tokens = drive(core, m.ToEngine(new=[new(f"b{i}", p) for i, p in enumerate(prompts)])).tokens
    assert [tokens[f"b{i}"] for i in range(6)] == solo
    assert_whole(core, hybrid=True)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_moe"])
def test_same_long_prompt_twice_same_tokens_with_prefix_cache_on(tiny_checkpoint, arch):
    model_dir = tiny_checkpoint(arch)
    core = core_for(model_dir, prefix_cache=True)
    prompt = [random.Random(9).randrange(3, 500) for _ in range(100)]
    first = drive(core, m.ToEngine(new=[new("one", prompt, 24)])).tokens
    second, _, admitted, _ = drive(core, m.ToEngine(new=[new("two", prompt, 24)]))
    assert second["two"] == first["one"] and len(first["one"]) == 24
    hybrid = arch != "qwen3_moe"
    # Both reuse the cached blocks: a hybrid from the snapshot of its linear-attention state
    # at the first prompt's last full block (test_hybrid_prefix.py), a pure-attention MoE
    # model up to the last full block before the prompt's last token.
    assert core.spec.prefix_cache
    assert admitted["two"].cached_tokens == 96
    if hybrid:
        assert_whole(core, hybrid=True)


def test_plan_and_running_engine_agree_on_beasts_pool(tiny_checkpoint, tmp_path):
    # asset/neuron/beast.toml with its model swapped for a tiny checkpoint of the same
    # family and layout (Qwen3.5, multimodal wrapper, bf16), at its tp = 2.
    model_dir = tiny_checkpoint("qwen3_5", dtype="bfloat16")
    text = (REPO / "asset/neuron/beast.toml").read_text()
    swaps = [('path = "/srv/models/Qwen/Qwen3.5-27B"', f'path = "{model_dir}"'),
             ('config = "../models/Qwen/Qwen3.5-27B/config.json"\n', ""),
             ("context = 131072", "context = 1024"),
             ("max_output_tokens = 32768", "max_output_tokens = 512"),
             ('devices = ["cuda:0", "cuda:1"]', 'devices = ["cpu", "cpu"]')]
    for old, new in swaps:  # each must match: a missed one would test another config
        assert old in text, old
        text = text.replace(old, new)
    # every pool 2 MiB (a missed swap once planned the real 4,270 MiB pool on the CPU)
    text, n = re.subn(r"^kv_budget_mb = \d+$", "kv_budget_mb = 2", text, flags=re.M)
    assert n >= 1
    path = tmp_path / "beast.toml"
    path.write_text(text)
    cfg = load_neuron_config(path)
    entry = cfg.models[0]
    plan = plan_model(cfg, entry, path)
    assert plan.fixed_bytes > 0 and plan.tp == 2
    num_blocks, slots = state_slots(plan, cfg.admission.max_in_flight)
    assert slots == cfg.admission.max_in_flight
    assert num_blocks * plan.block_size * plan.bytes_per_token + slots * plan.fixed_bytes \
        <= plan.kv_budget_bytes == 2 << 20
    spec = EngineSpec(model_id=entry.id, model_dir=str(model_dir), devices=["cpu", "cpu"],
                      dtype="bf16", tp=2, num_blocks=num_blocks, block_size=plan.block_size,
                      bytes_per_token=plan.bytes_per_token, context=plan.context,
                      num_state_slots=slots, fixed_bytes=plan.fixed_bytes)
    core = EngineCore(spec)
    try:
        led = core.status().kv
        assert led.bytes_per_token == plan.bytes_per_token
        assert led.fixed_bytes_per_request == plan.fixed_bytes
        assert core.runner.fixed_bytes_per_request == plan.fixed_bytes
        assert core.runner.kv_bytes_per_block == plan.block_size * plan.bytes_per_token
        assert led.state_total_bytes == slots * plan.fixed_bytes
    finally:
        core.close()


def test_a_plan_the_runner_contradicts_fails_the_load(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=16, block_size=8,
                      context=128, fixed_bytes=12345, num_state_slots=2)
    with pytest.raises(ValueError, match="plan counts 12345 fixed bytes per request"):
        EngineCore(spec)


def test_kv_dtype_switch_keeps_the_state_slots_and_the_outputs(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5")
    core = core_for(model_dir, max_in_flight=3)
    prompt = [random.Random(2).randrange(3, 500) for _ in range(30)]
    before = drive(core, m.ToEngine(new=[new("a", prompt)])).tokens
    slots, fixed = core.pool.num_state_slots, core.pool.fixed_bytes
    assert core.reset_kv(m.ResetKv(num_blocks=100, kv_dtype="fp32", bytes_per_token=0,
                                   context=512)) == "ok"
    assert (core.pool.num_blocks, core.pool.num_state_slots, core.pool.fixed_bytes) == (
        100, slots, fixed)
    after = drive(core, m.ToEngine(new=[new("b", prompt)])).tokens
    assert after["b"] == before["a"]
    assert_whole(core, hybrid=True)


def test_a_profiles_max_in_flight_carves_the_state_slots_anew(tiny_checkpoint):
    """A hybrid holds one state slot a request in flight, carved at load: a profile that
    allows more in flight re-plans the pool with that many slots (same kv dtype), and as
    many requests then run at once, each the tokens it has alone; nothing leaked."""
    core = core_for(tiny_checkpoint("qwen3_5"), max_in_flight=2)
    assert (core.pool.num_state_slots, core.runner.num_state_slots) == (2, 2)
    prompts = {f"r{i}": [random.Random(i).randrange(3, 500) for _ in range(20)]
               for i in range(4)}
    alone = {rid: drive(core, m.ToEngine(new=[new(rid, p, 6)])).tokens[rid]
             for rid, p in prompts.items()}
    assert core.reset_kv(m.ResetKv(num_blocks=100, kv_dtype=core.runner.kv_dtype,
                                   bytes_per_token=0, context=512, num_state_slots=4)) == "ok"
    assert (core.pool.num_state_slots, core.runner.num_state_slots) == (4, 4)
    assert core.spec.num_state_slots == 4 and core.pool.num_blocks == 100
    out = core.step(m.ToEngine(limits=m.Limits(anon_max_in_flight=64, max_in_flight=4),
                               new=[new(rid, p, 6) for rid, p in prompts.items()]))
    assert {u.req_id for u in out.updates if u.admitted} == set(prompts)  # all four at once
    got = drive(core).tokens
    for rid, toks in alone.items():
        first = [t for u in out.updates if u.req_id == rid for t in u.new_token_ids]
        assert first + got[rid] == toks, rid
    assert_whole(core, hybrid=True)


def test_a_kv_switch_that_fails_leaves_the_old_pool_serving(tiny_checkpoint, monkeypatch):
    """A kv_dtype switch whose new pool cannot be made (the device's memory, say) makes the
    pool it had again, graphs and state slots included: the engine answers why the
    switch failed and serves on, the same tokens as before, nothing leaked."""
    import torch

    core = core_for(tiny_checkpoint("qwen3_5"), max_in_flight=3)
    prompt = [random.Random(3).randrange(3, 500) for _ in range(30)]
    before = drive(core, m.ToEngine(new=[new("a", prompt)])).tokens
    runner, blocks, dtype = core.runner, core.runner.num_blocks, core.runner.kv_dtype
    real = runner._reset_own_kv

    def no_room(num_blocks: int, kv_dtype: str) -> None:
        real(num_blocks, kv_dtype)
        if kv_dtype == "int8":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(runner, "_reset_own_kv", no_room)
    answer = core.reset_kv(m.ResetKv(num_blocks=300, kv_dtype="int8", bytes_per_token=0,
                                     context=512))
    assert answer == ("re-planning the pool failed: OutOfMemoryError: CUDA out of memory "
                      "(simulated)")
    assert (runner.num_blocks, runner.kv_dtype, core.pool.num_blocks) == (blocks, dtype, blocks)
    assert runner.kv_pools and all(p.k_cache.shape[0] == blocks and p.kv_dtype == dtype
                                   for p in runner.kv_pools)
    after = drive(core, m.ToEngine(new=[new("b", prompt)])).tokens
    assert after["b"] == before["a"]
    assert_whole(core, hybrid=True)


def test_a_kv_switch_on_a_measured_device_sizes_the_pool_by_measurement(tiny_checkpoint,
                                                                        monkeypatch):
    """Where the load measured the pool (CUDA, tp 1), a kv_dtype switch measures again, the
    plan's count its ceiling and the switch's context the request it must hold, and the
    engine's pool and ledger take the measured count, not the plan's."""
    from helexa.neuron.engine import pool_probe

    core = core_for(tiny_checkpoint("qwen3_5"), max_in_flight=3)
    asked: list[tuple[int, str, int]] = []

    def measured(runner, planned: int, kv_dtype: str, context: int) -> int:
        asked.append((planned, kv_dtype, context))
        return planned // 2

    monkeypatch.setattr(pool_probe, "measured_blocks", measured)
    core.runner.measure_pool = True  # as on CUDA at tp 1
    assert core.reset_kv(m.ResetKv(num_blocks=200, kv_dtype="fp16", bytes_per_token=0,
                                   context=512)) == "ok"
    assert asked == [(200, "fp16", 512)]
    assert core.runner.num_blocks == core.pool.num_blocks == core.spec.num_blocks == 100
    prompt = [random.Random(4).randrange(3, 500) for _ in range(20)]
    drive(core, m.ToEngine(new=[new("c", prompt)]))
    assert_whole(core, hybrid=True)
