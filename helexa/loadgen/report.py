"""`helexa bench report RUN.jsonl...`: plots of bench runs, as PNGs and one HTML page.

Writes to `--out DIR` (default: beside the first run, `<name>-report/`):

- `ttft.png`, `itl.png`: the distributions (empirical CDFs) of TTFT and of
  per-token inter-token latency, one line per endpoint (and run);
- `concurrency.png`: output tokens a second and p99 TTFT against
  concurrency, per endpoint, with each sweep's knee marked (where p99 TTFT
  crosses the run's `--ttft-bound-ms`);
- `index.html`: the summary table and the images, embedded as data URIs so
  the one file can be mailed or attached alone.

matplotlib is the `plots` extra (`pip install 'helexa[plots]'`).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from pathlib import Path
from typing import Any

from helexa.loadgen.request import Record
from helexa.loadgen.stats import COLUMNS, group, knees, summarise, sweep_name


def load(paths: list[Path]) -> tuple[list[Record], float]:
    """Records of these runs (endpoints prefixed with the run's name when several), and the
    TTFT bound the first run used for its knee."""
    records: list[Record] = []
    bound = 1000.0
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            if "run" in obj:
                bound = obj["run"].get("ttft_bound_ms", bound) if path == paths[0] else bound
                continue
            rec = Record(**obj)
            if len(paths) > 1:
                rec.endpoint = f"{path.stem}:{rec.endpoint}"
            records.append(rec)
    return records, bound


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("helexa bench report: needs matplotlib: "
                         "pip install 'helexa[plots]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax: Any, xs: list[float], label: str) -> None:
    xs = sorted(xs)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_distributions(records: list[Record], out: Path) -> list[Path]:
    plt = _pyplot()
    by_ep: dict[str, list[Record]] = {}
    for r in records:
        by_ep.setdefault(r.endpoint, []).append(r)
    written = []
    for name, title, values in (
            ("ttft.png", "Time to first token", lambda rs: [r.ttft * 1000 for r in rs
                                                            if r.ttft is not None]),
            ("itl.png", "Inter-token latency, per token", lambda rs: [
                g * 1000 for r in rs if r.outcome == "ok" for g in r.itl()])):
        fig, ax = plt.subplots(figsize=(7, 4))
        for ep, rs in by_ep.items():
            _cdf(ax, values(rs), ep)
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests" if name == "ttft.png" else "share of tokens")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written


def plot_concurrency(rows: list[dict[str, Any]], found: list[dict[str, Any]], out: Path
                     ) -> Path:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("concurrency"):
            name = sweep_name(r["scenario"]) or r["scenario"]
            series.setdefault(f"{r['endpoint']} {name}", []).append(r)
    for label, rs in series.items():
        rs.sort(key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        top.plot(xs, [r["output_tok_per_s"] or 0 for r in rs], marker="o", label=label)
        bottom.plot(xs, [r["ttft_p99_ms"] or float("nan") for r in rs], marker="o", label=label)
    for k in found:
        if k["knee"]:
            bottom.axvline(k["knee"], color="red", linestyle="--", alpha=0.6)
            bottom.annotate(f"knee {k['endpoint']} @ {k['knee']}", (k["knee"], k["ttft_p99_ms"]),
                            fontsize=8, color="red")
    if found:
        bottom.axhline(found[0]["bound_ms"], color="grey", linestyle=":", label="TTFT bound")
    top.set_ylabel("output tokens / s")
    bottom.set_ylabel("p99 TTFT, ms")
    bottom.set_xlabel("concurrency")
    top.set_title("Throughput and p99 TTFT against concurrency")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=100)
    plt.close(fig)
    return out / "concurrency.png"


def write_html(rows: list[dict[str, Any]], found: list[dict[str, Any]], images: list[Path],
               runs: list[Path], out: Path) -> Path:
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in COLUMNS)

    def cell(v: Any) -> str:
        if isinstance(v, dict):
            v = ", ".join(f"{k}: {n}" for k, n in v.items()) or "0"
        return html.escape("-" if v is None else str(v))
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for _, k in COLUMNS) + "</tr>"
                   for r in rows)
    knee_lines = "".join(
        f"<li>{html.escape(k['sweep'])} on {html.escape(k['endpoint'])}: "
        + (f"knee at concurrency {k['knee']} (p99 TTFT {k['ttft_p99_ms']} ms &gt; "
           f"{k['bound_ms']} ms)" if k["knee"] else
           f"no knee up to concurrency {k['max_concurrency']}") + "</li>" for k in found)
    imgs = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{p.name}</figcaption>'
        f"</figure>" for p in images)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>helexa bench report</title>
<style>body{{font:14px system-ui,sans-serif;margin:16px}}table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ddd;padding:2px 8px;text-align:right}}
img{{max-width:100%}}figure{{margin:16px 0}}.wide{{overflow-x:auto}}</style></head>
<body><h1>helexa bench report</h1>
<p>runs: {html.escape(", ".join(p.name for p in runs))}; latencies in ms</p>
<div class="wide"><table><tr>{head}</tr>{body}</table></div>
<ul>{knee_lines}</ul>{imgs}</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


def report(paths: list[Path], out: Path) -> list[Path]:
    records, bound = load(paths)
    if not records:
        raise SystemExit(f"helexa bench report: no request records in {', '.join(map(str, paths))}")
    out.mkdir(parents=True, exist_ok=True)
    rows = [summarise(rs) for rs in group(records).values()]
    found = knees(rows, bound)
    images = plot_distributions(records, out)
    images.append(plot_concurrency(rows, found, out))
    return [*images, write_html(rows, found, images, paths, out)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="helexa bench report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="JSONL files written by helexa bench --out")
    p.add_argument("--out", type=Path, help="folder for the PNGs and index.html")
    args = p.parse_args(argv)
    out = args.out or args.runs[0].with_name(args.runs[0].stem + "-report")
    try:
        written = report(args.runs, out)
    except OSError as e:
        print(f"helexa bench report: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
