"""`helexa plan`'s CUDA graph pool line: decode batches max_slots..1 captured at load, one
shared pool (helexa/checkpoint/memory.py graph_pool_bytes), counted against the
activation headroom."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from helexa.checkpoint.memory import (
    allreduce_workspace_bytes,
    format_bytes,
    fused_allreduce_rows,
    graph_capture_sizes,
    graph_pool_bytes,
)
from helexa.checkpoint.shape import read_model_shape
from helexa.cli import main as helexa_main
from helexa.config.schema import load_neuron_config
from helexa.plan import plan_model

ASSET = Path(__file__).resolve().parent.parent / "asset"
DENSE = ASSET / "models" / "Qwen" / "Qwen3-8B" / "config.json"
HYBRID = ASSET / "models" / "Qwen" / "Qwen3.5-27B" / "config.json"


def _toml(tmp_path: Path, engine: str = "", model: Path = DENSE, tp: int = 1) -> Path:
    path = tmp_path / "n.toml"
    devices = ", ".join(f'"cuda:{i}"' for i in range(tp))
    path.write_text(f'[server]\ndevices = [{devices}]\n[engine]\n{engine}\n[kv]\n'
                    f'kv_budget_mb = 4096\n[[models]]\nid = "m"\nconfig = "{model}"\ntp = {tp}\n')
    return path


def test_every_decode_batch_is_captured_largest_first():
    assert graph_capture_sizes(4) == [4, 3, 2, 1]
    assert graph_capture_sizes(1) == [1]
    assert graph_capture_sizes(0) == []


def test_the_pool_of_the_dense_8b_worked_by_hand():
    shape = read_model_shape(DENSE)
    # per row: logits 151,936 x (4 shared out + 4 fp32 + 2 bf16) + 2 B x (4 x 4,096 hidden
    # + (32 + 2 x 8) heads x 128 + 2 x 12,288 intermediate) = 1,613,568 B; 8 rows; beside
    # the pool each graph's FlashInfer wrapper holds 8 MiB, and their page buffer 4 B a block;
    # the graph wrappers share one float scratch of 256 MiB (a group of 4 splits into less)
    assert graph_pool_bytes(shape, 1, 8) == 8 * 1_613_568 + 8 * 8 * 2**20 + 256 * 2**20
    assert graph_pool_bytes(shape, 1, 8, num_blocks=1000) == (
        graph_pool_bytes(shape, 1, 8) + 8 * 4 * 1000)
    assert graph_pool_bytes(shape, 1, 16) == 2 * graph_pool_bytes(shape, 1, 8) - 256 * 2**20
    assert graph_pool_bytes(shape, 1, 0) == 0


def test_a_hybrids_pool_counts_its_gathered_states_and_scratch_slot_per_card():
    shape = read_model_shape(HYBRID)  # 48 value heads of 128 x 128 state, bf16
    without = replace(shape, linear_num_value_heads=0)
    # the states gathered and updated (2 copies, fp32) for one layer, 24 value heads per
    # card; and the state pool's scratch slot (FlashInfer's padding rows): every one of the
    # 48 linear-attention layers' 24 heads, in bf16 (37.7 MB)
    gathered, scratch = 2 * 24 * 128 * 128 * 4, 48 * 24 * 128 * 128 * 2
    assert shape.linear_attention_layers == 48
    assert graph_pool_bytes(shape, 2, 1) - graph_pool_bytes(without, 2, 1) == gathered + scratch
    assert graph_pool_bytes(shape, 2, 2) - graph_pool_bytes(without, 2, 2) == 2 * gathered + scratch


def test_plan_prints_the_graph_pool_line(tmp_path, capsys):
    path = _toml(tmp_path, "max_slots = 8")
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    assert (p.graph_rows, p.num_blocks) == (8, 1820)
    assert p.graph_pool_bytes == 8 * 1_613_568 + 8 * (8 * 2**20 + 4 * 1820) + 256 * 2**20
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("CUDA graph pool     332.4 MiB (estimate, with the graphs' attention buffers) for "
            "decode batches 8..1 captured at load, in the activation headroom\n") in out
    assert " + graph pool 332.4 MiB + " in out  # and in the headroom's sum (test_plan_headroom)


def test_a_pool_beyond_the_headroom_says_so(tmp_path, capsys):
    path = _toml(tmp_path, "max_slots = 512")
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    assert p.activation is not None and p.activation.graphs == p.graph_pool_bytes
    assert helexa_main(["plan", str(path)]) == 0  # tp = 1: the load measures, the plan says
    assert (f"MORE than the 512.0 MiB activation headroom (raise kv.activation_headroom_mb to "
            f"{p.activation.headroom_mb:,} MiB)") in capsys.readouterr().out


def test_a_cpu_neuron_captures_no_graphs(tmp_path, capsys):
    path = tmp_path / "n.toml"
    path.write_text(_toml(tmp_path, "max_slots = 8").read_text().replace('"cuda:0"', '"cpu"'))
    cfg = load_neuron_config(path)
    assert plan_model(cfg, cfg.models[0], path).graph_rows == 0
    assert helexa_main(["plan", str(path)]) == 0
    assert "CUDA graph" not in capsys.readouterr().out


def test_the_graph_pool_sits_beside_a_vision_towers_peak(tmp_path, capsys):
    """An image step runs eagerly while the graphs hold their pool: the line weighs the
    pool, the all-reduce space and the tower's peak with its embedding cache together."""
    path = _toml(tmp_path, "max_slots = 16", model=HYBRID, tp=2)
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    a = p.activation
    assert a is not None and (a.graphs, a.allreduce) == (p.graph_pool_bytes,
                                                         p.allreduce_workspace_bytes)
    assert a.encoder + a.cache == p.vision_peak_bytes and a.encoder > a.step.total
    held = p.graph_pool_bytes + p.allreduce_workspace_bytes + p.vision_peak_bytes
    assert p.vision_peak_bytes > p.graph_pool_bytes > 0 and a.total > held > p.headroom_bytes
    assert helexa_main(["plan", str(path)]) == 0  # the load measures: told, not refused
    out = capsys.readouterr().out
    assert (f"activation need     {format_bytes(a.total)} = the vision tower's peak "
            f"{format_bytes(a.encoder)} (over the text step's {format_bytes(a.step.total)}) + "
            f"its embedding cache {format_bytes(a.cache)} + graph pool "
            f"{format_bytes(p.graph_pool_bytes)} + all-reduce "
            f"{format_bytes(p.allreduce_workspace_bytes)} + ") in out
    assert f"MORE than the {format_bytes(p.headroom_bytes)} activation headroom" in out
    roomy = tmp_path / "roomy.toml"
    roomy.write_text(path.read_text().replace("[kv]\n", "[kv]\nactivation_headroom_mb = 4096\n"))
    assert helexa_main(["plan", str(roomy)]) == 0
    assert ": inside the 4.3 GiB activation headroom; the load measures" in capsys.readouterr().out


