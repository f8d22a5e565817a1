"""Test support for tests and benchmarks that run real neuron daemons.

`start_neuron(config_path)` starts `helexa neuron` as a subprocess, waits for
its `NEURON LISTENING host:port` line and returns a handle (address, logs,
signals, stop). `write_neuron_config` writes a TOML config from plain data.
`NeuronClient` is an async gRPC client of a neuron with the helpers tests
want (generate, refusal, watch_until: wait on observed state, never the clock).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import tomli_w

from helexa.cli.daemons import stop_process
from helexa.neuron.auth import bearer
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc


def write_neuron_config(path: str | Path, config: dict[str, Any]) -> Path:
    """Write a neuron config (plain data, as the TOML would read) to `path`."""
    path = Path(path)
    path.write_text(tomli_w.dumps(config))
    return path


def spawned_children(pid: int) -> list[int]:
    """``pid``'s children that multiprocessing spawned (an engine process, a tensor-parallel
    rank; not its resource tracker), started from any of its threads."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(p) for p in f.read().split()]
    out = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(child)
    return out


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

    def engine_pids(self) -> list[int]:
        """The daemon's engine processes (multiprocessing spawn children, started from any
        of the daemon's threads)."""
        return spawned_children(self.pid)

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


def stop_all(procs: Iterable[NeuronProcess], timeout_secs: float = 15.0) -> None:
    """Stop daemons side by side: SIGTERM (drain) to every one first, then wait for each,
    SIGKILL for one still running at the deadline. (One at a time, a session's daemons
    took many seconds at its end, each waiting for the last to drain.)"""
    alive = [p.proc for p in procs if p.proc.poll() is None]
    for proc in alive:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_secs
    for proc in alive:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_neurons(configs: dict[str, tuple[Path, Path]]) -> dict[str, NeuronProcess]:
    """Start several daemons side by side (name -> (config path, log path)), as
    start_neuron does each; if one fails, those that started are stopped and its error
    raised."""
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {name: pool.submit(start_neuron, cfg, log_path=log)
                   for name, (cfg, log) in configs.items()}
    started, error = {}, None
    for name, f in futures.items():
        try:
            started[name] = f.result()
        except Exception as e:  # noqa: BLE001 - the first failure is raised below
            error = error or e
    if error is not None:
        stop_all(started.values())
        raise error
    return started


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
        # the router's links' receive limit: a big tokenize answer is megabytes of ids
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
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
        code, md, _ = await self.refusal_message(req, rpc)
        return code, md

    async def refusal_message(self, req: pb.GenerateRequest, rpc: str = "Generate"
                              ) -> tuple[grpc.StatusCode, dict[str, str], str]:
        """`refusal`, with the message that says why (which limit refused it)."""
        try:
            out = await (self.complete(req) if rpc == "Complete" else self.generate(req))
        except grpc.aio.AioRpcError as e:
            return e.code(), dict(e.trailing_metadata() or ()), e.details() or ""
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
