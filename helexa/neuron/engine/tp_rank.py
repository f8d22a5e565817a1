"""A tensor-parallel rank: joining its model's process group, and ranks 1..N-1's loop.

Every rank of a model, rank 0 included, joins one torch.distributed group
(gloo on CPU, NCCL on CUDA) through a FileStore, so no port is ever raced
for, with a short timeout on every collective. Ranks 1..N-1 are spawned by
rank 0 (helexa/neuron/engine/tp_worker.py) into `worker_main`: load the
shard, say so, join when told, then run each step rank 0 sends
(helexa/neuron/engine/tp_messages.py) on its own slice of the weights and
the pool, keeping each sequence's block table between steps.

A rank exits when rank 0 says stop, when its pipe closes, when a collective
times out, when a step of the pool's measurement failed on it (TpMeasure: its
collectives are out of step for good), or when its parent dies
(PR_SET_PDEATHSIG), so no rank outlives the engine process however that ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import structlog

from helexa.neuron.engine.tp_messages import (
    RunnerArgs,
    ToRank,
    TpAgree,
    TpAllocHost,
    TpAskGraphs,
    TpEncode,
    TpFailed,
    TpGraphs,
    TpJoin,
    TpLoaded,
    TpMeasure,
    TpMoved,
    TpMoveKv,
    TpMtp,
    TpMtpLogits,
    TpReady,
    TpResetKv,
    TpSaveHeld,
    TpStep,
    TpStop,
)

log = structlog.get_logger(component="engine")
EXIT_MEASURE_FAILED = 3  # a probe step of the pool's measurement failed here (TpMeasure)

# NCCL, set before the group forms. No blocking wait: with TORCH_NCCL_BLOCKING_WAIT every
# synchronous collective becomes a host sync plus a sleep of at least 1 ms (a decode step of a
# 27B hybrid issues ~130), so collectives stay on the stream. A dead or wedged rank is found
# instead by NCCL's watchdog (a collective past the group's timeout) with async error handling
# 2, CleanUpOnly: it aborts the communicators, so what waits on them fails and the next
# collective raises in the calling thread, without tearing the process down; rank 0 then marks
# the model failed (TpWorkers.fail_step) and the neuron stays up. TpWorkers' health check
# (tp_worker.py, a thread off the hot path) catches a rank process that died. The heartbeat
# monitor and trace dumps stay off: they kill or stall the process. A value already in the
# environment wins, except for blocking wait, which is always off (torch reads both names;
# a host's stale NCCL_BLOCKING_WAIT=1 would otherwise make tensor parallelism crawl).
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicators, never kill
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
NCCL_NO_BLOCKING_WAIT = {"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "0"}


def nccl_environment(env: dict[str, str]) -> dict[str, str]:
    """The NCCL variables a GPU group forms with, given the process environment ``env``
    (whose own values win, but for blocking wait: off)."""
    return {**{key: env.get(key, value) for key, value in NCCL_ENV.items()},
            **NCCL_NO_BLOCKING_WAIT}


def join_group(init_file: str, rank: int, world: int, device: str, timeout_secs: float) -> None:
    """Join this model's process group: NCCL for CUDA devices, gloo otherwise."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        if asked := {k: os.environ[k] for k in NCCL_NO_BLOCKING_WAIT
                     if os.environ.get(k, "0") != "0"}:
            log.warning("engine.nccl_blocking_wait_off", inherited=asked)
        os.environ.update(nccl_environment(dict(os.environ)))
        torch.cuda.set_device(torch.device(device))
    if dist.is_initialized():  # a failed model's group, never closed: one model per process
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_secs))


def leave_group(abort: bool = False) -> None:
    """Leave the group; ``abort`` (it failed): abort its communicators instead, since
    NCCL's orderly shutdown waits for every kernel of theirs, one spinning on a lost rank
    included."""
    import torch.distributed as dist

    if abort:
        abort_group()
    elif dist.is_initialized():
        dist.destroy_process_group()


def abort_group() -> None:
    """Abort the default group's communicators (what NCCL's watchdog does at its timeout)."""
    import torch.distributed.distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.6
    if abort is not None and c10d.is_initialized():
        abort()


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank when the engine process dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def reset_kv_following(runner: Any, num_blocks: int, kv_dtype: str,
                       num_state_slots: int = 0, max_num_seqs: int = 0,
                       max_batched_tokens: int = 0) -> None:
    """A worker rank's new pool (a kv_dtype switch, a hybrid's state slots carved anew, a
    wider profile's rows: rank 0's width, pool_probe.set_width): its own KV only. Its
    graphs are captured as rank 0's capture steps arrive as steps,
    each saying so (TpStep.graph; ModelRunner.reset_kv would run capture steps of its own,
    whose collectives no other rank joins, and then rank 0's again)."""
    from helexa.neuron.engine.pool_probe import set_width

    if num_state_slots:
        runner.num_state_slots = num_state_slots
    set_width(runner, max_num_seqs, max_batched_tokens)
    runner._reset_own_kv(num_blocks, kv_dtype)


