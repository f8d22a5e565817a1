"""`GET /status` (a page for people) and `GET /status.json` (the same data, for scripts).

Both read only the router's soft state: each neuron link's last Watch report
(registry.py) and the router's own counters (metrics.py). Nothing here asks a
neuron anything, so a status poll costs one JSON render. The page
(`status.html`, shipped as package data) is one HTML file with a small
script and no build step; it polls `/status.json` about once a second.

Auth: `/status.json` asks for the same key as the API when `auth.require_auth`
is on. The page itself holds no data (it is the same static file for
everyone); its script sends the key it was given in the URL fragment
(`/status#key=sk-...`, which browsers never send to a server) or typed into
its form, as `Authorization: Bearer`.

Refusals over the last minutes: the router counts what it sees (neuron
refusals by code, `helexa_router_refusals_total`, and its answers by HTTP
status, `helexa_router_requests_total`); a sampler keeps snapshots of those
counters so a window is a subtraction, with no hook in the request path.
The data's fields are listed in docs/operating.md ("The status page").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

from aiohttp import web
from google.protobuf.message import Message
from prometheus_client import Counter, Gauge

from helexa import __version__
from helexa.proto import neuron_pb2 as pb
from helexa.router.registry import NeuronLink, Registry

REFUSAL_WINDOW_SECS = 300.0  # "the last minutes" of the page
SAMPLE_EVERY_SECS = 5.0
_STATES = {v.number: v.name.removeprefix("MODEL_STATE_").lower()
           for v in pb.ModelState.DESCRIPTOR.values}
_PAGE = resources.files("helexa.router").joinpath("status.html")

Counts = dict[tuple[str, ...], float]


def counter_values(counter: Counter) -> Counts:
    """{label values: count} of a labelled prometheus Counter (its `_total` samples)."""
    out: Counts = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[tuple(s.labels.values())] = s.value
    return out


def gauge_value(gauge: Gauge) -> float:
    """The value of an unlabelled prometheus Gauge."""
    return next(s.value for family in gauge.collect() for s in family.samples)


class CounterWindow:
    """Snapshots of one counter over time, so "how many in the last N seconds" is a subtraction.

    The first snapshot is taken at creation, when the router's counters are zero, so before a
    window's worth of history exists the answer is exact since start."""

    def __init__(self, counter: Counter, keep_secs: float = REFUSAL_WINDOW_SECS) -> None:
        self.counter = counter
        self.keep_secs = keep_secs
        self.snapshots: deque[tuple[float, Counts]] = deque()
        self.sample()

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.snapshots.append((now, counter_values(self.counter)))
        # Keep one snapshot at or before the window's start: the base of the subtraction.
        while len(self.snapshots) > 1 and self.snapshots[1][0] <= now - self.keep_secs:
            self.snapshots.popleft()

    def recent(self, now: float | None = None) -> tuple[float, Counts]:
        """(seconds actually covered, {labels: count in that time}) ending now."""
        now = time.monotonic() if now is None else now
        base_t, base = self.snapshots[0]
        for t, snap in self.snapshots:
            if t > now - self.keep_secs:
                break
            base_t, base = t, snap
        current = counter_values(self.counter)
        diff = {k: v - base.get(k, 0.0) for k, v in current.items()}
        return now - base_t, {k: v for k, v in diff.items() if v > 0}


def message_fields(msg: Message) -> dict[str, Any]:
    """A proto message as plain JSON values: every field by its proto name, enums by name.

    Walking the descriptor (not a fixed list) means a field a neuron adds later (a backend
    name, a hybrid's fixed state) shows up here without a change."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.is_repeated:
            out[f.name] = [message_fields(v) if isinstance(v, Message) else v for v in value]
        elif f.message_type is not None:
            out[f.name] = message_fields(value)
        elif f.enum_type is not None:
            name = f.enum_type.values_by_number.get(value)
            out[f.name] = name.name if name is not None else value
        else:
            out[f.name] = value
    return out


def pool_bar(kv: pb.KvLedger) -> dict[str, int]:
    """The ledger's four disjoint parts, which add up to the pool (free_bytes counts cached)."""
    cached = kv.cached_bytes
    return {"free": max(0, kv.free_bytes - cached), "cached": cached,
            "reserved": kv.reserved_bytes, "used": kv.used_bytes}


