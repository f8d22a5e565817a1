"""The neuron's status as routers see it: snapshots and the Watch stream.

`snapshot()` turns the residency (and each engine's last EngineStatus) into a
`NeuronStatus`. `StatusHub` fans changes out to watchers: every change marks
the status dirty and wakes the watchers, which send at most one message per
`min_interval_secs` (20 per second) — so a burst of engine steps costs a
router one message, yet a change after a quiet spell goes out at once — and
a heartbeat when nothing changed for `heartbeat_secs`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from helexa.neuron import agent
from helexa.neuron.residency import Residency
from helexa.neuron.resident_model import ResidentModel
from helexa.proto import neuron_pb2 as pb


def model_status(r: ResidentModel) -> pb.ModelStatus:
    """One resident model as the proto's ModelStatus."""
    m = pb.ModelStatus(model=r.model_id, state=int(r.state), error=r.error,
                       profile=r.profile, kv_dtype=r.kv_dtype, tp=r.entry.tp,
                       last_used_unix_ms=r.last_used_unix_ms, ready_unix_ms=r.ready_unix_ms,
                       activations=r.activations_status)
    template = r.tokenizer.chat_template if r.tokenizer is not None else None
    m.tool_parser = agent.tool_parser(r.entry, template)
    m.reasoning_parser = agent.reasoning_parser(r.entry, template)
    if r.tokenizer is not None and getattr(r.tokenizer, "vision", None) is not None:
        m.vision.CopyFrom(r.tokenizer.vision.status())  # it takes images
    s = r.engine_status
    if s is not None:
        m.kv.CopyFrom(pb.KvLedger(
            total_bytes=s.kv.total_bytes, free_bytes=s.kv.free_bytes,
            cached_bytes=s.kv.cached_bytes, reserved_bytes=s.kv.reserved_bytes,
            used_bytes=s.kv.used_bytes, block_size=s.kv.block_size,
            bytes_per_token=s.kv.bytes_per_token,
            fixed_bytes_per_request=s.kv.fixed_bytes_per_request,
            state_total_bytes=s.kv.state_total_bytes, state_free_bytes=s.kv.state_free_bytes,
            host_total_bytes=s.kv.host_total_bytes, host_cached_bytes=s.kv.host_cached_bytes))
        m.in_flight, m.queued, m.running = s.in_flight, s.queued, s.running
        m.paused = s.paused
        m.decode_tokens_per_sec = s.decode_tokens_per_sec
        m.prefill_tokens_per_sec = s.prefill_tokens_per_sec
        m.attention_backend = s.attention_backend
        m.drafter = s.drafter
        m.spec_drafted_tokens = s.spec_drafted_tokens
        m.spec_accepted_tokens = s.spec_accepted_tokens
    if r.admission is not None:  # the proto's fields are Limits' of the same names (None: 0)
        m.admission.CopyFrom(pb.AdmissionLimits(**{
            f.name: getattr(r.admission, f.name) or 0
            for f in pb.AdmissionLimits.DESCRIPTOR.fields}))
    if r.limits is not None:
        m.limits.CopyFrom(pb.ModelLimits(context=r.limits.context, input=r.limits.input,
                                         output=r.limits.output,
                                         fixed_bytes_per_request=r.limits.fixed_bytes_per_request,
                                         prefix_cache=r.limits.prefix_cache,
                                         prefix_sharing=r.limits.prefix_sharing))
    return m


def snapshot(name: str, residency: Residency, draining: bool) -> pb.NeuronStatus:
    """The whole neuron now (seq is set per Watch stream)."""
    return pb.NeuronStatus(
        neuron=name, draining=draining, unix_ms=int(time.time() * 1000),
        models=[model_status(r) for r in list(residency.models.values())],
        catalogue=[e.id for e in residency.catalogue()])


class StatusHub:
    """Wakes watchers on change; each watcher rate-limits itself and sends heartbeats."""

    def __init__(self, take: Callable[[], pb.NeuronStatus], *, heartbeat_secs: float,
                 min_interval_secs: float = 0.05) -> None:
        self._take = take
        self.heartbeat_secs = heartbeat_secs
        self.min_interval_secs = min_interval_secs
        self._watchers: set[asyncio.Event] = set()
        self.changes = 0  # for tests and metrics: how many changes were signalled

    def changed(self) -> None:
        """Something a watcher would see changed (cheap; called from engine callbacks)."""
        self.changes += 1
        for ev in self._watchers:
            ev.set()

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    async def watch(self, heartbeat_ms: int = 0) -> AsyncIterator[pb.NeuronStatus]:
        """One message at once, then on change (rate-limited) and on heartbeat."""
        ev = asyncio.Event()
        self._watchers.add(ev)
        seq = 0
        loop = asyncio.get_running_loop()
        try:
            while True:
                ev.clear()
                seq += 1
                status = self._take()
                status.seq = seq
                sent_at = loop.time()
                yield status
                heartbeat = heartbeat_ms / 1000 if heartbeat_ms > 0 else self.heartbeat_secs
                try:
                    await asyncio.wait_for(ev.wait(), timeout=heartbeat)
                except TimeoutError:
                    continue
                # coalesce a burst: send no sooner than min_interval after the last one
                wait = sent_at + self.min_interval_secs - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
        finally:
            self._watchers.discard(ev)
