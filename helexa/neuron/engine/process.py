"""The engine process: one loaded model's EngineCore behind a pipe.

Started by EngineClient (client.py) in a process of its own (start_method.py), so
the daemon's GIL never slows a step and the model's memory goes when the
process exits. The protocol on the pipe, msgspec msgpack both ways:

- out: FromEngine(progress=...) while loading, then FromEngine(ready=True,
  status=...) once, or FromEngine(fatal=...) if loading failed;
- in: ToEngine messages (new requests, aborts, limits, stop_admitting,
  shutdown); everything that arrived since the last step is merged into one;
- out: one FromEngine per step that changed something.

The loop blocks on the pipe while the engine has no work, else polls it
without blocking and steps. A closed pipe (the daemon went away) ends the
process, as does ToEngine(shutdown=True) after every request was aborted.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from helexa.neuron.engine import messages
from helexa.neuron.engine.spec import EngineSpec

if TYPE_CHECKING:
    from helexa.neuron.engine.engine_core import EngineCore

# A step with nothing to run (everything queued behind a stopped admission)
# waits this long for the pipe instead of spinning.
_IDLE_POLL_SECS = 0.005
# Status goes out with every step that has updates, else at most this often.
_STATUS_EVERY_SECS = 0.5
_PROGRESS_EVERY_SECS = 0.1
# Steps failing one after another mean a broken model or device, not a bad
# request: the engine then goes down (fatal) and the daemon marks the model failed.
MAX_CONSECUTIVE_FAILED_STEPS = 5


class EngineGaveUp(Exception):
    pass


def merge_inbound(batch: list[messages.ToEngine]) -> messages.ToEngine:
    """Everything the daemon sent since the last step, as one message (order kept)."""
    if len(batch) == 1:
        return batch[0]
    merged = messages.ToEngine()
    merged.new, merged.aborts = [], []
    for msg in batch:
        merged.new.extend(msg.new)
        merged.aborts.extend(msg.aborts)
        merged.paused = {**merged.paused, **msg.paused}  # the latest word on each wins
        merged.limits = msg.limits or merged.limits  # each is the whole set: the latest wins
        merged.shutdown = merged.shutdown or msg.shutdown
        merged.refuse_queued = merged.refuse_queued or msg.refuse_queued
        merged.reset_kv = msg.reset_kv or merged.reset_kv
    merged.stop_admitting = batch[-1].stop_admitting  # each message carries the current flags
    merged.refuse_new = batch[-1].refuse_new
    return merged


def engine_main(spec_bytes: bytes, conn: Connection,
                runner_factory: Callable[[EngineSpec], Any] | None = None) -> None:
    """Entry point of the spawned process. `runner_factory` (picklable) stands in for the
    model: benchmarks and tests of the serving path run without one."""
    encoder = msgspec.msgpack.Encoder()
    spec = msgspec.msgpack.decode(spec_bytes, type=EngineSpec)
    try:
        core = _load(spec, conn, encoder, runner_factory)
    except BaseException:  # a load failure is reported, never raised into the void
        _try_send(conn, encoder, messages.FromEngine(fatal=f"loading {spec.model_id} failed:\n"
                                                     f"{traceback.format_exc()}"))
        conn.close()
        return
    try:
        _send(conn, encoder, messages.FromEngine(ready=True, status=core.status()))
        run_loop(core, conn, encoder)
    except (EOFError, OSError):
        pass  # the daemon is gone (pipe closed); so are we
    except EngineGaveUp as e:
        _try_send(conn, encoder, messages.FromEngine(fatal=str(e), status=core.status()))
        raise SystemExit(1) from None
    except BaseException:
        _try_send(conn, encoder, messages.FromEngine(fatal=traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        core.close()
        conn.close()


def _load(spec: EngineSpec, conn: Connection, encoder: msgspec.msgpack.Encoder,
          runner_factory: Callable[[EngineSpec], Any] | None = None) -> EngineCore:
    import torch

    problem = missing_cuda(spec.devices)
    if problem:  # before any weight is read: torch's own words would be an AssertionError
        raise RuntimeError(f"{spec.devices_key}: {problem}")
    from helexa.log import get_logger, setup_logging
    from helexa.neuron.engine.engine_core import EngineCore

    setup_logging("neuron")
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    last = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == total or now - last >= _PROGRESS_EVERY_SECS:
            last = now
            _send(conn, encoder, messages.FromEngine(progress=f"{done}/{total}"))

    log = get_logger("neuron").bind(model=spec.model_id)
    runner = runner_factory(spec) if runner_factory is not None else None
    return EngineCore(spec, runner, logger=log, progress=progress)


def missing_cuda(devices: list[str]) -> str:
    """Why this host cannot run the CUDA devices named ("" when it can): torch built without
    CUDA, no card it can see, or fewer cards than an index named."""
    import torch

    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return ""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"{cuda[0]} is a CUDA device, but this host's torch {torch.__version__} is built "
                "without CUDA; name cpu, or install a CUDA build of torch")
    count = torch.cuda.device_count()
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"{cuda[0]} is a CUDA device, but torch {torch.__version__} sees no card on this "
                "host (no driver, or " + (f"CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None
                                          else "no card)"))
    for d in cuda:
        if (torch.device(d).index or 0) >= count:
            names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            return f"{d}: torch sees {count} CUDA card(s) on this host ({names})"
    return ""


def run_loop(core: EngineCore, conn: Connection, encoder: msgspec.msgpack.Encoder) -> None:
    decoder = msgspec.msgpack.Decoder(messages.ToEngine)
    last_status: tuple[messages.KvLedger, int, int, int, int, bool] | None = None
    last_status_at = 0.0
    while True:
        batch: list[messages.ToEngine] = []
        if not core.has_work:
            conn.poll(None)  # idle: sleep until the daemon sends something
        elif not core.running and not core.waiting:
            conn.poll(_IDLE_POLL_SECS)  # only queued work that cannot move: don't spin
        while conn.poll(0):
            batch.append(decoder.decode(conn.recv_bytes()))
        inbound = merge_inbound(batch) if batch else None
        out = core.step(inbound)
        broken = core.runner.failed
        if broken:  # a tensor-parallel rank died or wedged: no later step can succeed, and
            # this one's tokens may come from all-reduces an abort cut short: never sent
            raise EngineGaveUp(f"tensor-parallel runner failed: {broken}")
        status = out.status
        assert status is not None  # every step reports the model's status
        key = (status.kv, status.in_flight, status.queued, status.running, status.paused,
               status.admitting)
        now = time.monotonic()
        if (out.updates or out.kv_reset or key != last_status
                or now - last_status_at >= _STATUS_EVERY_SECS):
            _send(conn, encoder, out)
            last_status, last_status_at = key, now
        if inbound is not None and inbound.shutdown:
            return
        if core.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineGaveUp(f"{core.consecutive_failed_steps} steps failed in a row;"
                               f" the last: {core.last_error}")


def _send(conn: Connection, encoder: msgspec.msgpack.Encoder, msg: messages.FromEngine) -> None:
    conn.send_bytes(encoder.encode(msg))


def _try_send(conn: Connection, encoder: msgspec.msgpack.Encoder, msg: messages.FromEngine) -> None:
    try:
        _send(conn, encoder, msg)
    except OSError:
        pass  # nobody is listening any more
