"""`helexa bench` against a real router and neurons (tests/integration/ops/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
from browser_cdp import Browser
from prometheus_client.parser import text_string_to_metric_families
from router_procs import wait_for

from helexa.loadgen.bench import main
from helexa.loadgen.report import report
from helexa.loadgen.request import Record
from helexa.loadgen.stats import group, knees, summarise


def _records(path: Path) -> list[Record]:
    return [Record(**obj) for line in path.read_text().splitlines()
            if "run" not in (obj := json.loads(line))]


def _bench(ops, tmp_path: Path, name: str, *args: str) -> list[Record]:
    out = tmp_path / f"{name}.jsonl"
    main(["--url", ops.url, "--out", str(out), "--no-progress", "--api-key", ops.keys["bench"],
          "--principal", "bench", *args])
    return _records(out)


def test_prompt_lengths_are_within_one_percent_of_asked(ops, tmp_path):
    recs = _bench(ops, tmp_path, "lengths", "--model", "tiny", "--scenario", "chat:100",
                  "--scenario", "chat:300", "--requests", "3", "--max-tokens", "4",
                  "--tokenizer", str(ops.tiny_dir))
    assert [r.outcome for r in recs] == ["ok"] * 6
    for r in recs:
        asked = int(r.scenario.split(":")[1])
        assert abs(r.prompt_tokens - asked) <= 0.01 * asked, (r.prompt_tokens, asked)


def test_timeouts_refusals_and_disconnects_are_each_counted(ops, tmp_path):
    # one at a time: even requests run past --timeout, odd ones hang up after a token;
    # then six at once against a cap of 3 per principal: 429s (up to 3: a request that
    # hangs up early frees its place for a later arrival)
    recs = _bench(ops, tmp_path, "mixed", "--model", "slow", "--scenario", "chat:16",
                  "--scenario", "chat:16,concurrency:6", "--requests", "6",
                  "--max-tokens", "900", "--ignore-eos", "--timeout", "1", "--abandon", "0.5")
    assert len(recs) == 12
    first = [r.outcome for r in sorted(recs, key=lambda r: r.index) if r.scenario == "chat:16"]
    assert first == ["timeout", "abandoned"] * 3
    burst = [r for r in recs if r.scenario != "chat:16"]
    refused = [r for r in burst if r.outcome == "refused"]
    assert len(refused) >= 1
    assert {(r.status, r.code) for r in refused} == {(429, "rate_limit_exceeded")}
    assert all(r.reason for r in refused)
    assert {r.outcome for r in burst} - {"refused", "timeout", "abandoned"} == set()
    # every reservation came back
    wait_for(lambda: (m := ops.model("ob", "slow"))["in_flight"] == 0 and m["queued"] == 0
             and m["bar"]["reserved"] + m["bar"]["used"] == 0, timeout=20)


def _itl_metric(metrics_address: str, model: str) -> tuple[float, float]:
    text = httpx2.get(f"http://{metrics_address}/metrics", timeout=10).text
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.labels.get("model") == model
           and s.name.startswith("helexa_inter_token_latency_seconds_")}
    return got["helexa_inter_token_latency_seconds_sum"], got[
        "helexa_inter_token_latency_seconds_count"]


def test_itl_per_token_agrees_with_the_neurons_own_figure(ops, tmp_path):
    ob = ops.neurons["ob"]
    s0, n0 = _itl_metric(ob.metrics_address, "slow")
    recs = _bench(ops, tmp_path, "itl", "--model", "slow", "--scenario", "chat:16",
                  "--requests", "3", "--max-tokens", "200", "--ignore-eos")
    s1, n1 = _itl_metric(ob.metrics_address, "slow")
    assert [r.outcome for r in recs] == ["ok"] * 3
    assert all(r.completion_tokens == 200 for r in recs)
    gaps = [g for r in recs for g in r.itl()]
    assert len(gaps) == 3 * 199  # one per token after the first, however chunks grouped them
    bench_ms = 1000 * sum(gaps) / len(gaps)
    server_ms = 1000 * (s1 - s0) / (n1 - n0)
    assert abs(bench_ms - server_ms) <= 0.1 * server_ms, (bench_ms, server_ms)
    # and with the stream's own span: (E2E - TTFT) over the tokens after the first
    span_ms = 1000 * sum(r.chunks[-1][0] - r.ttft for r in recs) / len(gaps)
    assert abs(bench_ms - span_ms) <= 0.1 * span_ms


def test_sweep_finds_the_knee_and_the_report_renders(ops, tmp_path, chromium):
    # one request's decode time on `slow`, to set a bound the queueing must cross
    probe = _bench(ops, tmp_path, "probe", "--model", "slow", "--scenario", "chat:16",
                   "--requests", "1", "--max-tokens", "100", "--ignore-eos")[0]
    per_token = (probe.chunks[-1][0] - probe.ttft) / 99
    # The bound sits between the two regimes, far from both, so a loaded machine's drift
    # between probe and sweep cannot move the knee: at concurrency 1 a TTFT is a 16-token
    # prefill (a few token-times); from 2 on one request waits for another's 150-token decode.
    # 0.15 x 150 = 22.5 token-times tolerates a sweep 6x slower than the probe.
    bound_ms = 1000 * 0.15 * 150 * per_token
    out = tmp_path / "sweep.jsonl"
    main(["--url", f"helexa={ops.url}", "--out", str(out), "--no-progress", "--api-key",
          ops.keys["bench"], "--model", "slow", "--scenario", "chat:16,sweep:3", "--requests", "4",
          "--max-tokens", "150", "--ignore-eos", "--ttft-bound-ms", f"{bound_ms:.1f}",
          "--json"])
    recs = _records(out)
    assert {r.concurrency for r in recs} == {1, 2, 3}
    assert all(r.outcome == "ok" for r in recs)
    rows = [summarise(rs) for rs in group(recs).values()]
    found = knees(rows, bound_ms)
    # one in flight at a time on `slow`: from 2 on, a request waits for another's decode
    assert [(k["sweep"], k["knee"]) for k in found] == [("chat:16,sweep:3", 2)], rows

    written = report([out], tmp_path / "report")
    assert sorted(p.name for p in written) == ["concurrency.png", "index.html", "itl.png",
                                               "ttft.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    browser = Browser(chromium)
    try:
        page = browser.open((tmp_path / "report" / "index.html").as_uri())
        loaded = wait_for(lambda: page.eval(
            "document.readyState === 'complete' && [...document.images].map("
            "i => i.complete && i.naturalWidth > 0)"), timeout=20)
        assert loaded == [True, True, True]
        assert "knee at concurrency 2" in page.eval("document.body.textContent")
    finally:
        browser.close()


def test_without_a_tokenizer_estimates_learn_from_the_servers_counts(ops, tmp_path):
    recs = _bench(ops, tmp_path, "estimate", "--model", "tiny", "--scenario", "chat:300",
                  "--requests", "4", "--max-tokens", "2")
    assert [r.outcome for r in recs] == ["ok"] * 4
    # the first is a guess; after one answer the estimate is close to what was asked
    assert all(abs(r.prompt_tokens - 300) <= 0.1 * 300 for r in recs[1:]), \
        [r.prompt_tokens for r in recs]
