"""Tensor-parallel ranks 1..N-1 of one model, and rank 0's handle on them.

Rank 0 is the engine process's own ModelRunner; it starts one process per
extra rank (multiprocessing spawn) with :meth:`TpWorkers.start`. Every rank
loads only its weight slices and owns its slice of the KV pool (its kv heads,
every block). The ranks form one torch.distributed group per model (gloo on
CPU, NCCL on CUDA) through a FileStore, so no port is ever raced for, with a
short timeout on every collective.

Once per step rank 0 sends the step's plan to each rank over a dedicated pipe
as a msgspec struct — never through the compute group. The ranks keep each
sequence's block table, so a step carries only what changed: the new tokens,
and the blocks appended since that table was last sent. Sampling happens once,
on rank 0 (the LM head gathers logits there).

The MTP head's passes between steps (helexa/neuron/models/mtp.py) go the same way: a
TpMtp names the pass's sequences (their tables as for a step), then rank 0
broadcasts the rows' hidden states over the group and every rank runs the
head on its shard and its slice of the pool; TpMtpLogits runs the shared
lm_head alone. Rank 0 picks the drafts from the gathered logits and they reach
the ranks as the next pass's tokens, so every rank writes the same KV.

A rank exits when rank 0 says stop, when its pipe closes, when a collective
times out, or when its parent dies (PR_SET_PDEATHSIG), so no rank outlives the
engine process however that ends.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from helexa.neuron.engine.images import ImageSpan

DEFAULT_TIMEOUT_SECS = float(os.environ.get("HELEXA_TP_TIMEOUT_SECS", "20"))
# NCCL, set before the group forms, so a dead or wedged rank fails like on gloo: a collective
# past the group's timeout raises in the calling thread (blocking wait) and NCCL's watchdog
# and heartbeat monitor neither tear the process down nor dump traces, so rank 0 marks the
# model failed (TpWorkers.fail_step) and the neuron stays up. A value already in the
# environment wins.
NCCL_FAIL_LIKE_GLOO = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # the watchdog reports, never kills
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


# --- messages on the rank pipes --------------------------------------------------------


class TpSeq(msgspec.Struct, array_like=True):
    handle: int  # rank 0's name for this sequence's block table
    token_ids: list[int]
    num_computed: int
    new_blocks: list[int]  # appended to the rank's copy of the table
    fresh: bool  # the table starts here (new_blocks is all of it)
    need_logits: bool
    state_slot: int = -1  # hybrid models' linear-attention state slot
    num_logits: int = 1  # speculative verification rows want k + 1
    rope_delta: int = 0  # vision-language prompts: as SeqInput (every rank runs the tower)
    images: list[ImageSpan] = []


class TpStep(msgspec.Struct, tag=True):
    seqs: list[TpSeq]
    dropped: list[int] = []  # handles rank 0 no longer tracks


class TpMtp(msgspec.Struct, tag=True):
    seqs: list[TpSeq]  # the hidden states follow as a broadcast over the group


class TpMtpLogits(msgspec.Struct, tag=True):
    rows: int  # the head's outputs follow as a broadcast over the group


class TpResetKv(msgspec.Struct, tag=True):
    num_blocks: int
    kv_dtype: str


class TpStop(msgspec.Struct, tag=True):
    pass


class TpJoin(msgspec.Struct, tag=True):
    pass


class TpLoaded(msgspec.Struct, tag=True):
    pass


class TpReady(msgspec.Struct, tag=True):
    kv_bytes_per_block: int


class TpFailed(msgspec.Struct, tag=True):
    error: str


ToRank = TpStep | TpMtp | TpMtpLogits | TpResetKv | TpStop | TpJoin
FromRank = TpLoaded | TpReady | TpFailed


@dataclass
class RunnerArgs:
    """What every rank's ModelRunner is built from (rank 0's own arguments)."""

    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_dtype: str
    max_num_seqs: int
    max_batched_tokens: int
    devices: list[str]
    timeout_secs: float = DEFAULT_TIMEOUT_SECS
    init_file: str = ""
    backend: str = "auto"  # attention backend (helexa/kernels/backends/__init__.py)
    cuda_graphs: bool = True
    quantize: str = "none"  # helexa/neuron/models/quant.py
    quant_group_size: int = 128
    num_state_slots: int = 0  # hybrid models: linear-attention state slots
    mtp_kv_layers: int | None = None  # pool layers of the MTP head (ModelRunner)


class TpError(RuntimeError):
    """A tensor-parallel rank died, failed or timed out: the model must be restarted."""


# --- process group --------------------------------------------------------------------


def join_group(init_file: str, rank: int, world: int, device: str, timeout_secs: float) -> None:
    """Join this model's process group: NCCL for CUDA devices, gloo otherwise."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        for key, value in NCCL_FAIL_LIKE_GLOO.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(torch.device(device))
    if dist.is_initialized():  # a failed model's group, never closed: one model per process
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_secs))


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# --- rank 0's side --------------------------------------------------------------------


