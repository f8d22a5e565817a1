"""Figures from bench records: percentiles, goodput, the knee of a sweep, the summary table.

Percentiles are nearest-rank over the requests that produced the figure
(TTFT: requests with a first token; ITL: every token after the first, a
chunk of k tokens after a gap g counting as k gaps of g/k). Goodput is
requests a second that ended `ok` and met the SLOs given (`--slo-ttft-ms`,
`--slo-itl-ms`: the request's p99 ITL), over the scenario's wall time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from helexa.loadgen.request import Record

OUTCOMES = ("ok", "refused", "upstream_error", "timeout", "abandoned", "disconnected", "error",
            "interrupted")


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def summarise(records: list[Record], slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict[str, Any]:
    """One row of figures for these records (one endpoint, one scenario or sweep level)."""
    outcomes = Counter(r.outcome for r in records)
    refused = Counter(r.code or str(r.status) for r in records
                      if r.outcome in ("refused", "upstream_error"))
    ok = [r for r in records if r.outcome == "ok"]
    ttft = [r.ttft for r in records if r.ttft is not None]
    itl = [g for r in ok for g in r.itl()]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    if records:
        start = min(r.t_sent for r in records)
        end = max(r.t_sent + (r.e2e or 0.0) for r in records)
        wall = max(end - start, 1e-9)
    else:
        wall = 0.0
    out_tokens = sum(r.output_tokens for r in ok)

    def meets(r: Record) -> bool:
        if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
            return False
        p99 = pct(r.itl(), 0.99)
        return slo_itl_ms is None or p99 is None or p99 * 1000 <= slo_itl_ms
    good = sum(1 for r in ok if meets(r))
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    first = records[0] if records else None
    row: dict[str, Any] = {
        "endpoint": first.endpoint if first else None,
        "scenario": first.scenario if first else None,
        "concurrency": first.concurrency if first else None,
        "rate": first.rate if first else None,
        "requests": len(records), **{o: outcomes.get(o, 0) for o in OUTCOMES},
        "refusal_codes": dict(sorted(refused.items())),
        "prompt_tokens_asked": first.prompt_tokens_asked if first else None,
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "cached_tokens_mean": round(sum(cached) / len(cached), 1) if cached else None,
        "output_tokens": out_tokens,
        "wall_secs": round(wall, 3),
        "req_per_s": round(len(ok) / wall, 3) if wall else None,
        "output_tok_per_s": round(out_tokens / wall, 2) if wall else None,
        "goodput_req_per_s": round(good / wall, 3) if wall else None,
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = _ms(pct(xs, q / 100))
    row["itl_mean_ms"] = _ms(sum(itl) / len(itl)) if itl else None
    return row


def group(records: Iterable[Record]) -> dict[tuple[str, str], list[Record]]:
    """Records by (scenario, endpoint), in the order first seen."""
    out: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        out.setdefault((r.scenario, r.endpoint), []).append(r)
    return out


def knee(rows: list[dict[str, Any]], bound_ms: float) -> dict[str, Any] | None:
    """The first concurrency (rows of one endpoint's sweep) whose p99 TTFT is over bound_ms."""
    levels = sorted((r for r in rows if r.get("concurrency")), key=lambda r: r["concurrency"])
    for r in levels:
        if r["ttft_p99_ms"] is not None and r["ttft_p99_ms"] > bound_ms:
            return {"endpoint": r["endpoint"], "concurrency": r["concurrency"],
                    "ttft_p99_ms": r["ttft_p99_ms"], "bound_ms": bound_ms}
    return None


def sweep_name(scenario: str) -> str | None:
    """`chat:64,sweep:8@4` -> `chat:64,sweep:8` (None for a scenario that is not a sweep level)."""
    base, at, level = scenario.rpartition("@")
    return base if at and level.isdigit() else None


def knees(rows: list[dict[str, Any]], bound_ms: float) -> list[dict[str, Any]]:
    """Per (sweep, endpoint): the knee, or the highest level reached without one."""
    out = []
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        name = sweep_name(r["scenario"] or "")
        if name is not None:
            seen.setdefault((name, r["endpoint"]), []).append(r)
    for (name, ep), levels in seen.items():
        k = knee(levels, bound_ms)
        top = max(x["concurrency"] for x in levels)
        out.append({"sweep": name, "endpoint": ep, "knee": k["concurrency"] if k else None,
                    "ttft_p99_ms": k["ttft_p99_ms"] if k else None, "bound_ms": bound_ms,
                    "max_concurrency": top})
    return out


COLUMNS = [("endpoint", "endpoint"), ("scenario", "scenario"), ("n", "requests"), ("ok", "ok"),
           ("refused", "refusal_codes"), ("t/o", "timeout"), ("aband", "abandoned"),
           ("disc", "disconnected"), ("err", "error"), ("prompt", "prompt_tokens_mean"),
           ("ttft p50", "ttft_p50_ms"), ("p90", "ttft_p90_ms"), ("p99", "ttft_p99_ms"),
           ("itl p50", "itl_p50_ms"), ("p90", "itl_p90_ms"), ("p99", "itl_p99_ms"),
           ("e2e p50", "e2e_p50_ms"), ("p99", "e2e_p99_ms"), ("tok/s", "output_tok_per_s"),
           ("req/s", "req_per_s"), ("goodput", "goodput_req_per_s")]


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as aligned text (latencies in ms)."""
    def cell(v: Any) -> str:
        if isinstance(v, dict):
            return ",".join(f"{k}:{n}" for k, n in v.items()) or "0"
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
    grid = [[h for h, _ in COLUMNS]] + [[cell(r.get(k)) for _, k in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in grid)
