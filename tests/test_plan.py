"""`helexa plan` arithmetic: KV bytes per token, fixed bytes, pool, context, trade table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helexa.checkpoint.memory import (
    fixed_bytes_per_request,
    kv_bytes_per_token,
    kv_token_head_bytes,
)
from helexa.checkpoint.shape import read_model_shape
from helexa.cli import main as helexa_main
from helexa.config.schema import load_neuron_config
from helexa.plan import MIB, PlanError, check_neuron_config, plan_model

ASSET = Path(__file__).resolve().parent.parent / "asset"
HYBRID = ASSET / "models" / "Qwen" / "Qwen3.5-27B" / "config.json"
DENSE = ASSET / "models" / "Qwen" / "Qwen3-8B" / "config.json"


def neuron_toml(tmp_path: Path, body: str, name: str = "n.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def plan_of(tmp_path: Path, body: str):
    path = neuron_toml(tmp_path, body)
    cfg = load_neuron_config(path)
    return plan_model(cfg, cfg.models[0], path)


def test_worked_check_hybrid_27b_at_tp2(tmp_path):
    shape = read_model_shape(HYBRID)
    assert (shape.num_layers, shape.full_attention_layers, shape.num_kv_heads, shape.head_dim) == (
        64, 16, 4, 256)
    assert kv_bytes_per_token(shape, 2, "bf16") == 32 * 1024
    p = plan_of(tmp_path, f'[kv]\nkv_budget_mb = 4713\n[[models]]\nid = "h"\nconfig = "{HYBRID}"\ntp = 2\n')
    assert p.bytes_per_token == 32 * 1024 and p.kv_dtype == "bf16"
    assert p.pool_tokens == 150_816  # "about 150,800"
    assert p.num_blocks == 9_426


def test_kv_token_head_bytes_per_dtype():
    assert kv_token_head_bytes("fp32", 128, "bf16") == 512
    assert kv_token_head_bytes("bf16", 128, "fp32") == 256
    assert kv_token_head_bytes("auto", 128, "bfloat16") == 256
    assert kv_token_head_bytes("auto", 128, "float32") == 512
    assert kv_token_head_bytes("fp8_e4m3", 128, "bf16") == 128 + 4  # + fp32 scale
    assert kv_token_head_bytes("int8", 128, "bf16") == 132
    assert kv_token_head_bytes("int4", 128, "bf16") == 64 + 4 * 4  # 4 groups of 32
    assert kv_token_head_bytes("int4", 80, "bf16") == 40 + 4 * 3


def test_kv_heads_replicated_when_tp_exceeds_them():
    shape = read_model_shape(DENSE)  # 8 kv heads, 36 layers, head_dim 128
    per_head = 2 * 36 * 256
    assert kv_bytes_per_token(shape, 1, "bf16") == 8 * per_head
    assert kv_bytes_per_token(shape, 8, "bf16") == 1 * per_head
    assert kv_bytes_per_token(shape, 16, "bf16") == 1 * per_head  # replicated, not halved


def test_full_attention_interval_and_fixed_bytes_of_linear_layers():
    raw = json.loads(HYBRID.read_text())
    text = dict(raw["text_config"])
    del text["layer_types"]  # Qwen3-Next style: only the interval
    shape = read_model_shape(text)
    assert shape.full_attention_layers == 16 and shape.linear_attention_layers == 48
    # per linear layer per card at tp=2: 24 v heads × 128 × 128 recurrent
    # + (2 × 16 × 128 + 48 × 128) / 2 channels × 3 conv window, bf16
    per_layer = (24 * 128 * 128 + 5120 * 3) * 2
    assert fixed_bytes_per_request(shape, 2) == 48 * per_layer
    assert fixed_bytes_per_request(read_model_shape(DENSE), 1) == 0


def test_published_sizes_of_the_dense_8b():
    shape = read_model_shape(DENSE)
    assert 8.1e9 < shape.param_count < 8.3e9  # Qwen3-8B: 8.2 B parameters
    assert shape.torch_dtype == "bf16" and shape.max_position_embeddings == 40960


@pytest.mark.parametrize("cfg, billions", [
    ({"model_type": "mixtral", "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
      "vocab_size": 32000, "num_local_experts": 8}, 46.7),  # Mixtral-8x7B
    ({"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32,
      "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
      "moe_intermediate_size": 768, "num_experts": 128, "vocab_size": 151936}, 30.5),  # 30B-A3B
])
def test_published_sizes_of_moe_models(cfg, billions):
    assert read_model_shape(cfg).param_count / 1e9 == pytest.approx(billions, abs=0.05)


def test_legacy_and_todays_config_read_alike(tiny_checkpoint):
    new = read_model_shape(tiny_checkpoint("qwen3") / "config.json")
    old = read_model_shape(tiny_checkpoint("qwen3", legacy_config=True) / "config.json")
    assert new == old


def test_advertised_limits_and_trade_table(tmp_path):
    p = plan_of(tmp_path, f'[kv]\nkv_budget_mb = 1000\nblock_size = 32\n[[models]]\nid = "d"\n'
                          f'config = "{DENSE}"\nmax_output_tokens = 4096\n')
    assert p.num_blocks == 1000 * MIB // (32 * 147456)
    assert p.context == min(40960, p.pool_tokens) // 32 * 32 == p.pool_tokens
    assert (p.input, p.output) == (p.context - 1, 4096)
    assert p.trade[0] == (1, p.context)
    for n, each in p.trade:
        assert each == p.num_blocks // n * 32
    big = plan_of(tmp_path, f'[kv]\nkv_budget_mb = 20000\n[[models]]\nid = "d"\nconfig = "{DENSE}"\n')
    assert big.context == 40960 and big.output == 40959  # capped by the model's positions
    assert big.trade[0] == (1, 40960) and big.trade[3][1] < 40960


def test_budget_from_device_memory(tmp_path):
    p = plan_of(tmp_path, f'[server]\ndevice_memory_mb = 24576\n[kv]\nmemory_fraction = 0.9\n'
                          f'activation_headroom_mb = 1024\n[[models]]\nid = "d"\nconfig = "{DENSE}"\n')
    assert p.kv_budget_bytes == int(24576 * MIB * 0.9) - p.weight_bytes_per_card - 1024 * MIB


def test_context_that_cannot_fit_fails_with_the_arithmetic(tmp_path, capsys):
    body = (f'[kv]\nkv_budget_mb = 4713\n[[models]]\nid = "h"\nconfig = "{HYBRID}"\ntp = 2\n'
            'context = 200000\n')
    path = neuron_toml(tmp_path, body)
    with pytest.raises(PlanError, match=r"models\[0\]\.context: expected at most 149,616 tokens"):
        check_neuron_config(path, load_neuron_config(path))
    assert helexa_main(["plan", str(path)]) != 0
    err = capsys.readouterr().err
    assert "12,500 blocks" in err and "9,426 blocks" in err and str(path) in err
    assert helexa_main(["config", "check", str(path)]) == 2


def test_a_cpu_model_without_a_budget_fails_the_check_as_plan_and_the_neuron_say(tmp_path,
                                                                                   capsys):
    # a CPU has no memory figure to ask: the load would fail UnknownBudget, so the check does
    path = neuron_toml(tmp_path, f'[[models]]\nid = "d"\nconfig = "{DENSE}"\n')
    line = (f"{path}: models[0].kv_budget_mb: expected kv_budget_mb (the model's or "
            "kv.kv_budget_mb) or server.device_memory_mb to plan `d` without a device")
    with pytest.raises(PlanError) as e:
        check_neuron_config(path, load_neuron_config(path))
    assert str(e.value) == line
    assert helexa_main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert helexa_main(["plan", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    neuron = subprocess.run([sys.executable, "-m", "helexa.cli", "neuron", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert neuron.returncode == 2 and neuron.stderr.splitlines() == [f"helexa neuron: {line}"]
    # one model of several without one: the message names that one, not [kv]
    spare = neuron_toml(tmp_path, f'[[models]]\nid = "d"\nconfig = "{DENSE}"\nkv_budget_mb = 4\n'
                                  f'[[models]]\nid = "spare"\nconfig = "{DENSE}"\n', "spare.toml")
    assert helexa_main(["config", "check", str(spare)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{spare}: models[1].kv_budget_mb: expected kv_budget_mb (the model's or "
        "kv.kv_budget_mb) or server.device_memory_mb to plan `spare` without a device"]
    # a CPU's memory given instead of a budget plans it (server.device_memory_mb's help)
    cpu = neuron_toml(tmp_path, f'[server]\ndevice_memory_mb = 24576\n[[models]]\nid = "d"\n'
                                f'config = "{DENSE}"\n', "cpu.toml")
    assert [p.model_id for p in check_neuron_config(cpu, load_neuron_config(cpu))] == ["d"]
    assert helexa_main(["config", "check", str(cpu)]) == 0
    # on CUDA cards the neuron asks them (nvidia-smi): nothing to say before it runs
    gpu = neuron_toml(tmp_path, f'[server]\ndevices = ["cuda:0"]\n[[models]]\nid = "d"\n'
                                f'config = "{DENSE}"\n', "gpu.toml")
    assert check_neuron_config(gpu, load_neuron_config(gpu)) == []
    assert helexa_main(["config", "check", str(gpu)]) == 0


def test_an_output_limit_beyond_the_context_is_refused_with_the_arithmetic(tmp_path, capsys):
    # advertised, it would have been cut to context - 1 without a word (/v1/models, Watch)
    body = (f'[kv]\nkv_budget_mb = 1000\nblock_size = 32\n[[models]]\nid = "d"\n'
            f'config = "{DENSE}"\ncontext = 4000\nmax_output_tokens = 5000\n')
    path = neuron_toml(tmp_path, body)
    line = (f"{path}: models[0].max_output_tokens: expected at most context - 1 = 3,999 "
            "(models[0].context = 4,000), got 5,000")
    assert helexa_main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert helexa_main(["plan", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    # a context the pool sets: the line shows where it comes from
    derived = neuron_toml(tmp_path, body.replace("context = 4000\n", "")
                          .replace("5000", "100000"), "d.toml")
    with pytest.raises(PlanError, match=(
            r"models\[0\]\.max_output_tokens: expected at most context - 1 = 7,103 \(context "
            r"7,104 = min\(one request's room in the pool 7,104 tokens \(1,000 MiB kv_budget_mb\), "
            r"model positions 40,960\) in blocks of 32\), got 100,000")):
        check_neuron_config(derived, load_neuron_config(derived))
    fits = plan_of(tmp_path, body.replace("5000", "3999"))
    assert (fits.context, fits.output) == (4000, 3999)


def test_missing_model_config_names_the_key(tmp_path):
    path = neuron_toml(tmp_path, '[kv]\nkv_budget_mb = 100\n[[models]]\nid = "x"\npath = "nowhere"\n')
    with pytest.raises(PlanError, match=r"models\[0\]\.path: expected a model config.json"):
        check_neuron_config(path, load_neuron_config(path))


def test_plan_prints_the_table(tmp_path, capsys):
    path = neuron_toml(tmp_path, f'[kv]\nkv_budget_mb = 4713\n[[models]]\nid = "h"\n'
                                 f'config = "{HYBRID}"\ntp = 2\n')
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "32,768 B" in out and "150,816 tokens" in out and "fixed per request" in out
    assert helexa_main(["plan", str(path), "--kv-dtype", "int8"]) == 0
    assert "(int8, head_dim 256)" in capsys.readouterr().out


def test_pool_grows_as_kv_bytes_shrink(tmp_path, capsys):
    path = neuron_toml(tmp_path, f'[kv]\nkv_budget_mb = 4713\n[[models]]\nid = "h"\n'
                                 f'config = "{HYBRID}"\ntp = 2\n')
    cfg = load_neuron_config(path)
    pools = {kv: plan_model(cfg, cfg.models[0], path, kv_dtype=kv).pool_tokens
             for kv in ("fp32", "bf16", "fp8_e4m3", "int8", "int4")}
    assert pools["fp32"] < pools["bf16"] < pools["int8"] == pools["fp8_e4m3"] < pools["int4"]
    assert pools["bf16"] == 150_816 and pools["int8"] == 296_976  # 260 B vs 512 B per token-head
    assert helexa_main(["plan", str(path), "--kv-dtype", "int4"]) == 0
    assert f"{pools['int4']:,} tokens" in capsys.readouterr().out


def test_budget_beyond_the_card_names_the_key(tmp_path):
    body = (f'[server]\ndevice_memory_mb = 24564\n[kv]\nkv_budget_mb = 9000\n'
            f'[[models]]\nid = "d"\nconfig = "{DENSE}"\n')
    path = neuron_toml(tmp_path, body)
    with pytest.raises(PlanError, match=r"kv\.kv_budget_mb: expected weights \+ KV \+ headroom "
                                        r"within 24,564 MiB per card, got 15,623 \+ 9,000 \+ 512"):
        check_neuron_config(path, load_neuron_config(path))
    tight = neuron_toml(tmp_path, body.replace("kv_budget_mb = 9000", "kv_budget_mb = 8000")
                        + "kv_budget_mb = 9000\n", "t.toml")
    with pytest.raises(PlanError, match=r"models\[0\]\.kv_budget_mb: expected weights"):
        check_neuron_config(tight, load_neuron_config(tight))


def test_beasts_budget_splits_into_state_slots_and_blocks_that_still_hold_its_context(tmp_path):
    from helexa.plan import state_slots

    path = ASSET / "neuron" / "beast.toml"
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    assert p.fixed_bytes == 39_223_296  # 37.4 MiB, as beast.toml's comment says
    blocks, slots = state_slots(p, cfg.admission.max_in_flight)
    assert slots == 2  # one per request in flight
    # what one context and the 2 slots leave holds 2 prefix snapshots (beast.toml's comment)
    assert p.num_snapshot_slots == 2
    assert blocks == (4270 * MIB - (2 + 2) * 39_223_296) // (16 * 32 * 1024) == 8_240
    assert blocks * 16 >= p.context == 131_072  # one full-context request still fits
    # A budget that cannot hold max_in_flight states beside one context keeps fewer slots.
    tight = plan_of(tmp_path, f'[kv]\nkv_budget_mb = 4400\n[[models]]\nid = "h"\n'
                    f'config = "{HYBRID}"\ntp = 2\ncontext = 131072\n')
    blocks, slots = state_slots(tight, 16)
    assert 1 <= slots < 16 and blocks * 16 >= 131_072
    assert blocks * 16 * 32 * 1024 + slots * tight.fixed_bytes <= 4400 * MIB


def test_the_model_code_holds_what_the_plan_counts_for_the_27b_hybrid():
    # Built on the meta device: shapes and bytes, no memory.
    import torch

    from helexa.kernels.backends.gdn import GatedDeltaStates
    from helexa.kernels.paged_kv import PagedKV
    from helexa.neuron.formats.base import open_checkpoint
    from helexa.neuron.models.hybrid import HybridForCausalLM

    mc = open_checkpoint(HYBRID.parent).config
    model = HybridForCausalLM(mc, tp_rank=0, tp_size=2, dtype=torch.bfloat16, device="meta")
    shape = read_model_shape(HYBRID)
    states = GatedDeltaStates(torch.device("meta"))
    states.allocate([layer.state_spec for layer in model.linear_layers], 1)
    state = sum(s.nbytes for s in states.layers)
    assert state == fixed_bytes_per_request(shape, 2) == 39_223_296
    attn = model.attention_layers
    kv = sum(PagedKV(1, 16, a.num_kv_heads, a.head_dim, kv_dtype="bf16", storage=torch.bfloat16,
                     compute=torch.bfloat16, device="meta").nbytes for a in attn)
    assert kv // 16 == kv_bytes_per_token(shape, 2, "bf16") == 32 * 1024


def test_a_speculating_config_sets_room_aside_per_state_slot_for_a_held_verification_row(
        tmp_path):
    from helexa.checkpoint.memory import held_bytes_per_request
    from helexa.plan import state_slots

    shape = read_model_shape(HYBRID)
    # per position and linear layer at tp = 2: conv inputs 5,120 × 2 B + k 8 × 128 × 4 B
    # + v 24 × 128 × 2 B + g, beta 2 × 24 × 4 B = 20,672 B; × 48 layers × (4 + 1) positions
    assert held_bytes_per_request(shape, 2, 4) == 5 * 48 * 20_672 == 4_961_280
    assert held_bytes_per_request(shape, 2, 0) == 0
    assert held_bytes_per_request(read_model_shape(DENSE), 1, 4) == 0
    body = (f'[kv]\nkv_budget_mb = 4713\nblock_size = 16\n[[models]]\nid = "h"\n'
            f'config = "{HYBRID}"\ntp = 2\ncontext = 131072\n')
    off = plan_of(tmp_path, body)
    assert off.held_bytes == 0  # nothing speculates: nothing set aside
    assert state_slots(off, 16) == (8_229, 16)
    on = plan_of(tmp_path, body.replace("[[models]]", '[engine]\nspeculation = "ngram"\n'
                                        "spec_k = 4\n[[models]]"))
    assert on.held_bytes == 4_961_280
    blocks, slots = state_slots(on, 16)
    assert slots == 14  # 617 MiB beside one full context hold 14 of (37.4 + 4.7) MiB
    assert blocks * 16 >= 131_072
    assert blocks * 16 * 32 * 1024 + slots * (on.fixed_bytes + on.held_bytes) <= 4713 * MIB
    k8 = plan_of(tmp_path, body.replace("[[models]]", '[profiles.fast]\nspeculation = "ngram"\n'
                                        "spec_k = 8\n[[models]]"))
    assert k8.held_bytes == 9 * 48 * 20_672  # a profile can switch to k = 8: its room


def test_a_draft_model_counts_in_weights_and_kv_per_token_of_its_target(tmp_path):
    small = tmp_path / "small" / "config.json"  # a Qwen3-0.6B-like shape
    small.parent.mkdir()
    small.write_text(json.dumps({**json.loads(DENSE.read_text()), "num_hidden_layers": 28,
                                 "hidden_size": 1024, "intermediate_size": 3072,
                                 "num_attention_heads": 16, "num_key_value_heads": 8,
                                 "tie_word_embeddings": True}))
    base = (f'[kv]\nkv_budget_mb = 4096\n[server]\ndevice_memory_mb = 81920\n'
            f'[[models]]\nid = "big"\nconfig = "{DENSE}"\n')
    drafted = base.replace('"\n[[models]]', '"\n[[models]]', 1) + (
        f'speculation = "draft:small"\n[[models]]\nid = "small"\npath = "{small.parent}"\n'
        f'preload = false\n')
    alone, with_draft = plan_of(tmp_path, base), plan_of(tmp_path, drafted)
    d_shape = read_model_shape(small)
    d_kv = kv_bytes_per_token(d_shape, 1, "bf16")
    assert with_draft.draft_model_id == "small" and with_draft.draft_bytes_per_token == d_kv
    assert with_draft.bytes_per_token == alone.bytes_per_token + d_kv
    assert with_draft.weight_bytes_per_card - alone.weight_bytes_per_card \
        == with_draft.draft_weight_bytes > 1_000_000_000  # ~0.6B params in bf16
    assert with_draft.num_blocks < alone.num_blocks  # the same budget holds fewer tokens
    # the configured context must be reachable with the draft's KV counted, arithmetic shown
    ctx = alone.pool_tokens
    with pytest.raises(PlanError, match=rf"{ctx:,} tokens need .* × {alone.bytes_per_token + d_kv:,} B"):
        plan_of(tmp_path, drafted.replace('speculation', f'context = {ctx}\nspeculation'))


def test_a_models_own_speculation_plans_its_held_rows(tmp_path):
    body = (f'[kv]\nkv_budget_mb = 4713\n[[models]]\nid = "h"\nconfig = "{HYBRID}"\ntp = 2\n'
            'context = 131072\n')
    assert plan_of(tmp_path, body).held_bytes == 0
    own = plan_of(tmp_path, body + 'speculation = "ngram"\nspec_k = 4\n')
    assert own.held_bytes == 5 * 48 * 20_672  # as [engine] speculation = "ngram", k = 4 plans
    off = plan_of(tmp_path, body.replace("[[models]]", '[engine]\nspeculation = "ngram"\n'
                                         "[[models]]") + 'speculation = "off"\n')
    assert off.held_bytes == 0  # the entry turns [engine]'s off for this model


def test_a_hybrid_plan_carves_prefix_snapshots_after_its_state_slots(tmp_path):
    from helexa.cli.plan import format_plan
    from helexa.neuron.limits import ModelLimits
    from helexa.plan import state_slots

    body = (f'[kv]\nkv_budget_mb = {{mb}}\nblock_size = 16\n[[models]]\nid = "h"\n'
            f'config = "{HYBRID}"\ntp = 2\ncontext = 131072\n')
    # beast's budget: one full context and 16 state slots leave no room for a 37.4 MiB
    # snapshot, and the plan says the prefix cache is off
    tight = plan_of(tmp_path, body.format(mb=4713))
    assert tight.num_snapshot_slots == 0 and state_slots(tight, 16) == (8_229, 16)
    assert "none fit (39,223,296 B each)" in format_plan(tight)
    assert ModelLimits.from_plan(tight).prefix_cache is False
    # 1.2 GiB more holds the 32 snapshots kv.prefix_snapshots asks for, beside the same slots
    roomy = plan_of(tmp_path, body.format(mb=4713 + 1200))
    assert roomy.num_snapshot_slots == 32
    blocks, slots = state_slots(roomy, 16)
    assert slots == 16 and blocks * 16 >= 131_072
    assert (blocks * 16 * 32 * 1024 + slots * roomy.fixed_bytes
            + 32 * roomy.fixed_bytes) <= roomy.kv_budget_bytes
    assert "32 × 39,223,296 B = 1.2 GiB" in format_plan(roomy)
    assert ModelLimits.from_plan(roomy).prefix_cache is True
    off = plan_of(tmp_path, body.format(mb=4713 + 1200).replace(
        "block_size = 16\n", "block_size = 16\nprefix_cache = false\n"))
    assert off.num_snapshot_slots == 0 and state_slots(off, 16)[1] == 16


@pytest.mark.parametrize("kv, says", [
    ("", 'per principal (kv.prefix_sharing = "principal")'),
    ('prefix_sharing = "global"\n', 'shared by all principals (kv.prefix_sharing = "global"'),
    ("prefix_cache = false\n", "off (kv.prefix_cache = false)")])
def test_plan_says_whose_prefixes_a_request_reuses(tmp_path, capsys, kv, says):
    path = neuron_toml(tmp_path, f'[kv]\nkv_budget_mb = 1000\n{kv}[[models]]\nid = "d"\n'
                                 f'config = "{DENSE}"\n')
    assert helexa_main(["plan", str(path)]) == 0
    assert f"  prefix cache: {says}" in capsys.readouterr().out


def test_the_host_tier_is_planned_per_card_in_the_pools_mix(tmp_path):
    from helexa.cli.plan import format_plan
    from helexa.plan import state_slots

    body = (f'[kv]\nkv_budget_mb = 5913\nblock_size = 16\n{{host}}[[models]]\nid = "h"\n'
            f'config = "{HYBRID}"\ntp = 2\ncontext = 131072\n')
    assert plan_of(tmp_path, body.format(host="")).host_blocks == 0  # off by default
    plan = plan_of(tmp_path, body.format(host="host_cache_mb = 16384\n"))
    per_card = 8192 * MIB  # 16 GiB of host memory for the model, tp = 2
    assert plan.host_bytes_per_card == per_card
    blocks, _ = state_slots(plan, 16)
    block_bytes = plan.block_size * plan.bytes_per_token
    used = plan.host_blocks * block_bytes + plan.host_snapshots * plan.fixed_bytes
    assert per_card - block_bytes < used <= per_card
    # the pool's mix: as many snapshots per block as the device pool holds
    assert plan.host_snapshots == per_card * 32 // (blocks * block_bytes
                                                    + 32 * plan.fixed_bytes)
    assert plan.host_snapshots > 32 and plan.host_blocks > blocks
    assert (f"host tier           8.0 GiB of host memory per card (kv.host_cache_mb / tp): "
            f"{plan.host_blocks:,} blocks") in format_plan(plan)
    off = plan_of(tmp_path, body.format(host="host_cache_mb = 16384\nprefix_cache = false\n"))
    assert off.host_blocks == 0 and "host tier" not in format_plan(off)
