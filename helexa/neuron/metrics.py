"""Prometheus metrics of the neuron (served on server.metrics_listen).

The pool ledger, in-flight and queued figures are read from the residency at
scrape time (a custom collector), so they are never stale and never counted
twice; request outcomes, refusals, token counts and latencies are recorded
by the servicer as requests end. Each daemon has its own registry so that
tests can build several in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from helexa.neuron.engine.growth import REASONS as GROWTH_REFUSALS
from helexa.neuron.residency import Residency

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_LEDGER = ("total", "free", "cached", "reserved", "used")


class _ResidencyCollector(Collector):
    """helexa_kv_*_bytes{model}, helexa_requests_{in_flight,queued,running,paused}{model}."""

    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        kv = {k: GaugeMetricFamily(f"helexa_kv_{k}_bytes", f"KV pool bytes {k} (per card)",
                                   labels=["model"]) for k in _LEDGER}
        counts = {k: GaugeMetricFamily(f"helexa_requests_{k}", f"Requests {k.replace('_', ' ')}",
                                       labels=["model"])
                  for k in ("in_flight", "queued", "running", "paused")}
        fixed = GaugeMetricFamily("helexa_kv_fixed_bytes_per_request",
                                  "Linear-attention state bytes each request holds (per card; "
                                  "hybrid models, included in the helexa_kv_* figures)",
                                  labels=["model"])
        slots = {k: GaugeMetricFamily(f"helexa_kv_state_{k}_bytes",
                                      f"State slot bytes {k} (per card; hybrid models)",
                                      labels=["model"]) for k in ("total", "free")}
        # The prefix cache's host tier (kv.host_cache_mb): its bytes, and its traffic since start.
        host = {k: GaugeMetricFamily(f"helexa_kv_host_{k}_bytes",
                                     f"Host tier bytes {k} (per card; kv.host_cache_mb)",
                                     labels=["model"]) for k in ("total", "cached")}
        host_moves = {k: CounterMetricFamily(f"helexa_kv_host_{k}_blocks",
                                             f"KV blocks copied {'out to' if k == 'offloaded' else 'back from'}"
                                             " the host tier", labels=["model"])
                      for k in ("offloaded", "restored")}
        host_hits = CounterMetricFamily("helexa_prefix_host_hit_tokens",
                                        "Prompt tokens restored from the host tier (part of "
                                        "the prefix cache's hits)", labels=["model"])
        # Growable reservations (kv.grow_output; helexa/neuron/engine/growth.py), since start.
        growths = CounterMetricFamily("helexa_kv_growths", "Reservations grown when a request "
                                      "without max_tokens reached its output budget",
                                      labels=["model"])
        refused = CounterMetricFamily("helexa_kv_growths_refused",
                                      "Growths refused (the request ended at its budget): the "
                                      "pool had no room, requests queued for KV needed it, "
                                      "admitted requests waited for a batch row, or the model "
                                      "was not admitting (draining, switching)",
                                      labels=["model", "reason"])
        state = GaugeMetricFamily("helexa_model_state",
                                  "Model lifecycle state (1 loading, 2 ready, 3 switching, "
                                  "4 draining, 5 failed)", labels=["model"])
        # Speculative decoding (docs/speculation.md): cumulative since the engine started.
        drafted = CounterMetricFamily("helexa_spec_drafted_tokens",
                                      "Tokens drafted and verified", labels=["model", "drafter"])
        accepted = CounterMetricFamily("helexa_spec_accepted_tokens",
                                       "Drafted tokens the model accepted",
                                       labels=["model", "drafter"])
        rate = GaugeMetricFamily("helexa_spec_acceptance_rate",
                                 "Accepted / drafted tokens since the engine started",
                                 labels=["model", "drafter"])
        for r in list(self._residency.models.values()):
            state.add_metric([r.model_id], int(r.state))
            s = r.engine_status
            if s is None:
                continue
            for k in _LEDGER:
                kv[k].add_metric([r.model_id], getattr(s.kv, f"{k}_bytes"))
            fixed.add_metric([r.model_id], s.kv.fixed_bytes_per_request)
            for k, g in slots.items():
                g.add_metric([r.model_id], getattr(s.kv, f"state_{k}_bytes"))
            if s.kv.host_total_bytes:
                for k, g in host.items():
                    g.add_metric([r.model_id], getattr(s.kv, f"host_{k}_bytes"))
                for k, c in host_moves.items():
                    c.add_metric([r.model_id], getattr(s, f"host_{k}_blocks"))
                host_hits.add_metric([r.model_id], s.prefix_host_hit_tokens)
            growths.add_metric([r.model_id], s.kv_growths)
            for reason in GROWTH_REFUSALS:
                refused.add_metric([r.model_id, reason], getattr(s, f"kv_growths_refused_{reason}"))
            counts["in_flight"].add_metric([r.model_id], s.in_flight)
            counts["queued"].add_metric([r.model_id], s.queued)
            counts["running"].add_metric([r.model_id], s.running)
            counts["paused"].add_metric([r.model_id], s.paused)
            if s.drafter != "off" or s.spec_drafted_tokens:
                labels = [r.model_id, s.drafter]
                drafted.add_metric(labels, s.spec_drafted_tokens)
                accepted.add_metric(labels, s.spec_accepted_tokens)
                if s.spec_drafted_tokens:
                    rate.add_metric(labels, s.spec_accepted_tokens / s.spec_drafted_tokens)
        yield from kv.values()
        yield fixed
        yield from slots.values()
        yield from host.values()
        yield from host_moves.values()
        yield host_hits
        yield from (growths, refused)
        yield from counts.values()
        yield state
        yield from (drafted, accepted, rate)


class NeuronMetrics:
    """The neuron's metric objects, on a registry of its own."""

    def __init__(self, residency: Residency) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ResidencyCollector(residency))
        r = self.registry
        self.requests = Counter("helexa_requests", "Requests finished, by outcome "
                                "(stop, length, abort, error, client_gone, rejected)",
                                ["model", "outcome"], registry=r)
        self.refusals = Counter("helexa_refusals", "Requests refused, by code",
                                ["model", "code"], registry=r)
        self.ttft = Histogram("helexa_ttft_seconds", "Time from arrival to the first token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("helexa_inter_token_latency_seconds",
                             "Time between successive streamed tokens", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_tokens = Counter("helexa_prefill_tokens", "Prompt tokens computed "
                                      "(not served from the prefix cache)", ["model"], registry=r)
        self.cached_tokens = Counter("helexa_cached_prompt_tokens",
                                     "Prompt tokens served from the prefix cache", ["model"],
                                     registry=r)
        self.pauses = Counter("helexa_request_pauses", "Requests paused because their caller "
                              "stopped reading (each pause counts)", ["model"], registry=r)
        self.decode_tokens = Counter("helexa_decode_tokens", "Tokens generated", ["model"],
                                     registry=r)
        # The work pool (helexa/neuron/work.py): its refusals, and the calls it holds now.
        self.work_refusals = Counter("helexa_work_refusals", "Calls the work pool refused: "
                                     "principal_share (429) or pool_full (503)", ["reason"],
                                     registry=r)
        self.work_tasks = Gauge("helexa_work_tasks", "Calls whose prompt work is running on "
                                "the work pool or waiting for it", registry=r)
        self.work_principals = Gauge("helexa_work_principals", "Principals with a call on "
                                     "the work pool", registry=r)

    def serve(self, listen: str) -> tuple[str, Any]:
        """Start the HTTP endpoint on host:port (port 0 allowed); returns the bound address."""
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "127.0.0.1",
                                            registry=self.registry)
        return f"{host or '127.0.0.1'}:{server.server_port}", server
