"""The daemons `helexa up` runs as children: start, readiness, stop.

Each child runs in its own session (Ctrl-C reaches `up` only, which stops
them), its stdout is read for the readiness line (`NEURON LISTENING` /
`ROUTER LISTENING` and the bound address), and it stops on SIGTERM (a helexa
daemon drains on it), SIGKILL only when it overruns. Readiness beyond the
line: the neuron's own report of the model (Models RPC), and the router
listing the model (it has the neuron's Watch report), so the endpoint `up`
prints works at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


class Stopping:
    """Ctrl-C or SIGTERM seen: set from a signal handler, so it takes no lock. A
    threading.Event would: its set() enters the lock its wait() holds while waking, so a
    second signal landing then (two Ctrl-C's, or `timeout` forwarding one beside the
    user's) deadlocked `up` with both daemons left running."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout_secs: float) -> bool:
        """Sleep up to timeout_secs, in slices, until set; whether it is."""
        end = time.monotonic() + timeout_secs
        while not self._set and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.05, left))
        return self._set


def stop_process(proc: subprocess.Popen, timeout_secs: float) -> int:
    """SIGTERM (a helexa daemon drains on it) and wait; SIGKILL if it does not exit in time.
    Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_secs)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Child:
    """A daemon child process and the address it announced on stdout."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ready_prefix: str) -> None:
        self.name = name
        self.log_path = log_path
        log = open(log_path, "w")  # noqa: SIM115 - the child owns it for its life
        # Its own session: Ctrl-C reaches `up` only, which stops the children in order.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.address = ""
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready_prefix,), daemon=True).start()

    def _pump(self, prefix: str) -> None:
        for line in self.proc.stdout:  # keep reading so the child never blocks on a full pipe
            if line.startswith(prefix) and not self.address:
                self.address = line.split()[-1]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_secs: float) -> bool:
        return self._ready.wait(timeout_secs) and bool(self.address)

    def stop(self, timeout_secs: float) -> int:
        return stop_process(self.proc, timeout_secs)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def wait_started(child: Child, timeout_secs: float, stopping: Stopping) -> bool:
    """Wait for the child's readiness line; False (its log tail printed) if it never came."""
    end = time.monotonic() + timeout_secs
    while time.monotonic() < end and not stopping.is_set():
        if child.wait_ready(0.2):
            return True
        if child.proc.poll() is not None:
            break
    if stopping.is_set():
        return False
    print(f"helexa up: the {child.name} did not start; log tail ({child.log_path}):\n"
          f"{child.log_tail()}", file=sys.stderr)
    return False


def stop_all(children: list[Child], drain_secs: float) -> None:
    """SIGTERM every child at once: the router stops accepting and waits for its streams, the
    neuron drains drain_secs and ends what is left, so the router's streams end (with an
    error event at worst) and it exits by itself; SIGKILL only for one that hangs."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in reversed(children):  # the router first: it finishes when its streams do
        if child.stop(drain_secs + 20.0) == -signal.SIGKILL:
            print(f"helexa up: the {child.name} did not stop in time and was killed",
                  file=sys.stderr)
    if children:
        print("helexa up: stopped.", flush=True)


def model_failure(address: str, token: str, model_id: str) -> str | None:
    """None when the neuron reports the model ready, else why not (its reason if it failed)."""
    import grpc

    from helexa.neuron.auth import bearer
    from helexa.proto import neuron_pb2 as pb
    from helexa.proto import neuron_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            res = neuron_pb2_grpc.NeuronStub(channel).Models(
                pb.ModelsRequest(), metadata=bearer(token), timeout=30)
        except grpc.RpcError as e:
            return f"the neuron did not answer ({e.code().name})"  # type: ignore[attr-defined]
    status = next((m for m in res.models if m.model == model_id), None)
    if status is None:
        return "the neuron did not load it"
    if status.state == pb.MODEL_STATE_READY:
        return None
    state = pb.ModelState.Name(status.state).removeprefix("MODEL_STATE_").lower()
    return status.error or f"it is {state}"

def wait_listed(router: Child, model_id: str, timeout_secs: float,
                 stopping: Stopping) -> bool:
    """Wait until the router lists the model (it has the neuron's Watch report): the printed
    examples then work at once."""
    end = time.monotonic() + timeout_secs
    while time.monotonic() < end and not stopping.is_set() and router.proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{router.address}/v1/models", timeout=5) as r:
                if any(m.get("id") == model_id for m in json.load(r).get("data", [])):
                    return True
        stopping.wait(0.1)
    if not stopping.is_set():
        print(f"helexa up: the router did not list {model_id}; log tail "
              f"({router.log_path}):\n{router.log_tail()}", file=sys.stderr)
    return False
