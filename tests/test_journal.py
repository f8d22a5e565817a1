"""`helexa journal concurrency` on a generated log whose answer is worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helexa.cli.journal import main

A, B = "Qwen/Qwen3-8B", "tiny/b"


def _ts(minute: float) -> str:
    """Minutes after 08:00 UTC as structlog's TimeStamper writes them."""
    secs = int(minute * 60)
    return f"2026-11-30T{8 + secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}.000000Z"


def _line(minute: float, event: str, component: str = "neuron", **kw) -> str:
    return json.dumps({"event": event, "component": component, "level": "info", **kw,
                       "ts": _ts(minute)})


def _span(req: str, model: str, who: str, start: float | None, end: float | None,
          end_event: str = "request.done", **end_kw) -> list[tuple[float, str]]:
    ids = {"req_id": req, "model": model, "principal": who}
    out = []
    if start is not None:
        out.append((start, _line(start, "request.start", **ids)))
    if end is not None:
        if end_event == "request.done":
            end_kw = {"finish_reason": "stop", "client_gone": False, "tokens": 12, **end_kw}
        out.append((end, _line(end, end_event, **ids, **end_kw)))
    return out


def generate_log() -> str:
    """Two hours of neuron log (08:00–10:00) with router noise and non-JSON lines.

    Model A spans (minutes): a1 [10,40] finished, a2 [20,30] client gone,
    a3 [25,50] finish_reason error, a4 [60,60] rejected 429, a5 [60,66]
    rejected overloaded, a6 starts at 110 (no end), a0 ends at 5 (no start),
    a7 is refused at 70 before it starts (no span, not a window edge), a
    duplicate of a1's req_id is refused at 15 (a1 still ends at 40);
    bench [15,75] is a load generator. Model B: b1 [90,105], b2 starts at 100
    (no end; would make B's peak 2 if unpaired starts counted).
    """
    events: list[tuple[float, str]] = [
        (0, _line(0, "neuron.ready")),
        (120, _line(120, "watch.heartbeat")),
    ]
    events += _span("a1", A, "alice", 10, 40)
    events += _span("a2", A, "bob", 20, 30, client_gone=True, finish_reason="abort")
    events += _span("a3", A, "alice", 25, 50, finish_reason="error")
    events += _span("a4", A, "carol", 60, 60, "request.rejected", code="rate_limit_exceeded")
    events += _span("a5", A, "carol", 60, 66, "request.rejected", code="overloaded")
    events += _span("a6", A, "alice", 110, None)
    events += _span("a0", A, "alice", None, 5)
    events += _span("bench-1", A, "bench", 15, 75)
    events += _span("a7", A, "bob", None, 70, "request.rejected", code="context_length_exceeded")
    # a second call reusing a1's req_id while a1 runs is refused; a1 goes on
    events += _span("a1", A, "mallory", None, 15, "request.rejected", code="invalid_request_error")
    events += _span("b1", B, "alice", 90, 105)
    events += _span("b2", B, "bob", 100, None)
    # the router logs the same req_ids with its own times: never paired with the neuron's
    # (and says a client left with outcome="client_gone", as helexa/router/serve.py logs it)
    router = {"component": "router", "req_id": "a1", "model": A, "principal": "alice"}
    events += [(1.5, _line(1.5, "request.start", **router)),
               (100.5, _line(100.5, "request.done", **router, outcome="client_gone"))]
    events.sort(key=lambda e: e[0])
    lines = [line for _, line in events]
    lines.insert(3, "-- Boot 0123456789abcdef --")
    lines.insert(5, "Traceback (most recent call last):")
    # a `journalctl` short-format prefix before the JSON object
    lines[7] = "Nov 30 08:20:00 gpu-1 helexa[812]: " + lines[7]
    return "\n".join(lines) + "\n"


EXPECTED_EXCLUDING_BENCH = """\
journal concurrency: component neuron, 25 lines, 21 JSON lines of neuron
window 2026-11-30T08:00:00Z to 2026-11-30T10:00:00Z: 2.000 h
excluding principals: bench

all models
  spans: 6 paired, 3 unpaired, 1 excluded
    paired: 2 finished, 1 client gone, 3 error (1 finish_reason error; 2 rejected: overloaded 1, rate_limit_exceeded 1)
    unpaired (window edge): 2 start without end, 1 end without start
  refused before start (no span): 2: context_length_exceeded 1, invalid_request_error 1
  utilisation: 1.017 busy h / 2.000 wall h = 50.8%
  in flight over busy time: peak 3, mean 1.41
    in flight   busy h    share   cumulative
            1    0.683    67.2%        67.2%
            2    0.250    24.6%        91.8%
            3    0.083     8.2%       100.0%

model Qwen/Qwen3-8B
  spans: 5 paired, 2 unpaired, 1 excluded
    paired: 1 finished, 1 client gone, 3 error (1 finish_reason error; 2 rejected: overloaded 1, rate_limit_exceeded 1)
    unpaired (window edge): 1 start without end, 1 end without start
  refused before start (no span): 2: context_length_exceeded 1, invalid_request_error 1
  utilisation: 0.767 busy h / 2.000 wall h = 38.3%
  in flight over busy time: peak 3, mean 1.54
    in flight   busy h    share   cumulative
            1    0.433    56.5%        56.5%
            2    0.250    32.6%        89.1%
            3    0.083    10.9%       100.0%

model tiny/b
  spans: 1 paired, 1 unpaired
    paired: 1 finished, 0 client gone, 0 error
    unpaired (window edge): 1 start without end, 0 end without start
  utilisation: 0.250 busy h / 2.000 wall h = 12.5%
  in flight over busy time: peak 1, mean 1.00
    in flight   busy h    share   cumulative
            1    0.250   100.0%       100.0%
"""


