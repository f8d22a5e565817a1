"""`helexa plan`'s activation headroom on CUDA: what a card holds beside the weights and the
KV pool (helexa/checkpoint/step_memory.py), each term printed and added up, and the verdict.
The load measures a worst-case step on every card (helexa/neuron/engine/pool_probe.py) and
trims a pool the headroom over-counts, so the plan says, at any tp, and refuses nothing."""

from __future__ import annotations

import math
from pathlib import Path

from helexa.checkpoint.memory import format_bytes
from helexa.checkpoint.step_memory import NCCL_MARGIN_BYTES
from helexa.cli import main as helexa_main
from helexa.config.schema import load_neuron_config
from helexa.plan import plan_model

ASSET = Path(__file__).resolve().parent.parent / "asset" / "models" / "Qwen"
DENSE, HYBRID = ASSET / "Qwen3-8B" / "config.json", ASSET / "Qwen3.5-27B" / "config.json"
MIB = 2**20


def _toml(tmp_path: Path, *, model: Path = DENSE, tp: int = 1, kv: str = "",
          engine: str = "", devices: str = "cuda") -> Path:
    path = tmp_path / "n.toml"
    cards = ", ".join(f'"{devices}:{i}"' for i in range(tp))
    path.write_text(f'[server]\ndevices = [{cards}]\ndevice_memory_mb = 81559\n[kv]\n{kv}\n'
                    f'[engine]\n{engine}\n[[models]]\nid = "m"\nconfig = "{model}"\ntp = {tp}\n')
    return path


def _plan(path: Path):
    cfg = load_neuron_config(path)
    return plan_model(cfg, cfg.models[0], path)


REVIEW = ("memory_fraction = 0.97\nactivation_headroom_mb = 2400",
          "max_batched_tokens = 8192\nprefill_chunk_tokens = 8192")


def test_the_27b_at_tp2_is_told_what_its_headroom_cannot_hold(tmp_path, capsys):
    """The review's case: 2,400 MiB of headroom (2,720 with the tower's embedding cache)
    held the graphs, the all-reduce space and the tower, with 351 MiB to spare, while
    FlashInfer's workspaces, the rotary table and NCCL went uncounted. The plan adds them
    all and says how much headroom would hold them; the load measures every card and
    trims the pool, so it is a verdict, not a refusal."""
    kv, engine = REVIEW
    path = _toml(tmp_path, model=HYBRID, tp=2, kv=kv, engine=engine)
    short = _plan(path).activation
    assert short is not None
    assert helexa_main(["plan", str(path)]) == 0
    why = capsys.readouterr().out.split("activation need     ", 1)[1].split("\n", 1)[0]
    for term in ("the vision tower's peak 1.6 GiB (over the text step's 1.1 GiB)",
                 "its embedding cache 320.0 MiB", "graph pool ", "all-reduce 10.0 MiB",
                 "FlashInfer 272.0 MiB", "rotary table 128.0 MiB", "NCCL and context 1.0 GiB"):
        assert term in why
    assert why.endswith(f": MORE than the 2.7 GiB activation headroom (raise "
                        f"kv.activation_headroom_mb to {short.headroom_mb:,} MiB); the load "
                        "measures a worst-case step on every card and sizes the pool to what is "
                        "left, the least any card holds")
    # the figure it names is enough: then the verdict says inside, each term on its line
    least = short.headroom_mb
    path.write_text(path.read_text().replace("= 2400", f"= {least}"))
    p = _plan(path)
    a = p.activation
    assert a is not None and a.total <= p.headroom_bytes < a.total + MIB + a.cache
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    st = a.step
    assert (f"    text step           {format_bytes(st.total)} (estimate) for 8,192 tokens "
            f"(engine.max_batched_tokens) × {st.per_token:,} B, a Gated DeltaNet layer's live "
            f"activations a token, + 8 rows' logits {format_bytes(st.logits)} + 8 sequences' "
            f"recurrent states {format_bytes(st.states)}\n") in out
    assert ("    FlashInfer          272.0 MiB: the eager wrappers' float workspace 256.0 MiB + "
            "2 int workspaces of 8.0 MiB\n") in out
    assert ("    rotary table        128.0 MiB: 262,144 positions × 64 rotary dims × (cos and "
            "sin 4 B + FlashInfer's fp32 table 4 B)\n") in out
    assert "    NCCL and context    1.0 GiB at tp = 2: a stated margin, not computable" in out
    assert f": inside the {format_bytes(p.headroom_bytes)} activation headroom; the load " in out


def test_a_larger_step_that_does_not_fit_gets_another_verdict(tmp_path):
    """The same model and headroom at 2,048 and at 16,384 tokens a step: the plan may not
    say the same of both when the larger step's activations do not fit."""
    small, large = ("max_batched_tokens = 2048", "max_batched_tokens = 16384")
    fits = _plan(_toml(tmp_path, tp=2, engine=small, kv="activation_headroom_mb = 2048"))
    assert fits.activation is not None and fits.activation.total <= fits.headroom_bytes
    short = _plan(_toml(tmp_path, tp=2, engine=large, kv="activation_headroom_mb = 2048"))
    assert short.activation is not None and short.activation.total > short.headroom_bytes
    # the step's share grows with its tokens: 14,336 more of them
    big = _plan(_toml(tmp_path, tp=2, engine=large, kv="activation_headroom_mb = 8192"))
    assert big.activation is not None
    grown = big.activation.step.total - fits.activation.step.total
    assert grown == 14_336 * fits.activation.step.per_token
    # at tp = 1 the load measures the step: the plan says, and plans
    one = _plan(_toml(tmp_path, engine=large, kv="activation_headroom_mb = 1024"))
    assert one.activation is not None and one.activation.total > one.headroom_bytes


def test_tp1_says_more_than_the_headroom_and_that_the_load_measures(tmp_path, capsys):
    path = _toml(tmp_path, kv="activation_headroom_mb = 512")
    p = _plan(path)
    a = p.activation
    assert a is not None and a.comm == 0  # no NCCL at tp = 1
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert (f"activation need     {format_bytes(a.total)} = text step "
            f"{format_bytes(a.step.total)} + graph pool {format_bytes(p.graph_pool_bytes)} + "
            f"FlashInfer 272.0 MiB + rotary table 40.0 MiB: MORE than the 512.0 MiB activation "
            f"headroom (raise kv.activation_headroom_mb to {math.ceil(a.total / MIB):,} MiB); "
            "the load measures a worst-case step and sizes the pool to what is left\n") in out
    assert "NCCL and context" not in out


def test_a_hand_sized_pool_at_tp2_is_told_not_refused(tmp_path, capsys):
    """kv_budget_mb: the operator sized the pool (beast's from a measured CUDA context);
    the plan says the headroom is short and checks weights + KV + headroom as before."""
    path = _toml(tmp_path, tp=2, kv="kv_budget_mb = 4096\nactivation_headroom_mb = 512")
    p = _plan(path)
    assert p.activation is not None and p.activation.total > p.headroom_bytes
    assert p.activation.comm == NCCL_MARGIN_BYTES
    assert helexa_main(["plan", str(path)]) == 0
    assert "MORE than the 512.0 MiB activation headroom" in capsys.readouterr().out


def test_a_cpu_neuron_has_no_cuda_headroom(tmp_path, capsys):
    path = _toml(tmp_path, tp=2, devices="cpu", kv="activation_headroom_mb = 0")
    assert _plan(path).activation is None
    assert helexa_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "activation need" not in out and "text step" not in out