@dataclass
class TpWorkers:
    """Rank 0's handle on ranks 1..N-1: start them, send steps, stop them."""

    procs: list[Any]
    conns: list[Connection]
    init_dir: Any  # TemporaryDirectory holding the FileStore
    failed: str = ""
    plan_bytes: int = 0  # bytes of the last step plan sent to one rank
    kv_bytes_per_block: list[int] = field(default_factory=list)  # ranks 1..N-1's, once joined
    _tables: dict[int, tuple[list[int], int, int]] = field(default_factory=dict)
    _next_handle: int = 0
    _stale: list[int] = field(default_factory=list)  # handles replaced, for the next step
    _encoder: Any = field(default_factory=msgspec.msgpack.Encoder)

    @classmethod
    def start(cls, args: RunnerArgs, world: int) -> tuple[TpWorkers, str]:
        """Spawn ranks 1..world-1; returns the handle and the FileStore path for rank 0."""
        init_dir = tempfile.TemporaryDirectory(prefix="helexa-tp-")
        args.init_file = str(Path(init_dir.name) / "store")
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, args, rank, world),
                            name=f"helexa-tp-rank{rank}", daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        return cls(procs, conns, init_dir), args.init_file

    def wait_loaded(self, timeout_secs: float) -> None:
        """Block until every rank has loaded its shard; TpError naming any that failed."""
        self._wait_all(TpLoaded, timeout_secs)

    def join(self, args: RunnerArgs, device: str) -> None:
        """Everyone loaded: all ranks join the group together (so its short timeout holds)."""
        self._send(TpJoin())
        try:
            join_group(args.init_file, 0, len(self.procs) + 1, device, args.timeout_secs)
        except Exception as e:
            self.fail(f"tensor-parallel group did not form: {e}")
        ready = self._wait_all(TpReady, args.timeout_secs)
        self.kv_bytes_per_block = [m.kv_bytes_per_block for m in ready]

    def _wait_all(self, kind: type, timeout_secs: float) -> list[Any]:
        got = []
        for rank, conn in enumerate(self.conns, start=1):
            msg = self._recv(rank, conn, timeout_secs)
            if isinstance(msg, TpFailed):
                self.fail(f"tensor-parallel rank {rank} failed to start: {msg.error}")
            if not isinstance(msg, kind):
                self.fail(f"tensor-parallel rank {rank}: expected {kind.__name__}, got {msg!r}")
            got.append(msg)
        return got

    def _recv(self, rank: int, conn: Connection, timeout_secs: float) -> FromRank:
        try:
            if not conn.poll(timeout_secs):
                self.fail(f"tensor-parallel rank {rank} did not start within {timeout_secs:.0f} s")
            return msgspec.msgpack.decode(conn.recv_bytes(), type=FromRank)
        except (EOFError, OSError):
            self.fail(f"tensor-parallel rank {rank} exited while starting "
                      f"(exit code {self.procs[rank - 1].exitcode})")
        raise AssertionError("unreachable")

    def send_step(self, seqs: list[Any]) -> None:
        """Send the step plan (only what changed since each table was last sent)."""
        self.check()
        out = [self._seq(s) for s in seqs]
        seen = {id(s.block_table) for s in seqs}
        dropped = [h for key, (_, h, _) in self._tables.items() if key not in seen]
        dropped += self._stale
        self._stale = []
        self._tables = {k: v for k, v in self._tables.items() if k in seen}
        self._send(TpStep(out, dropped))

    def send_mtp(self, seqs: list[Any]) -> None:
        """Send an MTP head pass's sequences (their tables as send_step does; no table is
        dropped: the next step says which are gone)."""
        self.check()
        self._send(TpMtp([self._seq(s) for s in seqs]))

    def send_mtp_logits(self, rows: int) -> None:
        self.check()
        self._send(TpMtpLogits(rows))

    def _seq(self, s: Any) -> TpSeq:
        """One sequence's message: its table's new blocks under the handle the ranks
        know it by, or the whole table under a new handle."""
        table = s.block_table
        entry = self._tables.get(id(table))
        if entry is not None and entry[0] is table and len(table) >= entry[2]:
            _, handle, sent = entry
            msg = TpSeq(handle, s.token_ids, s.num_computed, table[sent:], False,
                        s.need_logits, s.state_slot, s.num_logits, s.rope_delta, s.images)
        else:
            if entry is not None:  # a shrunk table (drafts rolled back): a new handle
                self._stale.append(entry[1])
            handle = self._next_handle
            self._next_handle += 1
            msg = TpSeq(handle, s.token_ids, s.num_computed, list(table), True,
                        s.need_logits, s.state_slot, s.num_logits, s.rope_delta, s.images)
        # Holding the list itself keeps its id from being reused while tracked.
        self._tables[id(table)] = (table, handle, len(table))
        return msg

    def reset_kv(self, num_blocks: int, kv_dtype: str) -> None:
        self.check()
        self._tables.clear()
        self._stale.clear()
        self._send(TpResetKv(num_blocks, kv_dtype))

    def _send(self, msg: ToRank) -> None:
        data = self._encoder.encode(msg)
        self.plan_bytes = len(data)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                self.fail(f"tensor-parallel rank {rank} is gone "
                          f"(exit code {self.procs[rank - 1].exitcode})")

    def check(self) -> None:
        """TpError if a rank has died or the group already failed."""
        if self.failed:
            raise TpError(self.failed)
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self.fail(f"tensor-parallel rank {rank} died (exit code {p.exitcode})")

    def fail_step(self, error: Exception) -> None:
        """A collective failed mid-step: name the rank that died if one did (its exit may
        take a moment to show), then fail the group."""
        for p in self.procs:
            p.join(0.5)
        self.check()
        self.fail(f"tensor-parallel step failed (a rank wedged or its link broke): {error}")

    def fail(self, why: str) -> None:
        """Mark the group failed and end every rank: a broken group cannot be mended."""
        self.failed = self.failed or why
        self.close(timeout_secs=0.0)
        raise TpError(self.failed)

    def close(self, timeout_secs: float = 5.0) -> None:
        """Stop every rank (politely first, then by force); safe to call twice."""
        for conn in self.conns:
            try:
                conn.send_bytes(self._encoder.encode(TpStop()))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout_secs)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.init_dir.cleanup()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