def test_no_graph_line_without_cuda_graphs(tmp_path, capsys):
    path = _toml(tmp_path, "cuda_graphs = false")
    cfg = load_neuron_config(path)
    assert plan_model(cfg, cfg.models[0], path).graph_pool_bytes == 0
    assert helexa_main(["plan", str(path)]) == 0
    assert "CUDA graph pool" not in capsys.readouterr().out


def test_a_float_pool_of_another_dtype_captures_no_graphs_and_says_why(tmp_path, capsys):
    # a pool of another float dtype than the model's runs the torch path on a cuda
    # backend, eagerly (helexa/checkpoint/kv_path.py): no graph pool is held
    path = tmp_path / "n.toml"
    path.write_text(_toml(tmp_path, "max_slots = 8").read_text()
                    .replace("[kv]\n", '[kv]\nkv_dtype = "fp16"\n'))
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    why = "KV fp16 with bf16 queries"
    assert (p.graph_rows, p.graph_pool_bytes, p.graphs_off) == (0, 0, why)
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CUDA graph pool" not in out
    assert (f"CUDA graphs         none: {why} runs FlashInfer's torch path on a cuda "
            "backend, every decode step eagerly") in out
    # the model's own dtype: graphs, and no such line
    p = plan_model(cfg, cfg.models[0], path, kv_dtype="bf16")
    assert (p.graph_rows, p.graphs_off) == (8, "")


def test_a_quantised_pool_captures_graphs_over_its_triton_kernels(tmp_path, capsys):
    """A quantised pool's decode steps are captured too (the torch path's Triton kernels,
    helexa/kernels/backends/torch_ref.py): its graphs hold no FlashInfer wrapper but each
    row's pages (int32, as many as the pool has blocks), its context and its token's slot,
    and one layer's split scratch, worked by hand for the dense 8B."""
    shape = read_model_shape(DENSE)
    activations = 8 * 1_613_568  # test_the_pool_of_the_dense_8b_worked_by_hand's 8 rows
    # at most 264 programs plus one a (row, kv head): (264 + 8 x 8) x a group of 4 x
    # (128 dims + 1 log-sum-exp) x 4 B; and 8 rows x (4 B x 1000 blocks + 4 + 8)
    scratch = (264 + 8 * 8) * 4 * 129 * 4
    assert graph_pool_bytes(shape, 1, 8, num_blocks=1000, quantised_kv=True) == (
        activations + 8 * (4 * 1000 + 12) + scratch)
    for kv in ("int8", "fp8_e4m3", "int4"):
        path = tmp_path / "n.toml"
        path.write_text(_toml(tmp_path, "max_slots = 8").read_text()
                        .replace("[kv]\n", f'[kv]\nkv_dtype = "{kv}"\n'))
        cfg = load_neuron_config(path)
        p = plan_model(cfg, cfg.models[0], path)
        assert (p.graph_rows, p.graphs_off) == (8, "")
        assert p.graph_pool_bytes == graph_pool_bytes(shape, 1, 8, "bf16", p.num_blocks,
                                                      quantised_kv=True)
        assert helexa_main(["plan", str(path)]) == 0
        out = capsys.readouterr().out
        assert "CUDA graph pool" in out and "CUDA graphs         none" not in out


