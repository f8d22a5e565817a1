"""`helexa bench` against the in-process fleet: figures for served streams, counts of refusals."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from helexa.bench_http import main, parse_scenario, prompt


def test_scenarios_parse_and_prompts_have_the_asked_size():
    sc = parse_scenario("chat:512,concurrency:8")
    assert (sc.prompt_tokens, sc.concurrency) == (512, 8)
    assert parse_scenario("concurrency:3").prompt_tokens == 32
    with pytest.raises(argparse.ArgumentTypeError):
        parse_scenario("chat:x")
    assert abs(len(prompt(100, 1)) - 400) < 40 and prompt(10, 1) != prompt(10, 2)


def test_bench_reports_streams_and_refusals(fl, capsys):
    assert main(["--url", fl.url, "--model", "tiny", "--scenario", "concurrency:2",
                 "--scenario", "chat:64", "--requests", "4", "--max-tokens", "5", "--json"]) == 0
    out = capsys.readouterr().out  # the in-process router's log lines may be mixed in
    rows = json.loads(re.search(r"^\[\n.*?^\]$", out, re.S | re.M).group(0))
    assert [r["completed"] for r in rows] == [4, 4]
    assert rows[0]["completion_tokens"] == 20 and rows[0]["ttft_p50_ms"] > 0
    assert rows[0]["itl_p50_ms"] is not None and rows[0]["aggregate_tok_per_s"] > 0
    assert main(["--url", fl.url, "--model", "nope", "--scenario", "concurrency:1",
                 "--requests", "2"]) == 1
    out = capsys.readouterr().out
    assert "404:2" in out and "ttft p50 ms" in out
