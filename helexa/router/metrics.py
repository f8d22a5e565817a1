"""The router's Prometheus metrics, on its own registry (so in-process tests can run several).

Request metrics are counted as requests happen; the neuron mirror
(`helexa_neuron_kv_*_bytes`, `helexa_neuron_in_flight`,
`helexa_neuron_queued`, labelled `neuron` and `model`) is read from the
registry's last Watch status at scrape time, so it is never stale and a
neuron that leaves the config leaves the metrics with it. An operator (or a
test) can see from the router alone that every KV block came back.

Beside helexa's own names the router exports the vLLM names that
dashboards, autoscalers and routers read (`vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
labelled `model_name`): the same figures, summed over the neurons holding a
model, so a vLLM dashboard works pointed at the router.

A request's `model` label is a model the fleet knows (serve.metric_label), never a
client's string: the series stay as many as the operator's models. A scrape renders on a
worker thread, one at a time (`render_off_loop`): the text grows with the series, and
rendered on the event loop it would stall every stream for as long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from helexa.proto import neuron_pb2 as pb

if TYPE_CHECKING:
    from helexa.router.registry import NeuronLink

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 120, 300)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_KV_FIELDS = ("total", "free", "cached", "reserved", "used")
_STATES = {v.number: v.name.removeprefix("MODEL_STATE_").lower()
           for v in pb.ModelState.DESCRIPTOR.values}


class NeuronMirror:
    """A custom collector: each neuron's last Watch status, as gauges."""

    def __init__(self, links: Callable[[], Iterable[NeuronLink]]) -> None:
        self.links = links

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["neuron", "model"]
        kv = {f: GaugeMetricFamily(f"helexa_neuron_kv_{f}_bytes",
                                   f"KV pool {f} bytes on the neuron, as last reported on Watch",
                                   labels=labels) for f in _KV_FIELDS}
        in_flight = GaugeMetricFamily("helexa_neuron_in_flight",
                                      "Requests holding a KV reservation on the neuron", labels=labels)
        queued = GaugeMetricFamily("helexa_neuron_queued",
                                   "Requests waiting for admission on the neuron", labels=labels)
        paused = GaugeMetricFamily("helexa_neuron_paused",
                                   "Requests in flight on the neuron left out of decode steps "
                                   "because their client stopped reading", labels=labels)
        state = GaugeMetricFamily("helexa_neuron_model_state",
                                  "1 for the model's lifecycle state on the neuron",
                                  labels=[*labels, "state"])
        up = GaugeMetricFamily("helexa_neuron_up", "1 while the neuron is in rotation",
                               labels=["neuron"])
        for link in self.links():
            up.add_metric([link.name], 1.0 if link.healthy() else 0.0)
            if link.status is None:
                continue
            for m in link.status.models:
                lv = [link.name, m.model]
                for f in _KV_FIELDS:
                    kv[f].add_metric(lv, float(getattr(m.kv, f"{f}_bytes")))
                in_flight.add_metric(lv, float(m.in_flight))
                queued.add_metric(lv, float(m.queued))
                paused.add_metric(lv, float(m.paused))
                state.add_metric([*lv, _STATES.get(m.state, "unknown")], 1.0)
        yield from kv.values()
        yield in_flight
        yield queued
        yield paused
        yield state
        yield up
        yield from self._vllm()

    def _vllm(self) -> Iterator[GaugeMetricFamily]:
        """vLLM's gauges per model, summed over the neurons that report it."""
        running: dict[str, float] = {}
        waiting: dict[str, float] = {}
        used: dict[str, float] = {}
        total: dict[str, float] = {}
        for link in self.links():
            for m in link.status.models if link.status is not None else ():
                running[m.model] = running.get(m.model, 0.0) + m.running
                waiting[m.model] = waiting.get(m.model, 0.0) + m.queued
                used[m.model] = used.get(m.model, 0.0) + m.kv.total_bytes - m.kv.free_bytes
                total[m.model] = total.get(m.model, 0.0) + m.kv.total_bytes
        labels = ["model_name"]
        fams = (GaugeMetricFamily("vllm:num_requests_running", "Requests in the decode batch "
                                  "(vLLM's name; helexa_neuron_in_flight counts reservations)",
                                  labels=labels),
                GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting for admission "
                                  "(vLLM's name)", labels=labels),
                GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the KV pool reserved or "
                                  "in use, 0 to 1 (vLLM's name)", labels=labels))
        for model in sorted(total):
            fams[0].add_metric([model], running[model])
            fams[1].add_metric([model], waiting[model])
            fams[2].add_metric([model], used[model] / total[model] if total[model] else 0.0)
        yield from fams