def test_a_tp2_cuda_plan_counts_the_fused_allreduce_workspace(tmp_path, capsys):
    shape = read_model_shape(DENSE)
    # FlashInfer 0.6.13's buffers for 128 rows of 4,096 bf16 at tp 2: one of 2 x 128 x 4,096
    # x 2 B, three Lamport buffers the same, 2 x 256 int32 flags
    assert allreduce_workspace_bytes(shape, 2, 128) == 4 * 2_097_152 + 2_048
    assert allreduce_workspace_bytes(shape, 1, 128) == 0
    assert fused_allreduce_rows(8) == 128 and fused_allreduce_rows(256) == 256
    path = tmp_path / "n.toml"
    path.write_text('[server]\ndevices = ["cuda:0", "cuda:1"]\ndevice_memory_mb = 81920\n'
                    '[engine]\nmax_slots = 8\n[kv]\nkv_budget_mb = 4096\n[[models]]\nid = "m"\n'
                    f'config = "{DENSE}"\ntp = 2\n')
    cfg = load_neuron_config(path)
    p = plan_model(cfg, cfg.models[0], path)
    assert (p.allreduce_rows, p.allreduce_workspace_bytes) == (128, 8_390_656)
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("all-reduce space    8.0 MiB for the fused all-reduce + RMSNorm of steps up to 128 "
            "rows (where FlashInfer's runs), in the activation headroom") in out
    assert " + all-reduce 8.0 MiB + " in out  # in the activation headroom's sum
    cpu = _toml(tmp_path, "max_slots = 8", tp=2)  # CPU ranks: gloo, no workspace
    cpu.write_text(cpu.read_text().replace('"cuda:0", "cuda:1"', '"cpu", "cpu"'))
    cfg = load_neuron_config(cpu)
    assert plan_model(cfg, cfg.models[0], cpu).allreduce_workspace_bytes == 0


def test_an_moe_pool_counts_one_layers_expert_copies_or_batched_products():
    """Captured decode batches of rows x top_k <= experts may run the gathered form (a
    quantised stack's bound; a float stack's is a third of it), which copies each (row,
    choice)'s gate/up and down matrices; larger ones run the masked form's batched products
    over every expert (helexa/kernels/moe_experts.py): the pool counts the larger of the
    two. Qwen3-30B-A3B's shape: 128 experts, top 8, width 768, hidden 2,048."""
    moe = replace(read_model_shape(DENSE), num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, hidden_size=2048, intermediate_size=6144)
    dense = replace(moe, num_experts=0)
    copies = 3 * 768 * 2048 * 2  # one (row, choice): gate + up + down, bf16
    assert graph_pool_bytes(moe, 1, 8) - graph_pool_bytes(dense, 1, 8) == 8 * 8 * copies
    # past 16 rows (16 x 8 = 128) nothing gathers more
    assert graph_pool_bytes(moe, 1, 64) - graph_pool_bytes(dense, 1, 64) == 16 * 8 * copies
    assert graph_pool_bytes(moe, 2, 8) - graph_pool_bytes(dense, 2, 8) == 8 * 8 * copies // 2
    # at 2,048 rows the batched products, 128 experts x 2,048 rows x (3 x 768 + 2,048),
    # outgrow the copies
    assert graph_pool_bytes(moe, 1, 2048) - graph_pool_bytes(dense, 1, 2048) == \
        128 * 2048 * (3 * 768 + 2048) * 2


def test_graphs_are_planned_for_the_widest_profile_a_switch_can_reach(tmp_path):
    """A profile switch needs no reload: the model's graphs are captured, and their pool
    counted, for the most decode rows of the base settings and every profile."""
    path = _toml(tmp_path, "max_slots = 8")
    path.write_text(path.read_text() + '\n[profiles.wide]\nmax_slots = 12\n'
                    '[profiles.narrow]\nmax_slots = 2\n')
    cfg = load_neuron_config(path)
    assert cfg.step_ceilings() == (12, cfg.engine.max_batched_tokens)
    p = plan_model(cfg, cfg.models[0], path)
    assert p.graph_rows == 12
    assert p.graph_pool_bytes == graph_pool_bytes(read_model_shape(DENSE), 1, 12,
                                                  num_blocks=p.num_blocks)
