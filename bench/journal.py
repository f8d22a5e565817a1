"""Lines per second of `helexa journal concurrency` on a generated million-line log.

    .venv/bin/python bench/journal.py [--lines 1000000] [--repeat 3]

The log is written to a temporary file first (not timed): neuron request spans
over a few models and principals with about a fifth non-request lines
(heartbeats, router lines, non-JSON noise), as `journalctl -o cat` would give.
Timed: reading the file, decoding, pairing, the sweep and formatting — all of
what the command does. Prints the medians of the repeats, wall and CPU time.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from helexa.cli.journal import Journal, _read_lines, format_report

MODELS = ["Qwen/Qwen3-8B", "Qwen/Qwen3-32B", "meta-llama/Llama-3.1-8B-Instruct"]
PRINCIPALS = ["alice", "bob", "carol", "bench", "ci"]


def generate(path: Path, n_lines: int, seed: int = 0) -> int:
    """Write about n_lines lines; returns how many were written."""
    rng = random.Random(seed)
    t0 = datetime(2026, 11, 30, tzinfo=UTC)
    open_reqs: list[tuple[float, str]] = []  # (end time in s, end line) waiting to be written
    n = req = 0
    t = 0.0
    with path.open("w") as f:
        while n < n_lines:
            t += rng.expovariate(20.0)  # ~20 events per second
            while open_reqs and open_reqs[0][0] <= t:
                f.write(heapq.heappop(open_reqs)[1])
                n += 1
            ts = (t0 + timedelta(seconds=t)).isoformat().replace("+00:00", "Z")
            r = rng.random()
            if r < 0.1:
                f.write(json.dumps({"event": "watch.heartbeat", "component": "neuron",
                                    "level": "debug", "ts": ts}) + "\n")
            elif r < 0.15:
                f.write(json.dumps({"event": "request.start", "component": "router", "req_id": f"r{req}",
                                    "model": "helexa/balanced", "principal": "alice",
                                    "level": "info", "ts": ts}) + "\n")
            elif r < 0.18:
                f.write("Nov 30 00:00:00 gpu-1 systemd[1]: some unit message\n")
            else:
                req += 1
                ids = {"req_id": f"{req:016x}", "model": rng.choice(MODELS),
                       "principal": rng.choice(PRINCIPALS)}
                f.write(json.dumps({"event": "request.start", "component": "neuron", **ids,
                                    "level": "info", "ts": ts}) + "\n")
                end = t + rng.expovariate(0.2)
                end_ts = (t0 + timedelta(seconds=end)).isoformat().replace("+00:00", "Z")
                if rng.random() < 0.05:
                    body = {"event": "request.rejected", "code": "overloaded"}
                else:
                    body = {"event": "request.done", "finish_reason": "stop",
                            "client_gone": rng.random() < 0.02, "tokens": rng.randint(1, 2000)}
                line = json.dumps({**body, "component": "neuron", **ids, "level": "info",
                                   "ts": end_ts}) + "\n"
                heapq.heappush(open_reqs, (end, line))
            n += 1
    return n


def run_once(path: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, lines) of one full report."""
    wall, cpu = time.perf_counter(), time.process_time()
    lines = _read_lines(str(path))
    j = Journal(component="neuron", exclude=frozenset({"bench"}))
    j.read(lines)
    format_report(j)
    return time.perf_counter() - wall, time.process_time() - cpu, len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.log"
        generate(path, args.lines)
        size_mb = path.stat().st_size / 2**20
        walls, cpus = [], []
        for _ in range(args.repeat):
            wall, cpu, n = run_once(path)
            walls.append(wall)
            cpus.append(cpu)
    # CPU time as well as wall time: on a shared machine the wall figure mostly
    # measures the neighbours
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(f"journal concurrency: {n:,} lines ({size_mb:.0f} MiB), median of {args.repeat}:"
          f" wall {wall:.2f} s = {n / wall:,.0f} lines/s;"
          f" CPU {cpu:.2f} s = {n / cpu:,.0f} lines per CPU second")


if __name__ == "__main__":
    main()
