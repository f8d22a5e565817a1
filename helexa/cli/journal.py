"""`helexa journal concurrency`: how busy the daemons were, read from their JSON logs.

The daemons log one JSON object per line (helexa/log.py); a request is a span
from `request.start` to `request.done` or `request.rejected`, keyed by
(`component`, `req_id`). This module pairs those spans and reports, overall and
per model: how many paired and why the unpaired ones are (window edge), how
the paired ones ended (finished, client gone, error), utilisation (busy hours
over wall hours, busy = at least one request in flight) and how the in-flight
count is distributed over the busy time. Only paired spans enter the sweep, so
a start whose end fell outside the log never inflates the peak.

Input is a file, stdin, or `journalctl -o cat` output; lines that are not JSON
objects are skipped (a `journalctl` prefix before the `{` is tolerated).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated

import msgspec

_US_PER_HOUR = 3_600_000_000
_START, _DONE, _REJECTED = "request.start", "request.done", "request.rejected"
# Codes the neuron only gives before its `request.start` (checks of the request itself),
# never after it is handed to the engine. Not so for the router, which logs its start
# before the neuron checks anything.
_PRE_START_CODES = frozenset({"invalid_request_error", "context_length_exceeded", "model_not_found"})


class LogLine(msgspec.Struct):
    """The fields of a log line this report reads; the rest are ignored."""

    event: str = ""
    ts: Annotated[datetime, msgspec.Meta(tz=True)] | None = None  # naive stamps: line skipped
    component: str | None = None
    req_id: str | None = None
    model: str | None = None
    principal: str | None = None
    finish_reason: str | None = None
    client_gone: bool | None = None
    outcome: str | None = None  # the router's request.done says outcome="client_gone"
    code: str | None = None


_decode = msgspec.json.Decoder(LogLine).decode
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def micros(ts: datetime) -> int:
    """Microseconds since the epoch of an aware datetime."""
    d = ts - _EPOCH
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


@dataclass
class Stats:
    """Counts and concurrency of the spans of one model (or of all models)."""

    finished: int = 0
    client_gone: int = 0
    finish_error: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # rejected before request.start
    start_only: int = 0  # start seen, end outside the window
    end_only: int = 0  # end seen, start outside the window
    excluded: int = 0
    edges: list[int] = field(default_factory=list)  # 2*t+1 for a start, 2*t for an end

    @property
    def paired(self) -> int:
        return self.finished + self.client_gone + self.finish_error + sum(self.rejected.values())

    def in_flight_micros(self) -> dict[int, int]:
        """In-flight count -> microseconds spent at it (counts ≥ 1 only)."""
        # One sort of integers, then one sweep; an end at the same instant as
        # a start is applied first, so back-to-back requests do not overlap.
        self.edges.sort()
        held: dict[int, int] = defaultdict(int)
        count, last = 0, 0
        for e in self.edges:
            t = e >> 1
            if count > 0 and t > last:
                held[count] += t - last
            last = t
            count += 1 if e & 1 else -1
        return dict(held)


@dataclass
class Journal:
    """Spans paired from log lines: per model, for one component."""

    component: str = "neuron"
    exclude: frozenset[str] = frozenset()
    lines: int = 0
    json_lines: int = 0
    first_ts: datetime | None = None
    last_ts: datetime | None = None
    models: dict[str, Stats] = field(default_factory=dict)

    def read(self, lines: Iterable[bytes]) -> None:
        """Pair the spans of these lines (may be called again with more lines)."""
        open_spans: dict[str, tuple[int, str, str | None]] = {}  # req_id -> (t, model, principal)
        component, decode = self.component, _decode
        # Only a neuron refuses a call by its checks while another call with the same req_id
        # runs; the router makes its own ids and logs its rejections after request.start
        # (a neuron's context_length_exceeded), so there a rejection always ends its span.
        pre_start_rule = component == "neuron"
        first, last = self.first_ts, self.last_ts
        n = n_json = 0
        for raw in lines:  # the hot loop: decoding dominates (about 1 µs a line)
            n += 1
            if raw[:1] != b"{":
                i = raw.find(b"{")  # a `journalctl` prefix, or not JSON at all
                if i < 0:
                    continue
                raw = raw[i:]
            try:
                rec = decode(raw)
            except msgspec.DecodeError:
                continue
            ts = rec.ts
            if ts is None or rec.component != component:
                continue
            n_json += 1
            if first is None:
                first = last = ts
            elif ts < first:
                first = ts
            elif ts > last:
                last = ts
            ev = rec.event
            if ev == _START:
                if rec.req_id is None:
                    continue
                earlier = open_spans.get(rec.req_id)
                if earlier is not None:  # a repeated id: the earlier start never ended here
                    self._unpaired_start(earlier[1], earlier[2])
                open_spans[rec.req_id] = (micros(ts), rec.model or "(none)", rec.principal)
            elif ev == _DONE or ev == _REJECTED:
                if ev == _REJECTED and rec.code in _PRE_START_CODES and pre_start_rule:
                    # refused before its start line (e.g. a duplicate req_id while the
                    # first is served): it must not end the open span of that id
                    self._unpaired_end(rec)
                    continue
                begun = open_spans.pop(rec.req_id, None) if rec.req_id is not None else None
                if begun is None:
                    self._unpaired_end(rec)
                else:
                    self._paired(begun, micros(ts), rec)
        for _, model, principal in open_spans.values():
            self._unpaired_start(model, principal)
        self.lines += n
        self.json_lines += n_json
        self.first_ts, self.last_ts = first, last

    def _stats(self, model: str) -> Stats:
        s = self.models.get(model)
        if s is None:
            s = self.models[model] = Stats()
        return s

    def _unpaired_start(self, model: str, principal: str | None) -> None:
        s = self._stats(model)
        if principal in self.exclude:
            s.excluded += 1
        else:
            s.start_only += 1

    def _unpaired_end(self, rec: LogLine) -> None:
        s = self._stats(rec.model or "(none)")
        if rec.principal in self.exclude:
            s.excluded += 1
        elif rec.event == _REJECTED:  # refused on arrival (bad request, draining): no span
            s.refused[rec.code or "(no code)"] += 1
        else:
            s.end_only += 1

    def _paired(self, begun: tuple[int, str, str | None], t_end: int, rec: LogLine) -> None:
        t_start, model, principal = begun
        s = self._stats(model)
        if (principal or rec.principal) in self.exclude:
            s.excluded += 1
            return
        if rec.event == _REJECTED:
            s.rejected[rec.code or "(no code)"] += 1
        elif rec.client_gone or rec.outcome == "client_gone":
            s.client_gone += 1
        elif rec.finish_reason == "error":
            s.finish_error += 1
        else:
            s.finished += 1
        s.edges.append(2 * t_start + 1)
        s.edges.append(2 * max(t_end, t_start))

    def total(self) -> Stats:
        """All models together (the sweep runs over the union of their spans)."""
        out = Stats()
        for s in self.models.values():
            out.finished += s.finished
            out.client_gone += s.client_gone
            out.finish_error += s.finish_error
            out.rejected.update(s.rejected)
            out.refused.update(s.refused)
            out.start_only += s.start_only
            out.end_only += s.end_only
            out.excluded += s.excluded
            out.edges.extend(s.edges)
        return out


def _iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _unit(wall_us: int) -> tuple[str, int]:
    """Hours for a log of an hour or more; seconds for a shorter one (tests, short captures)."""
    return ("h", _US_PER_HOUR) if wall_us >= _US_PER_HOUR else ("s", 1_000_000)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def format_stats(title: str, s: Stats, wall_us: int) -> list[str]:
    """The report block of one model (or of all models)."""
    unit, scale = _unit(wall_us)
    unpaired = s.start_only + s.end_only
    n_err = s.finish_error + sum(s.rejected.values())
    head = f"  spans: {s.paired} paired, {unpaired} unpaired"
    if s.excluded:
        head += f", {s.excluded} excluded"
    out = [title, head]
    ends = f"    paired: {s.finished} finished, {s.client_gone} client gone, {n_err} error"
    if n_err:
        parts = [f"{s.finish_error} finish_reason error"] if s.finish_error else []
        if s.rejected:
            codes = ", ".join(f"{c} {k}" for c, k in sorted(s.rejected.items()))
            parts.append(f"{sum(s.rejected.values())} rejected: {codes}")
        ends += f" ({'; '.join(parts)})"
    out.append(ends)
    out.append(f"    unpaired (window edge): {s.start_only} start without end,"
               f" {s.end_only} end without start")
    if s.refused:
        codes = ", ".join(f"{c} {k}" for c, k in sorted(s.refused.items()))
        out.append(f"  refused before start (no span): {sum(s.refused.values())}: {codes}")
    held = s.in_flight_micros()
    busy = sum(held.values())
    out.append(f"  utilisation: {busy / scale:.3f} busy {unit} / {wall_us / scale:.3f} wall {unit}"
               f" = {_pct(busy, wall_us)}")
    if not busy:
        out.append("  in flight: never (no paired span with a duration)")
        return out
    mean = sum(k * us for k, us in held.items()) / busy
    out.append(f"  in flight over busy time: peak {max(held)}, mean {mean:.2f}")
    out.append(f"    in flight   busy {unit}    share   cumulative")
    cum = 0
    for k in sorted(held):
        cum += held[k]
        out.append(f"    {k:>9}  {held[k] / scale:>7.3f}  {_pct(held[k], busy):>7}  {_pct(cum, busy):>11}")
    return out


def format_report(j: Journal, model: str | None = None) -> str:
    """The whole report: header, all models together, then each model."""
    if j.first_ts is None or j.last_ts is None:
        out = [f"journal concurrency: component {j.component}, {j.lines} lines,"
               f" {j.json_lines} JSON lines of {j.component}",
               "no timestamped lines: nothing to report"]
        return "\n".join(out) + "\n"
    first_us, last_us = micros(j.first_ts), micros(j.last_ts)
    wall = last_us - first_us
    out = [f"journal concurrency: component {j.component}, {j.lines} lines,"
           f" {j.json_lines} JSON lines of {j.component}"]
    unit, scale = _unit(wall)
    out.append(f"window {_iso(first_us)} to {_iso(last_us)}: {wall / scale:.3f} {unit}")
    if j.exclude:
        out.append(f"excluding principals: {', '.join(sorted(j.exclude))}")
    names = sorted(j.models)
    if model is not None:
        if model not in j.models:
            out.append(f"\nmodel {model}: no request spans")
            return "\n".join(out) + "\n"
        names = [model]
    else:
        out.append("")
        out += format_stats("all models", j.total(), wall)
    for name in names:
        out.append("")
        out += format_stats(f"model {name}", j.models[name], wall)
    return "\n".join(out) + "\n"


def _read_lines(path: str) -> list[bytes]:
    data = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
    return data.splitlines()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="helexa journal", description="reports from the daemons' JSON logs")
    sub = ap.add_subparsers(dest="report", required=True)
    cc = sub.add_parser("concurrency", help="request spans, utilisation and in-flight distribution")
    cc.add_argument("file", nargs="?", default="-",
                    help="log file (JSON lines, or `journalctl -o cat` output); - = stdin")
    cc.add_argument("--component", default="neuron", help="whose spans to pair (default neuron)")
    cc.add_argument("--model", help="report this model only")
    cc.add_argument("--exclude-principal", action="append", default=[], metavar="P",
                    help="leave out this principal's requests (repeatable), e.g. bench")
    cc.add_argument("--plot", metavar="FILE.png",
                    help="also draw in flight over time and its distribution (matplotlib)")
    args = ap.parse_args(argv)
    try:
        lines = _read_lines(args.file)
    except OSError as e:
        print(f"helexa journal: {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    j = Journal(component=args.component, exclude=frozenset(args.exclude_principal))
    j.read(lines)
    sys.stdout.write(format_report(j, args.model))
    if args.plot:
        from helexa.cli.journal_plot import plot  # matplotlib: only when asked
        plot(j, args.plot, args.model)
        print(f"plot: {args.plot}")
    return 0