def model_view(m: pb.ModelStatus) -> dict[str, Any]:
    view = message_fields(m)
    view["state"] = _STATES.get(m.state, str(m.state))
    view["bar"] = pool_bar(m.kv)
    return view


def neuron_view(link: NeuronLink, now: float) -> dict[str, Any]:
    st = link.status
    return {
        "name": link.name,
        "address": link.endpoint.address,
        "tls": bool(link.endpoint.tls),
        "up": link.healthy(now),
        "connected": link.connected,
        "last_report_age_secs": round(now - link.last_seen, 3) if st is not None else None,
        "draining": bool(st.draining) if st is not None else False,
        "seq": st.seq if st is not None else None,
        "catalogue": list(st.catalogue) if st is not None else [],
        "models": [model_view(m) for m in st.models] if st is not None else [],
    }


def _refusals(window: CounterWindow, fields: tuple[str, ...], now: float) -> dict[str, Any]:
    covered, counts = window.recent(now)
    rows: list[dict[str, str | int]] = []
    by_code: dict[str, int] = {}
    for key, n in sorted(counts.items()):
        labels = dict(zip(fields, key, strict=True))
        rows.append({**labels, "count": int(n)})
        by_code[labels["code"]] = by_code.get(labels["code"], 0) + int(n)
    return {"window_secs": round(covered, 1), "by_code": by_code, "rows": rows}


class StatusBoard:
    """What /status.json says, from the registry and the router's metrics."""

    def __init__(self, registry: Registry, refusals: Counter, answers: Counter,
                 in_progress: Gauge, held: dict[str, int] | None = None) -> None:
        self.registry = registry
        self.started = time.monotonic()
        self.neuron_refusals = CounterWindow(refusals)  # labels neuron, model, code
        self.answers = CounterWindow(answers)  # labels model, code (HTTP status)
        self.in_progress = in_progress
        # model -> requests waiting here for it (Dispatcher.held, counted by dispatch.Held)
        self.held = held if held is not None else {}
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        answers = _refusals(self.answers, ("model", "code"), now)
        # 2xx are answers, not refusals; the rest is what clients were told instead.
        answers["rows"] = [r for r in answers["rows"] if not str(r["code"]).startswith("2")]
        answers["by_code"] = {c: n for c, n in answers["by_code"].items() if not c.startswith("2")}
        return {
            "router": {"version": __version__, "unix_ms": int(time.time() * 1000),
                       "uptime_secs": round(now - self.started, 1),
                       "in_progress": int(gauge_value(self.in_progress)),
                       "held": {m: n for m, n in self.held.items() if n > 0}},
            "neurons": [neuron_view(link, now)
                        for _, link in sorted(self.registry.links.items())],
            "refusals": {"neuron": _refusals(self.neuron_refusals, ("neuron", "model", "code"),
                                             now),
                         "http": answers},
        }

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_SECS)
            self.neuron_refusals.sample()
            self.answers.sample()


def page_html() -> bytes:
    return _PAGE.read_bytes()


def status_routes(board_of: Callable[[web.Request], StatusBoard],
           principal_of: Callable[[web.Request], str]) -> Iterator[web.RouteDef]:
    """The two routes; `board_of(request)` finds the StatusBoard, `principal_of(request)`
    enforces the API's auth (raises the 401)."""

    async def status_page(request: web.Request) -> web.Response:
        return web.Response(body=page_html(), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def status_json(request: web.Request) -> web.Response:
        principal_of(request)
        return web.json_response(board_of(request).snapshot(),
                                 headers={"Cache-Control": "no-store"})

    yield web.get("/status", status_page)
    yield web.get("/status.json", status_json)
