"""An in-process stand-in for EngineClient, for unit tests of the neuron daemon.

`FakeEngineClient` has no process and no model: every request is admitted at
once and gets one scripted token per step. Like the real engine it owns each
request's outcome: the output budget (helexa/budget.py's rule), stop
tokens, aborts, and deadlines (ABORT with error "deadline"); the daemon only
maps what it reports. `run_fake_neuron` runs a whole daemon in-process on it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import msgspec

from helexa.budget import output_budget
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.spec import EngineSpec
from helexa.proto import neuron_pb2_grpc

Script = Callable[[list[int], int], int]


class FakeEngineClient:
    """An EngineClient stand-in: every request admitted at once, one scripted token per step.

    `script(prompt_ids, i)` gives the i-th output token; `refuse` (code, message,
    retry_after_ms) makes the next request be refused; aborts end a request with
    ABORT at its next step. The ledger is a fixed pool with one block per request.
    """

    def __init__(self, spec: EngineSpec, *, script: Script, step_secs: float = 0.001,
                 on_status: Callable[[m.EngineStatus], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.script = script
        self.step_secs = step_secs
        self.on_status = on_status or (lambda _s: None)
        self.on_fatal = on_fatal or (lambda _m: None)
        self.limits = spec.limits
        self.admitting = True
        self.refusing = False  # a drain: refuse newcomers; a switch's stop holds them
        self.fail_before_token: str | None = None  # fail each request after admitting it
        self.refuse: tuple[str, str, int] | None = None
        self.aborts: dict[str, str] = {}
        self.active: set[str] = set()
        self.requests: list[m.NewRequest] = []
        self.reset_calls: list[dict[str, Any]] = []
        # reset_kv answers busy this many times first, as a real engine does when a request
        # was admitted just before the stop reached it
        self.busy_resets = 0
        self.busy_answers = 0
        self.fail_resets = ""  # reset_kv fails saying this (a pool the card cannot hold)
        self.alive = True
        self.pid = os.getpid()
        self.status = self._status()

    @classmethod
    def factory(cls, script: Script, **kw: Any) -> Callable[..., Awaitable[FakeEngineClient]]:
        """A residency client_factory making fakes; `.made` lists them."""
        made: list[FakeEngineClient] = []

        async def start(spec: EngineSpec, *, on_status: Any = None, on_fatal: Any = None,
                        on_progress: Any = None) -> FakeEngineClient:
            c = cls(spec, script=script, on_status=on_status, on_fatal=on_fatal, **kw)
            made.append(c)
            return c

        start.made = made  # type: ignore[attr-defined]
        return start

    def _status(self) -> m.EngineStatus:
        bpt = self.spec.bytes_per_token or 1
        block = self.spec.block_size * bpt
        total = self.spec.num_blocks * block
        used = min(total, len(self.active) * block)
        kv = m.KvLedger(total_bytes=total, free_bytes=total - used, cached_bytes=0,
                        reserved_bytes=0, used_bytes=used, block_size=self.spec.block_size,
                        bytes_per_token=bpt)
        return m.EngineStatus(kv=kv, in_flight=len(self.active), queued=0,
                              running=len(self.active), admitting=self.admitting)

    def _changed(self) -> None:
        self.status = self._status()
        self.on_status(self.status)

    async def generate(self, req: m.NewRequest, on_flow: Any = None
                       ) -> AsyncIterator[m.RequestUpdate]:
        self.requests.append(req)  # no flow control: a generator is never ahead of its reader
        while not self.admitting and not self.refusing:  # a switch: queued until it ends
            await asyncio.sleep(0.005)
        if self.refusing or self.refuse:
            code, msg, retry = self.refuse or ("shutting_down", "not admitting", 1000)
            self.refuse = None
            yield m.RequestUpdate(req_id=req.req_id, refused_code=code, refused_message=msg,
                                  retry_after_ms=retry)
            return
        self.active.add(req.req_id)
        self._changed()
        finished = False
        try:
            yield m.RequestUpdate(req_id=req.req_id, admitted=True, started=True,
                                  prompt_tokens=len(req.prompt_token_ids))
            if self.fail_before_token is not None:  # the engine failed its prefill
                finished = True
                yield m.RequestUpdate(req_id=req.req_id, finished=m.FinishReason.ERROR,
                                      error=self.fail_before_token)
                return
            budget = output_budget(len(req.prompt_token_ids), req.max_tokens,
                                   context=self.spec.context,
                                   default_output_tokens=self.limits.default_output_tokens,
                                   max_output_tokens=self.spec.max_output_tokens)
            for i in range(budget):
                await asyncio.sleep(self.step_secs)
                if req.deadline_unix and time.time() >= req.deadline_unix:
                    self.aborts.setdefault(req.req_id, "deadline")  # as the engine does
                if req.req_id in self.aborts:
                    finished = True
                    yield m.RequestUpdate(req_id=req.req_id, finished=m.FinishReason.ABORT,
                                          error=self.aborts[req.req_id])
                    return
                tok = self.script(req.prompt_token_ids, i)
                done = None
                if tok in req.stop_token_ids:
                    done = m.FinishReason.STOP
                elif i == budget - 1:
                    done = m.FinishReason.LENGTH
                finished = done is not None
                yield m.RequestUpdate(req_id=req.req_id, new_token_ids=[tok], finished=done)
                if finished:
                    return
        finally:
            if not finished:
                self.aborts.setdefault(req.req_id, "client_gone")
            self.active.discard(req.req_id)
            self._changed()

    def abort(self, req_id: str, reason: str = "client_gone") -> None:
        self.aborts.setdefault(req_id, reason)

    def set_limits(self, limits: m.Limits) -> None:
        self.limits = limits

    def stop_admitting(self, flag: bool = True, *, refuse_queued: bool = False) -> None:
        self.admitting = not flag
        self.refusing = flag and (self.refusing or refuse_queued)  # as the engine's client
        self._changed()

    async def reset_kv(self, *, num_blocks: int, kv_dtype: str, bytes_per_token: int,
                       **plan: Any) -> None:
        """Re-plan the pool (only between requests, as the daemon guarantees)."""
        if self.busy_resets:
            from helexa.neuron.engine.client import EngineBusy

            self.busy_resets -= 1
            self.busy_answers += 1
            raise EngineBusy("1 requests in flight; stop admitting and let them finish first")
        assert not self.active, "reset_kv with requests in flight"
        if self.fail_resets:  # the engine kept its pool and width (intake.reset_kv)
            from helexa.neuron.engine.client import EngineError

            raise EngineError(self.fail_resets)
        self.reset_calls.append(dict(num_blocks=num_blocks, kv_dtype=kv_dtype,
                                     bytes_per_token=bytes_per_token, **plan))
        self.spec = msgspec.structs.replace(self.spec, num_blocks=num_blocks, kv_dtype=kv_dtype,
                                            bytes_per_token=bytes_per_token)
        self._changed()

    async def shutdown(self, timeout_secs: float = 5.0) -> None:
        self.alive = False


def run_fake_neuron(config_path: str | Path, body: Callable[..., Awaitable[Any]], *,
                    script: Script, step_secs: float = 0.001) -> Any:
    """Run `await body(stub, daemon, engine)` against a fresh in-process daemon whose
    engines are FakeEngineClients (`engine` is the first one made); drains it after."""
    from helexa.config.schema import load_neuron_config
    from helexa.neuron.daemon import NeuronDaemon

    factory = FakeEngineClient.factory(script, step_secs=step_secs)

    async def run() -> Any:
        daemon = NeuronDaemon(Path(config_path), load_neuron_config(config_path),
                              client_factory=factory)
        await daemon.start()
        await daemon.residency.preload()
        try:
            async with grpc.aio.insecure_channel(daemon.address) as ch:
                return await body(neuron_pb2_grpc.NeuronStub(ch), daemon,
                                  factory.made[0])  # type: ignore[attr-defined]
        finally:
            await daemon.drain()

    return asyncio.run(run())