@pytest.fixture
def log_file(tmp_path: Path) -> Path:
    p = tmp_path / "neuron.log"
    p.write_text(generate_log())
    return p


def test_report_excluding_bench_is_the_worked_answer(log_file: Path, capsys) -> None:
    assert main(["concurrency", str(log_file), "--exclude-principal", "bench"]) == 0
    assert capsys.readouterr().out == EXPECTED_EXCLUDING_BENCH


def test_bench_principal_counts_when_not_excluded(log_file: Path, capsys) -> None:
    # bench [15,75] overlaps a1..a3 (peak 4) and bridges the idle gap 50..60
    assert main(["concurrency", str(log_file), "--model", A]) == 0
    out = capsys.readouterr().out
    assert "model tiny/b" not in out and "all models" not in out
    assert "  spans: 6 paired, 2 unpaired\n" in out
    assert "  utilisation: 1.083 busy h / 2.000 wall h = 54.2%\n" in out
    assert "  in flight over busy time: peak 4, mean 2.02\n" in out


def test_stdin_and_router_component(log_file: Path) -> None:
    # `journalctl -o cat -u helexa-router | helexa journal concurrency --component router`
    done = subprocess.run(
        [sys.executable, "-m", "helexa.cli", "journal", "concurrency", "-", "--component", "router"],
        input=log_file.read_bytes(), capture_output=True, check=True)
    out = done.stdout.decode()
    assert "journal concurrency: component router, 25 lines, 2 JSON lines of router\n" in out
    assert "  spans: 1 paired, 0 unpaired\n" in out
    assert "    paired: 0 finished, 1 client gone, 0 error\n" in out
    assert "  utilisation: 1.650 busy h / 1.650 wall h = 100.0%\n" in out


def test_empty_input_says_so(tmp_path: Path, capsys) -> None:
    p = tmp_path / "empty.log"
    p.write_text("not json\n")
    assert main(["concurrency", str(p)]) == 0
    assert "no timestamped lines: nothing to report" in capsys.readouterr().out


def test_a_log_shorter_than_an_hour_is_reported_in_seconds(tmp_path: Path, capsys) -> None:
    lines = [line for _, line in sorted(_span("x", A, "alice", 0, 1) + _span("y", A, "bob", 0.5, 1.5))]
    p = tmp_path / "short.log"
    p.write_text("\n".join(lines) + "\n")
    assert main(["concurrency", str(p), "--model", A]) == 0
    out = capsys.readouterr().out
    assert "window 2026-11-30T08:00:00Z to 2026-11-30T08:01:30Z: 90.000 s\n" in out
    assert "  utilisation: 90.000 busy s / 90.000 wall s = 100.0%\n" in out
    assert ("    in flight   busy s    share   cumulative\n"
            "            1   60.000    66.7%        66.7%\n"
            "            2   30.000    33.3%       100.0%\n") in out


def test_router_rejections_after_start_end_their_span(tmp_path: Path, capsys) -> None:
    # The router logs request.start before any neuron checks the request, so a neuron's
    # context_length_exceeded (or a model_not_found from selection) comes after it. Those
    # requests have ended; they must not be reported as never ending.
    r = {"component": "router", "model": A, "principal": "alice"}
    lines = [_line(0, "request.start", req_id="r1", **r),
             _line(0.5, "request.rejected", req_id="r1", code="context_length_exceeded", **r),
             _line(1, "request.start", req_id="r2", **r),
             _line(2, "request.done", req_id="r2", finish=["stop"], client_gone=False, **r),
             _line(3, "request.rejected", req_id="r3", code="invalid_api_key", **r)]
    p = tmp_path / "router.log"
    p.write_text("\n".join(lines) + "\n")
    assert main(["concurrency", str(p), "--component", "router", "--model", A]) == 0
    out = capsys.readouterr().out
    assert "  spans: 2 paired, 0 unpaired\n" in out
    assert ("    paired: 1 finished, 0 client gone, 1 error"
            " (1 rejected: context_length_exceeded 1)\n") in out
    assert "  refused before start (no span): 1: invalid_api_key 1\n" in out


def test_plot_draws_in_flight_over_time(log_file: Path, tmp_path: Path, capsys) -> None:
    png = tmp_path / "inflight.png"
    assert main(["concurrency", str(log_file), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"plot: {png}" in capsys.readouterr().out