def worker_main(conn: Connection, args: RunnerArgs, rank: int, world: int) -> None:
    """Entry point of a spawned rank: load the shard, join, then run steps until told."""
    _die_with_parent()
    import torch

    from helexa.log import setup_logging
    from helexa.neuron.engine import tp_kernels
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
    from helexa.neuron.engine.pool_probe import measure_as_rank

    setup_logging("neuron")  # JSON lines on stderr, as the engine process writes them
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToRank)
    device = args.devices[rank] if len(args.devices) > rank else args.devices[0]
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        runner = ModelRunner(args.model_dir, device=device, dtype=args.dtype,
                             num_blocks=args.num_blocks, block_size=args.block_size,
                             kv_dtype=args.kv_dtype, max_num_seqs=args.max_num_seqs,
                             max_batched_tokens=args.max_batched_tokens, tp_rank=rank,
                             tp_size=world, backend=args.backend, cuda_graphs=args.cuda_graphs,
                             quantize=args.quantize, quant_group_size=args.quant_group_size,
                             num_state_slots=args.num_state_slots,
                             mtp_kv_layers=args.mtp_kv_layers,
                             num_snapshot_slots=args.num_snapshot_slots,
                             measure_pool=args.measure_pool, memory_meter=args.memory_meter,
                             spec_k=args.spec_k)
        conn.send_bytes(encoder.encode(TpLoaded()))
        if not isinstance(decoder.decode(conn.recv_bytes()), TpJoin):
            return
        join_group(args.init_file, rank, world, device, args.timeout_secs)
    except (EOFError, OSError):
        return
    except BaseException:
        conn.send_bytes(encoder.encode(TpFailed(traceback.format_exc(limit=4))))
        return
    conn.send_bytes(encoder.encode(TpReady(runner.kv_bytes_per_block, tp_kernels.own(runner))))
    tables: dict[int, list[int]] = {}
    lost = False  # its collectives out of step with the group's (a failed probe step)
    try:
        # set-up that asks the other ranks, as rank 0 does once every TpReady is in
        runner.backend.executor.grouped(runner.model)
        while True:
            msg = decoder.decode(conn.recv_bytes())
            if isinstance(msg, TpStop):
                break
            if isinstance(msg, TpResetKv):
                tables.clear()
                reset_kv_following(runner, msg.num_blocks, msg.kv_dtype, msg.num_state_slots,
                                   msg.max_num_seqs, msg.max_batched_tokens)
                continue
            if isinstance(msg, TpMeasure):  # its pool follows as a TpResetKv
                tables.clear()
                answer = measure_as_rank(runner, msg)
                conn.send_bytes(encoder.encode(answer))
                if lost := answer.broken:  # rank 0 fails the group on its answer: leave
                    log.error("engine.tp_measure_failed", tp_rank=rank, reason=answer.error)
                    break
                continue
            if isinstance(msg, TpAgree):  # the group's refused kernel kinds, before any step
                tp_kernels.adopt(runner, msg.refused)
                continue
            if isinstance(msg, TpAskGraphs):  # before rank 0 captures over the new pool
                refused = runner.backend.executor.graphs_refused()
                conn.send_bytes(encoder.encode(TpGraphs(refused)))
                continue
            if isinstance(msg, TpAllocHost):
                runner._allocate_own_host(msg.num_blocks, msg.num_snapshots)
                continue
            if isinstance(msg, TpMoveKv):  # a failure fails the restoring requests, not the group
                try:
                    runner._move_own_kv(msg.moves)
                    error = ""
                except Exception as e:  # noqa: BLE001 - rank 0 decides what it costs
                    error = f"{type(e).__name__}: {e}"
                conn.send_bytes(encoder.encode(TpMoved(error)))
                continue
            if isinstance(msg, TpEncode):  # a step's tower work, as rank 0 runs it
                runner.vision.advance(msg.slices)
                continue
            if isinstance(msg, TpMtpLogits):
                runner.mtp_logits(None, msg.rows)
                continue
            if isinstance(msg, TpSaveHeld):  # a verification row's snapshot, once judged
                runner._save_own_held(msg.saves)
                continue
            if not isinstance(msg, TpStep | TpMtp):  # a second TpJoin: nothing to do
                continue
            if isinstance(msg, TpStep):
                for h in msg.dropped:
                    tables.pop(h, None)
            seqs = []
            for s in msg.seqs:
                if s.fresh:
                    table = tables[s.handle] = s.new_blocks
                else:
                    table = tables[s.handle]
                    table.extend(s.new_blocks)
                seqs.append(SeqInput(s.token_ids, s.num_computed, table, s.need_logits,
                                     s.state_slot, s.num_logits, s.restore_from, s.save_to,
                                     s.rope_delta, s.images, s.all_logits))
            # a lookahead step's or chained MTP pass's tokens: filled by rank 0's broadcast
            tokens = torch.empty(len(seqs), dtype=torch.long, device=runner.device) \
                if msg.device_tokens else None
            if isinstance(msg, TpMtp):  # the hidden states: rank 0's broadcast too
                runner.execute_mtp(seqs, None, tokens)
            else:  # run as rank 0 runs it: captured, replayed or eager (its decision)
                runner.execute(seqs, tokens, msg.graph)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # rank 0 went away: nothing left to serve
    except Exception:
        traceback.print_exc()  # a collective timed out or a step failed: rank 0 sees it too
    finally:
        leave_group(abort=lost)  # abort: its own kernels may wait on the others for good
    if lost:
        sys.exit(EXIT_MEASURE_FAILED)
