"""Helpers for tests and benchmarks that run real daemons, and an in-process engine fake.

`start_neuron(config_path)` starts `helexa neuron` as a subprocess, waits for
its `NEURON LISTENING host:port` line and returns a handle (address, logs,
signals, stop). `write_neuron_config` writes a TOML config from plain data.
`NeuronClient` is an async gRPC client of a neuron with the helpers tests
want (generate, refusal, watch_until). `FakeEngineClient` stands in for `EngineClient` in unit tests of the daemon:
no process, tokens from a script, one per step.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import tomli_w

from helexa.neuron.auth import bearer
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc
from helexa.up import stop_process


def write_neuron_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write a neuron config (plain data, as the TOML would read) to `path`."""
    path = Path(path)
    path.write_text(tomli_w.dumps(config))
    return path


@dataclass
class NeuronProcess:
    """A running `helexa neuron` subprocess."""

    proc: subprocess.Popen[str]
    address: str
    config_path: Path
    log_path: Path
    metrics_address: str = ""
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self, event: str | None = None) -> list[dict[str, Any]]:
        """The daemon's JSON log lines so far (optionally only one event)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if event is None or rec.get("event") == event:
                out.append(rec)
        return out

    def wait_for_log(self, event: str, timeout_secs: float = 10.0,
                     where: Callable[[dict[str, Any]], bool] = lambda _r: True) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_secs
        while time.monotonic() < deadline:
            hits = [r for r in self.logs(event) if where(r)]
            if hits:
                return hits[-1]
            time.sleep(0.02)
        raise TimeoutError(f"no `{event}` in the neuron's log within {timeout_secs}s")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_secs: float = 30.0) -> int:
        """SIGTERM (drain) and wait; SIGKILL if it does not exit in time."""
        return stop_process(self.proc, timeout_secs)


def start_neuron(config_path: str | Path, *, log_path: str | Path | None = None,
                 timeout_secs: float = 120.0, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> NeuronProcess:
    """Start `helexa neuron --config FILE` and return once it printed its address."""
    config_path = Path(config_path)
    log_path = Path(log_path) if log_path else config_path.with_suffix(".log")
    log_file = open(log_path, "w")  # noqa: SIM115 - the child owns it for its life
    proc = subprocess.Popen(
        [sys.executable, "-m", "helexa.cli", "neuron", "--config", str(config_path),
         *(extra_args or [])],
        stdout=subprocess.PIPE, stderr=log_file, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    log_file.close()
    lines: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def pump() -> None:  # keep reading so the child never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("NEURON METRICS "):
                found["metrics"] = line.split()[-1]
            if line.startswith("NEURON LISTENING "):
                found["address"] = line.split()[-1]
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout_secs) or "address" not in found:
        proc.kill()
        proc.wait()
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"neuron did not start (exit {proc.returncode}); log tail:\n{tail}")
    return NeuronProcess(proc=proc, address=found["address"], config_path=config_path,
                         log_path=log_path, metrics_address=found.get("metrics", ""),
                         stdout_lines=lines)


# ---------------------------------------------------------------------------- gRPC client


def chat_request(req_id: str, text: str = "Tell me a story", *, principal: str = "alice",
                 model: str = "tiny", max_tokens: int | None = 8, **kw: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        req_id=req_id, model=model, principal=principal,
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(temperature=0.0), **kw)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    return req


class NeuronClient:
    """An async gRPC client of one neuron (make one per event loop)."""

    def __init__(self, address: str, token: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = neuron_pb2_grpc.NeuronStub(self.channel)
        self.md = bearer(token)

    async def __aenter__(self) -> NeuronClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.channel.close()

    async def generate(self, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return [r async for r in self.stub.Generate(req, metadata=self.md)]

    async def complete(self, req: pb.GenerateRequest) -> pb.GenerateResponse:
        return await self.stub.Complete(req, metadata=self.md)

    async def refusal(self, req: pb.GenerateRequest,
                      rpc: str = "Generate") -> tuple[grpc.StatusCode, dict[str, str]]:
        """The status and trailing metadata of a call (`Generate` or `Complete`) expected to
        be refused."""
        try:
            out = await (self.complete(req) if rpc == "Complete" else self.generate(req))
        except grpc.aio.AioRpcError as e:
            return e.code(), dict(e.trailing_metadata() or ())
        raise AssertionError(f"expected a refusal, got {out}")

    async def status(self) -> pb.NeuronStatus:
        call = self.stub.Watch(pb.WatchRequest(), metadata=self.md)
        st = await call.read()
        call.cancel()
        return st

    async def watch_until(self, pred: Callable[[pb.NeuronStatus], bool],
                          timeout_secs: float = 10.0) -> pb.NeuronStatus:
        """Read Watch until `pred(status)`; the status that satisfied it."""
        call = self.stub.Watch(pb.WatchRequest(heartbeat_ms=200), metadata=self.md)
        try:
            async with asyncio.timeout(timeout_secs):
                async for st in call:
                    if pred(st):
                        return st
        finally:
            call.cancel()
        raise AssertionError("Watch ended")


def model_of(st: pb.NeuronStatus, model: str = "tiny") -> pb.ModelStatus:
    return next(m for m in st.models if m.model == model)


def ledger_whole(st: pb.NeuronStatus, model: str = "tiny") -> bool:
    m = model_of(st, model)
    return (m.kv.free_bytes == m.kv.total_bytes > 0 and m.kv.reserved_bytes == 0
            and m.kv.used_bytes == 0 and m.in_flight == 0 and m.queued == 0)


# ---------------------------------------------------------------------------- fake engine


class FakeEngineClient:
    """An EngineClient stand-in: every request admitted at once, one scripted token per step.

    `script(prompt_ids, i)` gives the i-th output token; `refuse` (code, message,
    retry_after_ms) makes the next request be refused; aborts end a request with
    ABORT at its next step. The ledger is a fixed pool with one block per request.
    """

    def __init__(self, spec: Any, *, script: Callable[[list[int], int], int],
                 step_secs: float = 0.001, on_status: Callable[[Any], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        from helexa.neuron.engine import messages

        self.m = messages
        self.spec = spec
        self.script = script
        self.step_secs = step_secs
        self.on_status = on_status or (lambda _s: None)
        self.on_fatal = on_fatal or (lambda _m: None)
        self.limits = spec.limits
        self.admitting = True
        self.refuse: tuple[str, str, int] | None = None
        self.aborts: dict[str, str] = {}
        self.active: set[str] = set()
        self.requests: list[Any] = []
        self.reset_calls: list[dict[str, Any]] = []
        self.alive = True
        self.pid = os.getpid()
        self.status = self._status()

    @classmethod
    def factory(cls, script: Callable[[list[int], int], int], **kw: Any) -> Callable[..., Any]:
        """A residency client_factory making fakes; `.made` lists them."""
        made: list[FakeEngineClient] = []

        async def start(spec: Any, *, on_status: Any = None, on_fatal: Any = None,
                        on_progress: Any = None) -> FakeEngineClient:
            c = cls(spec, script=script, on_status=on_status, on_fatal=on_fatal, **kw)
            made.append(c)
            return c

        start.made = made  # type: ignore[attr-defined]
        return start

    def _status(self) -> Any:
        bpt = self.spec.bytes_per_token or 1
        block = self.spec.block_size * bpt
        total = self.spec.num_blocks * block
        used = min(total, len(self.active) * block)
        kv = self.m.KvLedger(total_bytes=total, free_bytes=total - used, cached_bytes=0,
                             reserved_bytes=0, used_bytes=used, block_size=self.spec.block_size,
                             bytes_per_token=bpt)
        return self.m.EngineStatus(kv=kv, in_flight=len(self.active), queued=0,
                                   running=len(self.active), admitting=self.admitting)

    def _changed(self) -> None:
        self.status = self._status()
        self.on_status(self.status)

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        m = self.m
        self.requests.append(req)
        if not self.admitting or self.refuse:
            code, msg, retry = self.refuse or ("shutting_down", "not admitting", 1000)
            self.refuse = None
            yield m.RequestUpdate(req_id=req.req_id, refused_code=code, refused_message=msg,
                                  retry_after_ms=retry)
            return
        self.active.add(req.req_id)
        self._changed()
        finished = False
        try:
            yield m.RequestUpdate(req_id=req.req_id, admitted=True,
                                  prompt_tokens=len(req.prompt_token_ids))
            budget = req.max_tokens or min(self.limits.default_output_tokens or 16,
                                           self.spec.context - len(req.prompt_token_ids))
            for i in range(budget):
                await asyncio.sleep(self.step_secs)
                if req.req_id in self.aborts:
                    finished = True
                    yield m.RequestUpdate(req_id=req.req_id, finished=m.FinishReason.ABORT)
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

    def set_limits(self, limits: Any) -> None:
        from helexa.neuron.engine.spec import merge_limits

        self.limits = merge_limits(self.limits, limits)

    def stop_admitting(self, flag: bool) -> None:
        self.admitting = not flag
        self._changed()

    async def reset_kv(self, *, num_blocks: int, kv_dtype: str, bytes_per_token: int,
                       **plan: Any) -> None:
        """Re-plan the pool (only between requests, as the daemon guarantees)."""
        import msgspec

        assert not self.active, "reset_kv with requests in flight"
        self.reset_calls.append(dict(num_blocks=num_blocks, kv_dtype=kv_dtype,
                                     bytes_per_token=bytes_per_token, **plan))
        self.spec = msgspec.structs.replace(self.spec, num_blocks=num_blocks, kv_dtype=kv_dtype,
                                            bytes_per_token=bytes_per_token)
        self._changed()

    async def shutdown(self, timeout_secs: float = 5.0) -> None:
        self.alive = False


def run_fake_neuron(config_path: str | Path, body: Callable[..., Any], *,
                    script: Callable[[list[int], int], int], step_secs: float = 0.001) -> Any:
    """Run `await body(stub, daemon, engine)` against a fresh in-process daemon whose
    engines are FakeEngineClients (`engine` is the first one made); drains it after."""
    from helexa.config import load_neuron_config
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
