"""`helexa journal concurrency --plot FILE.png`: the in-flight count over time, drawn.

Two panels: the in-flight count of each model as a step line over the log's
window, and the share of busy time spent at each count (the table of
`format_report`, as bars). matplotlib is the `plots` extra.
"""

from __future__ import annotations

from helexa.cli.journal import Journal, Stats, micros


def in_flight_series(s: Stats) -> list[tuple[int, int]]:
    """(microseconds, in-flight count from then on) at every change, from the paired spans."""
    s.edges.sort()
    out: list[tuple[int, int]] = []
    count = 0
    for e in s.edges:
        count += 1 if e & 1 else -1
        t = e >> 1
        if out and out[-1][0] == t:
            out[-1] = (t, count)
        else:
            out.append((t, count))
    return out


def plot(j: Journal, path: str, model: str | None = None) -> None:
    """In flight over time (a step line per model) and the share of busy time at each count."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("helexa journal --plot: needs matplotlib: "
                         "pip install 'helexa[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [model] if model else sorted(j.models)
    fig, (ax, dist) = plt.subplots(2, 1, figsize=(8, 6))
    origin = micros(j.first_ts) if j.first_ts else 0
    for name in names:
        series = in_flight_series(j.models[name]) if name in j.models else []
        if series:
            ax.step([(t - origin) / 1e6 for t, _ in series], [c for _, c in series],
                    where="post", label=name)
    ax.set_xlabel(f"seconds since {j.first_ts.isoformat() if j.first_ts else 'start'}")
    ax.set_ylabel("in flight")
    ax.set_title(f"requests in flight ({j.component})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    stats = j.total() if model is None else j.models.get(model, Stats())
    held = stats.in_flight_micros()
    busy = sum(held.values()) or 1
    dist.bar(list(held), [100 * us / busy for us in held.values()])
    dist.set_xlabel("in flight")
    dist.set_ylabel("% of busy time")
    dist.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
