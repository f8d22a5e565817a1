"""helexa/kernels/cpu/matmul.py's choice per row bucket from measured times: the fastest,
with hx_gemm kept at decode sizes while it costs little more (a fused step needs every layer
matmul native), never at prefill sizes."""

from __future__ import annotations

from helexa.kernels.cpu import matmul


def test_the_fastest_kind_wins_each_bucket():
    times = {"torch": [10.0, 100.0, 1000.0], "onednn": [30.0, 60.0, 900.0],
             "native": [500.0, 400.0, 5000.0]}
    assert matmul.choose(times) == ("torch", "onednn", "onednn")


def test_native_within_its_slack_wins_decode_sizes_only():
    slack = matmul.NATIVE_SLACK
    times = {"torch": [1000.0, 2000.0, 100.0], "native": [1000.0 * slack, 2000.0 * slack, 101.0]}
    assert matmul.choose(times) == ("native", "native", "torch")
    times["native"] = [1000.0 * slack * 1.01, 2000.0 * slack * 1.01, 100.0]
    assert matmul.choose(times) == ("torch", "torch", "torch")  # just past the factor


def test_a_small_product_a_few_microseconds_slower_stays_native():
    # 512x512 of the F32 29M qwen3: twice torch's time at one row, but 18 us a call
    extra = matmul.NATIVE_SLACK_US
    times = {"torch": [19.0, 43.0, 600.0], "native": [19.0 + extra, 43.0 + extra, 600.0 + 1]}
    assert matmul.choose(times) == ("native", "native", "torch")
    times["native"] = [19.0 + extra + 1, 43.0 + extra + 1, 600.0]
    assert matmul.choose(times)[:2] == ("torch", "torch")
