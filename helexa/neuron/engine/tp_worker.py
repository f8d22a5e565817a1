"""Rank 0's handle on one model's tensor-parallel ranks 1..N-1: start, step, stop them.

Rank 0 is the engine process's own ModelRunner; it starts one process per
extra rank (helexa/neuron/engine/start_method.py) with :meth:`TpWorkers.start`. Every rank
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

On CUDA the KV pool is sized by measurement on every rank once the group has formed
(at load and at a pool switch): rank 0 sends TpMeasure, every rank runs the probe's steps
of its own in lockstep (rank 0 sends none of them as steps meanwhile), fits the pool to its
own card and answers, and the group takes the fewest blocks any rank can hold
(helexa/neuron/engine/tp_measure.py, pool_probe.py).

Once the group has formed, before any step, the ranks settle on one kernel a kind
(tp_kernels.py: TpReady's refusals, TpAgree); each step says how rank 0's executor runs it
(TpStep.graph: captured, replayed or eager), and before capturing over a new pool rank 0
asks whether every rank's graphs can run over its own (TpAskGraphs), capturing none where
one cannot.

The messages are helexa/neuron/engine/tp_messages.py's; the group and the
extra ranks' own loop, helexa/neuron/engine/tp_rank.py's. A rank that dies,
fails or times out fails the whole group (TpError): the model must restart.
Collectives never block the host (no NCCL blocking wait, tp_rank.NCCL_ENV): a health
check thread (:meth:`TpWorkers.watch`, once a second, off the hot path) finds a rank
process that died and aborts an NCCL group, so a step waiting on it fails at once rather
than at the watchdog's timeout; the next step says which rank died. Where a kernel spins
on the dead rank and no step returns, the health check ends the engine process itself.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import structlog

from helexa.neuron.engine import start_method
from helexa.neuron.engine.host_tier import KvMoves
from helexa.neuron.engine.tp_measure import last_words
from helexa.neuron.engine.tp_messages import (
    DEFAULT_TIMEOUT_SECS,
    FromRank,
    RunnerArgs,
    ToRank,
    TpAllocHost,
    TpAskGraphs,
    TpEncode,
    TpError,
    TpFailed,
    TpGraphs,
    TpJoin,
    TpLoaded,
    TpMoved,
    TpMoveKv,
    TpMtp,
    TpMtpLogits,
    TpReady,
    TpRefused,
    TpResetKv,
    TpSaveHeld,
    TpSeq,
    TpStep,
    TpStop,
)
from helexa.neuron.engine.tp_rank import abort_group as _abort_group
from helexa.neuron.engine.tp_rank import join_group, worker_main

log = structlog.get_logger(component="engine")
GIVE_UP_SECS = 30.0  # after aborting a group on a dead rank: the step loop's time to end it
EXIT_RANK_LOST = 70  # the engine process's exit status when the health check ends it
_exit = os._exit  # (a test stands in for it)


@dataclass
class TpWorkers:
    """Rank 0's handle on ranks 1..N-1: start them, send steps, stop them."""

    procs: list[Any]
    conns: list[Connection]
    init_dir: Any  # TemporaryDirectory holding the FileStore
    failed: str = ""
    plan_bytes: int = 0  # bytes of the last step plan sent to one rank
    kv_bytes_per_block: list[int] = field(default_factory=list)  # ranks 1..N-1's, once joined
    refused: list[list[TpRefused]] = field(default_factory=list)  # their cards' (tp_kernels)
    _tables: dict[int, tuple[list[int], int, int]] = field(default_factory=dict)
    _next_handle: int = 0
    _stale: list[int] = field(default_factory=list)  # handles replaced, for the next step
    _encoder: Any = field(default_factory=msgspec.msgpack.Encoder)
    _stop_watch: threading.Event = field(default_factory=threading.Event)  # health polls end
    _closed: threading.Event = field(default_factory=threading.Event)  # the runner closed it
    _nccl: bool = False  # the group is NCCL's (a CUDA model), once joined
    give_up_secs: float = GIVE_UP_SECS
    timeout_secs: float = DEFAULT_TIMEOUT_SECS  # a rank's answer to TpMoveKv (the group's)
    # while every rank runs the pool's probe steps of its own (measure): rank 0's steps are
    # not sent, and a failed one is measure's to judge, not the group's end yet
    _lockstep: bool = False
    # an answer the health check read off a dead rank's pipe (its last words: why it left
    # the group), for the step thread's next read of that rank; both read under the lock
    _early: dict[int, FromRank] = field(default_factory=dict)
    _pipe_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, args: RunnerArgs, world: int) -> tuple[TpWorkers, str]:
        """Spawn ranks 1..world-1; returns the handle and the FileStore path for rank 0."""
        init_dir = tempfile.TemporaryDirectory(prefix="helexa-tp-")
        args.init_file = str(Path(init_dir.name) / "store")
        ctx = start_method.context()
        procs, conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            fn, fn_args = start_method.target(ctx, worker_main, (child, args, rank, world))
            p = ctx.Process(target=fn, args=fn_args, name=f"helexa-tp-rank{rank}", daemon=True)
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
            self.timeout_secs = args.timeout_secs
            join_group(args.init_file, 0, len(self.procs) + 1, device, args.timeout_secs)
        except Exception as e:
            self.fail(f"tensor-parallel group did not form: {e}")
        ready = self._wait_all(TpReady, args.timeout_secs)
        self.kv_bytes_per_block = [m.kv_bytes_per_block for m in ready]
        self.refused = [m.refused for m in ready]
        self._nccl = device.startswith("cuda")
        threading.Thread(target=self.watch, args=(self._nccl,),
                         name="helexa-tp-health", daemon=True).start()

    def watch(self, nccl: bool, interval_secs: float = 1.0) -> None:
        """The health check: until the group fails or closes, note the first rank process
        found dead; on NCCL abort the group so a collective or host sync waiting on that
        rank returns (gloo fails on a closed peer by itself). It records: the step thread
        raises, and the engine ends (EngineGaveUp). A kernel spinning on the dead rank's
        data never returns to the host, though (FlashInfer's fused all-reduce polls for it;
        collectives replayed from a CUDA graph are not the watchdog's to abort): if the
        runner is not closed within ``give_up_secs``, this thread ends the engine process,
        as the step loop would."""
        while not self._stop_watch.wait(interval_secs):
            dead = self._dead_rank()
            if dead and not self.failed and not self._stop_watch.is_set():
                self.failed = dead
                if nccl:
                    _abort_group()
                    self._give_up_unless_closed()
                return

    def _give_up_unless_closed(self) -> None:
        if not self._closed.wait(self.give_up_secs):
            log.error("engine.tp_gave_up", reason=self.failed, waited_secs=self.give_up_secs)
            _exit(EXIT_RANK_LOST)

    def _wait_all(self, kind: type, timeout_secs: float,
                  doing: tuple[str, str] = ("start", "starting")) -> list[Any]:
        """Each rank's answer, of type ``kind``; ``doing``: what the ranks were asked to do,
        as the failures name it (did not <do> within, exited while <doing>)."""
        got = []
        for rank in range(1, len(self.conns) + 1):
            msg = self._recv(rank, timeout_secs, doing)
            if isinstance(msg, TpFailed):
                self.fail(f"tensor-parallel rank {rank} failed to start: {msg.error}")
            if not isinstance(msg, kind):
                self.fail(f"tensor-parallel rank {rank}: expected {kind.__name__}, got {msg!r}")
            got.append(msg)
        return got

    def _recv(self, rank: int, timeout_secs: float, doing: tuple[str, str]) -> FromRank:
        try:
            msg = self.answer(rank, timeout_secs)
        except (EOFError, OSError):
            self.fail(f"tensor-parallel rank {rank} exited while {doing[1]} "
                      f"(exit code {self.procs[rank - 1].exitcode})")
        if msg is None:
            self.fail(f"tensor-parallel rank {rank} did not {doing[0]} within "
                      f"{timeout_secs:.0f} s")
        return msg

    def answer(self, rank: int, timeout_secs: float, keep: bool = False) -> FromRank | None:
        """Rank ``rank``'s next answer, None if none came within ``timeout_secs``: one the
        health check read off its pipe first (a dead rank's last words), else the pipe's;
        ``keep``: left for the next read. EOFError or OSError where its pipe is closed.
        (The health check reads only a dead rank's pipe, which polls at once.)"""
        conn = self.conns[rank - 1]
        if rank not in self._early and not conn.poll(timeout_secs):
            return None
        with self._pipe_lock:
            if rank not in self._early:
                self._early[rank] = msgspec.msgpack.decode(conn.recv_bytes(), type=FromRank)
            return self._early[rank] if keep else self._early.pop(rank)

    def send_step(self, seqs: list[Any], device_tokens: bool = False, graph: str = "") -> None:
        """Send the step plan (only what changed since each table was last sent);
        `device_tokens`: its tokens follow as a broadcast; `graph`: how rank 0's executor
        runs it, as every rank must (TpStep)."""
        self.check()
        if self._lockstep:  # every rank runs this step of its own (measure)
            return
        out = [self._seq(s) for s in seqs]
        seen = {id(s.block_table) for s in seqs}
        dropped = [h for key, (_, h, _) in self._tables.items() if key not in seen]
        dropped += self._stale
        self._stale = []
        self._tables = {k: v for k, v in self._tables.items() if k in seen}
        self._send(TpStep(out, dropped, device_tokens, graph))

    def send_encode(self, slices: list[Any]) -> None:
        """A step's tower work (VisionStep.advance): every rank runs the same blocks."""
        self.check()
        self._send(TpEncode(slices))

    def send_mtp(self, seqs: list[Any], device_tokens: bool = False) -> None:
        """Send an MTP head pass's sequences (their tables as send_step does; no table is
        dropped: the next step says which are gone); `device_tokens` as send_step's."""
        self.check()
        self._send(TpMtp([self._seq(s) for s in seqs], device_tokens))

    def send_mtp_logits(self, rows: int) -> None:
        self.check()
        self._send(TpMtpLogits(rows))

    def save_held(self, saves: list[tuple[int, int, int]]) -> None:
        self.check()
        self._send(TpSaveHeld(saves))

    def _seq(self, s: Any) -> TpSeq:
        """One sequence's message: its table's new blocks under the handle the ranks
        know it by, or the whole table under a new handle."""
        table = s.block_table
        entry = self._tables.get(id(table))
        if entry is not None and entry[0] is table and len(table) >= entry[2]:
            _, handle, sent = entry
            blocks, fresh = table[sent:], False
        else:
            if entry is not None:  # a shrunk table (drafts rolled back): a new handle
                self._stale.append(entry[1])
            handle = self._next_handle
            self._next_handle += 1
            blocks, fresh = list(table), True
        msg = TpSeq(handle, s.token_ids, s.num_computed, blocks, fresh, s.need_logits,
                    s.state_slot, s.num_logits, s.restore_from, s.save_to, s.rope_delta,
                    s.images, s.all_logits)
        # Holding the list itself keeps its id from being reused while tracked.
        self._tables[id(table)] = (table, handle, len(table))
        return msg

    def reset_kv(self, num_blocks: int, kv_dtype: str, num_state_slots: int = 0,
                 max_num_seqs: int = 0, max_batched_tokens: int = 0) -> None:
        self.check()
        self._tables.clear()
        self._stale.clear()
        self._send(TpResetKv(num_blocks, kv_dtype, num_state_slots, max_num_seqs,
                             max_batched_tokens))

    def graphs_refused(self) -> str:
        """Why some rank's CUDA graphs cannot run over its new pool ("" where every rank's
        can: a quantised pool's Triton kernels proved themselves on every card), asked of
        each rank (TpAskGraphs) before rank 0 captures, so that graphs run on all or none."""
        self.check()
        self._send(TpAskGraphs())
        answers = self._wait_all(TpGraphs, self.timeout_secs, (
            "say whether its graphs run", "saying whether its graphs run"))
        return "; ".join(f"tensor-parallel rank {rank}: {a.refused}"
                         for rank, a in enumerate(answers, start=1) if a.refused)

    def allocate_host(self, num_blocks: int, num_snapshots: int) -> None:
        self.check()
        self._send(TpAllocHost(num_blocks, num_snapshots))

    def move_kv(self, moves: KvMoves, own: Callable[[KvMoves], None]) -> None:
        """The host tier's copies on every rank: sent to the others, made here by ``own``,
        then each rank's answer read. RuntimeError naming every rank whose copies failed
        (the engine then fails the requests restoring from the tier and empties it: the
        group goes on); a rank that does not answer within the group's timeout, or has
        gone, fails the group."""
        self.check()
        self._send(TpMoveKv(moves))
        try:
            own(moves)
        finally:
            answers = self._wait_all(TpMoved, self.timeout_secs, (
                "make its host-tier copies", "making its host-tier copies"))
        errors = [f"rank {rank}: {a.error}" for rank, a in enumerate(answers, start=1)
                  if a.error]
        if errors:
            raise RuntimeError("host-tier copies failed on tensor-parallel "
                               + "; ".join(errors))

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
            self.fail(self.failed)  # ends the ranks too when the health check found it
        dead = self._dead_rank()
        if dead:
            self.fail(dead)

    def _dead_rank(self) -> str:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                why = last_words(self, rank)
                return (f"tensor-parallel rank {rank} failed measuring its KV pool and left "
                        f"the group: {why}" if why else
                        f"tensor-parallel rank {rank} died (exit code {p.exitcode})")
        return ""

    def fail_step(self, error: Exception) -> None:
        """A collective failed mid-step: name the rank that died if one did (its exit may
        take a moment to show), then fail the group (measure's: measure judges)."""
        if self._lockstep:
            return
        for p in self.procs:
            p.join(0.5)
        self.check()
        self.fail(f"tensor-parallel step failed (a rank wedged or its link broke): {error}")

    def fail(self, why: str) -> NoReturn:
        """Mark the group failed and end every rank: a broken group cannot be mended. On
        NCCL the step thread may find the loss first (lookahead sends a step while the one
        before still runs): it aborts the group as the health check would, and arms the
        same last resort, since a step in flight may wait on the lost rank for good."""
        first, self.failed = not self.failed, self.failed or why
        if first and self._nccl:
            _abort_group()
            threading.Thread(target=self._give_up_unless_closed, name="helexa-tp-give-up",
                             daemon=True).start()
        self._stop_watch.set()
        self._end_ranks(0.0)
        raise TpError(self.failed)

    def close(self, timeout_secs: float = 5.0) -> None:
        """Stop every rank (politely first, then by force); safe to call twice. The runner's
        close: the health check's last resort stands down."""
        self._stop_watch.set()
        self._end_ranks(timeout_secs)
        self._closed.set()

    def _end_ranks(self, timeout_secs: float) -> None:
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
        if self.init_dir is not None:
            self.init_dir.cleanup()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