# --- ranks 1..N-1 ---------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank when the engine process dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def worker_main(conn: Connection, args: RunnerArgs, rank: int, world: int) -> None:
    """Entry point of a spawned rank: load the shard, join, then run steps until told."""
    _die_with_parent()
    import torch

    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput

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
                             mtp_kv_layers=args.mtp_kv_layers)
        conn.send_bytes(encoder.encode(TpLoaded()))
        if not isinstance(decoder.decode(conn.recv_bytes()), TpJoin):
            return
        join_group(args.init_file, rank, world, device, args.timeout_secs)
    except (EOFError, OSError):
        return
    except BaseException:
        conn.send_bytes(encoder.encode(TpFailed(traceback.format_exc(limit=4))))
        return
    conn.send_bytes(encoder.encode(TpReady(runner.kv_bytes_per_block)))
    tables: dict[int, list[int]] = {}
    try:
        while True:
            msg = decoder.decode(conn.recv_bytes())
            if isinstance(msg, TpStop):
                break
            if isinstance(msg, TpResetKv):
                tables.clear()
                runner.reset_kv(msg.num_blocks, msg.kv_dtype)
                continue
            if isinstance(msg, TpMtpLogits):
                runner.mtp_logits(None, msg.rows)
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
                                     s.state_slot, s.num_logits, s.rope_delta, s.images))
            if isinstance(msg, TpMtp):
                runner.execute_mtp(seqs, None)  # the hidden states: rank 0's broadcast
            else:
                runner.execute(seqs)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # rank 0 went away: nothing left to serve
    except Exception:
        traceback.print_exc()  # a collective timed out or a step failed: rank 0 sees it too
    finally:
        leave_group()