class ModelSeries:
    """One model's label children, looked up once (labels() costs a lock and a dict per call)."""

    def __init__(self, m: RouterMetrics, model: str) -> None:
        self.model = model
        self.ttft = m.ttft.labels(model)
        self.inter_token = m.inter_token.labels(model)
        self.e2e = m.e2e.labels(model)
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.generation_tokens = m.generation_tokens.labels(model)
        self._vllm = (m.vllm_ttft.labels(model), m.vllm_itl.labels(model),
                      m.vllm_prompt_tokens.labels(model), m.vllm_generation_tokens.labels(model))
        self._requests = m.requests
        self._by_code: dict[str, Counter] = {}  # a labelled child of _requests

    def first_token(self, secs: float) -> None:
        self.ttft.observe(secs)
        self._vllm[0].observe(secs)

    def between_tokens(self, secs: float) -> None:
        self.inter_token.observe(secs)
        self._vllm[1].observe(secs)

    def tokens(self, prompt: int, generated: int) -> None:
        """A finished request's usage (each prompt of it counted once)."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self._vllm[2].inc(prompt)
        self._vllm[3].inc(generated)

    def answered(self, code: str) -> None:
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._requests.labels(self.model, code)
        child.inc()


class RouterMetrics:
    """Everything /metrics shows."""

    def __init__(self, links: Callable[[], Iterable[NeuronLink]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("helexa_router_requests", "Requests answered, by model and HTTP code",
                                ["model", "code"], registry=r)
        self.ttft = Histogram("helexa_router_ttft_seconds",
                              "Time from request arrival to the first token of a stream "
                              "(a non-streaming reply brings all its tokens at once)", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("helexa_router_inter_token_seconds",
                                     "Time between successive tokens of a stream", ["model"],
                                     buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("helexa_router_request_seconds",
                             "Time from request arrival to the last byte", ["model"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.refusals = Counter("helexa_router_refusals",
                                "Neuron refusals seen by the router (retried or passed on)",
                                ["neuron", "model", "code"], registry=r)
        self.selections = Counter("helexa_router_selections",
                                  "Requests sent to each neuron", ["neuron", "model"], registry=r)
        self.in_progress = Gauge("helexa_router_requests_in_progress",
                                 "Requests the router is serving now", registry=r)
        # The client connections (conn_gate.py): open now, and refused over a cap.
        self.connections_open = Gauge("helexa_router_connections_open",
                                      "Client connections the router holds open now",
                                      registry=r)
        self.connections_refused = Counter(
            "helexa_router_connections_refused",
            "Client connections answered 503 too_many_connections and closed unread, by the "
            "cap they met: max_connections or per_address", ["reason"], registry=r)
        # dispatch.Held: requests waiting here, before any neuron, for their model to be ready
        self.held = Gauge("helexa_router_held_requests",
                          "Requests the router holds until their model is ready on a neuron "
                          "(a load or a profile switch): in no neuron's queue yet", ["model"],
                          registry=r)
        # The work pool (work_pool.py): its refusals, and the tasks it holds now.
        self.work_refusals = Counter("helexa_router_work_refusals",
                                     "Work the router's parsing pool refused, by reason: "
                                     "principal_share (429), pool_full (503), or "
                                     "background_full (a schema check dropped)", ["reason"],
                                     registry=r)
        # The compile pool (work_pool.py): a request's grammars compiled once its body is parsed.
        self.compile_refusals = Counter("helexa_router_compile_refusals",
                                        "Grammar compiles the router's compile pool refused, by "
                                        "reason: principal_share (429) or pool_full (503)",
                                        ["reason"], registry=r)
        self.compile_tasks = Gauge("helexa_router_compile_tasks",
                                   "Requests whose grammars the router's compile pool is "
                                   "compiling or that wait for it", registry=r)
        self.work_background_failures = Counter(
            "helexa_router_work_background_failures",
            "Background tasks on the router's parsing pool (schema checks of finished "
            "replies) that raised: a bug, logged with its traceback", registry=r)
        self.work_tasks = Gauge("helexa_router_work_tasks",
                                "Tasks running on the router's parsing pool or waiting for it",
                                registry=r)
        self.work_principals = Gauge("helexa_router_work_principals",
                                     "Principals with a task on the router's parsing pool",
                                     registry=r)
        self.work_background = Gauge("helexa_router_work_background_tasks",
                                     "Background tasks (schema checks of finished replies) "
                                     "running on the router's parsing pool or waiting",
                                     registry=r)
        self.prompt_tokens = Counter("helexa_router_prompt_tokens",
                                     "Prompt tokens of finished requests (cached ones included)",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("helexa_router_generation_tokens",
                                         "Tokens generated for finished requests", ["model"],
                                         registry=r)
        # vLLM's names for the same figures (labelled model_name, as vLLM labels them)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds",
                                   "Time to the first token of a stream (vLLM's name)",
                                   ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds",
                                  "Time between tokens of a stream (vLLM's name)",
                                  ["model_name"], buckets=_ITL_BUCKETS, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens (vLLM's name)",
                                          ["model_name"], registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens",
                                              "Generated tokens (vLLM's name)", ["model_name"],
                                              registry=r)
        r.register(NeuronMirror(links))
        self._models: dict[str, ModelSeries] = {}
        self._render_lock = asyncio.Lock()

    def model(self, model: str) -> ModelSeries:
        """The series of one model (callers pass only known model ids, "unknown" or "-")."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = ModelSeries(self, model)
        return series

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        """render() on a worker thread, one scrape at a time (a flood of scrapes takes one
        thread): the loop goes on serving streams meanwhile. The collectors are safe there:
        prometheus_client's children copy under their locks, and the neuron mirror reads a
        snapshot of the links (each status is replaced whole, never changed in place)."""
        async with self._render_lock:
            return await asyncio.to_thread(self.render)
