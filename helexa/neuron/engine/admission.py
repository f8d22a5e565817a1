"""Admission: who moves from queued to in flight, and who is refused. Policy only.

It owns the queue (per principal, FIFO within one) and the set of in-flight
requests, and asks the block pool whether a reservation fits; the engine core
applies what it decides (and alone releases blocks, in one place).

The rules (docs/architecture.md, "A request's states"; what a request reserves is
budget.py's):

- `submit`: refused at once while the model drains (`refusing`: 503
  shutting_down, so the caller goes elsewhere), when the principal already has `max_per_principal` queued + in flight
  (429 rate_limit_exceeded), or when `max_queue_depth` requests are queued
  (503 overloaded). Otherwise queued, also while admission is only stopped
  (`admitting` off without `refusing`: a profile switch waiting for its
  in-flight work), so what arrives during a switch is admitted once it ends,
  switched or abandoned (docs/errors.md, "The table").
- `admit`: principals with queued work take turns (round-robin, in the
  order they first queued; a principal that was served goes to the back).
  The principal whose turn it is offers the head of its queue; it is
  admitted when an in-flight place is free and its whole reservation fits
  the pool. If it does not fit, admission stops there: nobody behind it is
  admitted in its place (no bypass), so a large request is never starved by
  small ones. Anonymous callers (principal "") are one principal in the
  rotation and together hold at most `anon_max_in_flight`; at that cap their
  turn is skipped, never blocking identified callers. Every principal
  (anonymous callers too) holds at most `max_in_flight_per_principal` in
  flight where that is set (None: no cap but max_in_flight), skipped the same
  way at it: without it, since nothing is preempted, one key's long requests
  may hold every place for as long as they run. A request whose grammar still
  compiles (grammar.py, off the step loop) is passed over: its principal's
  head is the first queued request whose matcher is ready, and a principal
  with none skips its turn. Queued, it holds no place, KV or row, and keeps
  its place in its principal's queue until its matcher is ready.
- `expire`: a queued request that waited longer than `kv_max_wait_secs` is
  refused 503 overloaded, saying what it waited for: an in-flight place (all
  held, or its principal's all held) or KV (blocks needed against blocks free);
  any request past its deadline is aborted (reason deadline). Time held by a
  profile switch (`hold`) is not such a wait: a held request is bounded by the
  switch (server.drain_secs, then its re-plan) and by its deadline, and one whose
  deadline passes while held is refused 503 service_unavailable naming the switch.

Retry-after figures come from the pool's drain rate (blocks made free per
second, measured over a sliding window): the blocks the caller would need
to wait for, divided by that rate.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from helexa.budget import reservation_blocks
from helexa.neuron.engine import messages
from helexa.neuron.engine.block_key import BlockKey
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.refusal import Refusal

# Deadlines and queue waits are checked at most this often.
_EXPIRE_EVERY_SECS = 0.01


class DrainMeter:
    """Blocks returned to the pool per second, over the last `window_secs`; when nothing
    came back in the window, over the whole time observed (a quiet spell is not a stall)."""

    def __init__(self, window_secs: float = 20.0, sample_secs: float = 0.2) -> None:
        self.window_secs = window_secs
        self.sample_secs = sample_secs
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, released total)
        self._first: tuple[float, int] | None = None

    def observe(self, now: float, released_total: int) -> None:
        if self._first is None:
            self._first = (now, released_total)
        if self._samples and now - self._samples[-1][0] < self.sample_secs:
            self._samples[-1] = (self._samples[-1][0], released_total)  # keep the latest count
            return
        self._samples.append((now, released_total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_secs:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Blocks per second, or None before anything was released over a measurable span."""
        if len(self._samples) < 2 or self._first is None:
            return None
        t1, n1 = self._samples[-1]
        for t0, n0 in (self._samples[0], self._first):
            if t1 > t0 and n1 > n0:
                return (n1 - n0) / (t1 - t0)
        return None


class Admission:
    def __init__(self, pool: BlockPool, limits: messages.Limits, *,
                 prefix_cache: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.limits = limits
        self.prefix_cache = prefix_cache
        self.clock = clock
        self.wall_clock = wall_clock
        self.admitting = True
        # a drain: newcomers are refused (shutting_down); without it a stopped admission
        # (a profile switch) holds them queued until it resumes
        self.refusing = False
        self._held_since: float | None = None  # when a switch's stop began holding the queue
        self.drain = DrainMeter()
        self._queues: OrderedDict[str, deque[Request]] = OrderedDict()  # rotation order
        self._num_queued = 0
        self.in_flight: dict[str, Request] = {}  # admitted, not finished (incl. running)
        self._per_principal: dict[str, int] = {}  # queued + in flight
        self._in_flight_of: dict[str, int] = {}  # in flight, per principal; none at 0
        # Where the last admit stopped for KV: (the head whose reservation did not fit, the
        # blocks it asked the pool for); None where it stopped for places or ran dry.
        self._stopped_at: tuple[Request, int] | None = None
        self._last_expire = -_EXPIRE_EVERY_SECS

    # --- reports -----------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def queued(self) -> list[Request]:
        """Queued requests, principal by principal in rotation order (tests)."""
        return [r for q in self._queues.values() for r in q]

    def reservation_blocks(self, req: Request) -> int:
        return reservation_blocks(req.num_prompt_tokens, req.output_budget, self.pool.block_size)

    def queued_blocks(self) -> int:
        """The whole reservations of every queued request (their prefix hits not counted)."""
        return sum(self.reservation_blocks(r) for q in self._queues.values() for r in q)

    # --- decisions ---------------------------------------------------------

    def hold(self, admitting: bool, refusing: bool) -> None:
        """Admission on or off; off without `refusing` (a profile switch waiting for its
        in-flight work) holds the queue. When the hold ends, each queued request's
        `held_secs` grows by the part of it that request waited through: its wait for
        an in-flight place or KV (`kv_max_wait_secs`) counts from there."""
        now, held = self.clock(), not admitting and not refusing
        if held and self._held_since is None:
            self._held_since = now
        elif not held and self._held_since is not None:
            for req in self.queued():
                req.held_secs += now - max(req.queued_at, self._held_since)
            self._held_since = None
        self.admitting, self.refusing = admitting, refusing

    def too_big(self, req: Request) -> Refusal | None:
        """Why `req`'s whole reservation can never fit this pool, with the arithmetic."""
        need = self.reservation_blocks(req)
        if need <= self.pool.num_blocks:
            return None
        return Refusal("context_length_exceeded", f"{req.max_total_tokens} tokens need {need}"
                       f" KV blocks; the pool has {self.pool.num_blocks}")

    def submit(self, req: Request) -> Refusal | None:
        """Queue `req`, or say why not (it is then not queued)."""
        if (too_big := self.too_big(req)) is not None:
            return too_big
        need = self.reservation_blocks(req)
        if self.refusing:
            return Refusal("shutting_down", "the model is not admitting requests now",
                           self.retry_after_ms(self.pool.num_blocks - self.pool.num_free_blocks))
        held = self._per_principal.get(req.principal, 0)
        if held >= self.limits.max_per_principal:
            return Refusal("rate_limit_exceeded",
                           f"principal has {held} requests queued or in flight"
                           f" (max_per_principal {self.limits.max_per_principal})",
                           self.retry_after_ms(need))
        if self._num_queued >= self.limits.max_queue_depth:
            return Refusal("overloaded",
                           f"{self._num_queued} requests queued (max_queue_depth"
                           f" {self.limits.max_queue_depth})",
                           self.retry_after_ms(self._deficit(self.queued_blocks() + need)))
        req.status = RequestStatus.QUEUED
        req.queued_at = self.clock()
        self._queues.setdefault(req.principal, deque()).append(req)
        self._num_queued += 1
        self._per_principal[req.principal] = held + 1
        return None

    def admit(self) -> list[Request]:
        """Move queued requests in flight, in fair order, while places and the pool allow."""
        admitted: list[Request] = []
        self._stopped_at = None
        while self.admitting and self._queues and len(self.in_flight) < self.limits.max_in_flight:
            principal = self._next_principal()
            if principal is None:
                break
            queue = self._queues[principal]
            req = _head(queue)
            assert req is not None  # _next_principal passes no queue without one
            reuse, restore, host_blocks, host_snapshot = self._prefix_hits(req)
            need = self.reservation_blocks(req) - len(reuse)
            if not self.pool.reserve(req.req_id, need, reuse, restore, host_blocks,
                                     host_snapshot):
                self._stopped_at = (req, need)
                break  # no bypass: the head waits, and everyone behind it
            queue.remove(req)  # its head: the first whose grammar is not compiling
            self._num_queued -= 1
            del self._queues[principal]
            if queue:
                self._queues[principal] = queue  # served: to the back of the rotation
            req.status = RequestStatus.IN_FLIGHT
            req.num_reserved_blocks = self.reservation_blocks(req)
            req.block_table = self.pool.restored_blocks(req.req_id)  # reused, then restored
            req.num_cached_tokens = req.num_computed_tokens = (len(req.block_table)
                                                               * self.pool.block_size)
            req.num_host_tokens = len(host_blocks) * self.pool.block_size
            self.in_flight[req.req_id] = req
            self._in_flight_of[principal] = self._in_flight_of.get(principal, 0) + 1
            admitted.append(req)
        return admitted

    def expire(self) -> tuple[list[tuple[Request, Refusal]], list[Request]]:
        """(queued requests that waited too long, with their refusal; requests past deadline)."""
        now, wall = self.clock(), self.wall_clock()
        if now - self._last_expire < _EXPIRE_EVERY_SECS:
            return [], []  # a scan per step would cost more than this lateness
        self._last_expire = now
        timed_out: list[tuple[Request, Refusal]] = []
        past_deadline = [r for q in self._queues.values() for r in q
                         if r.deadline_unix and wall >= r.deadline_unix]
        past_deadline += [r for r in self.in_flight.values()
                          if r.deadline_unix and wall >= r.deadline_unix]
        if self._held_since is not None:  # a switch holds the queue: no wait of theirs is
            # for a place or KV; one past its deadline is told it waited for the switch
            held = [r for r in past_deadline if r.status == RequestStatus.QUEUED]
            past_deadline = [r for r in past_deadline if r.status != RequestStatus.QUEUED]
            return [(r, Refusal(
                "service_unavailable", f"the model was switching profile: the request waited "
                f"{now - r.queued_at:.1f} s in its queue for the switch to end and its "
                "deadline passed; retry shortly", 1000)) for r in held], past_deadline
        late = {id(r) for r in past_deadline}
        wait = self.limits.kv_max_wait_secs
        for queue in self._queues.values():
            for req in queue:  # FIFO within a principal: the oldest waited longest (a hold
                waited = now - req.queued_at - req.held_secs  # took the most from the oldest)
                if waited <= wait:
                    break
                if id(req) not in late:
                    after = (f", after {req.held_secs:.1f} s held by a profile switch"
                             if req.held_secs else "")
                    timed_out.append((req, Refusal(
                        "overloaded", f"waited {waited:.1f} s for {self._waiting_for(req)}"
                        f" (kv_max_wait_secs {wait:g}){after}",
                        self.retry_after_ms(self._deficit(self.queued_blocks())))))
        return timed_out, past_deadline

    def _waiting_for(self, req: Request) -> str:
        """What queued `req` waits for now, as its refusal names it."""
        lim = self.limits
        if req.compiling is not None:
            return "its grammar to compile"
        if len(self.in_flight) >= lim.max_in_flight:
            return f"an in-flight place (max_in_flight {lim.max_in_flight}, all held)"
        if (cap := self._cap_reached(req.principal)) is not None:
            whose = "anonymous callers" if req.principal == "" else "its principal"
            return f"an in-flight place ({cap}, all held by {whose})"
        free = self.pool.num_free_blocks
        if self._stopped_at is None or self._stopped_at[0] is req:
            need = self._stopped_at[1] if self._stopped_at else self.reservation_blocks(req)
            return f"KV ({need} blocks needed, {free} free)"
        return (f"KV (no bypass: the request before it in turn needs {self._stopped_at[1]} "
                f"blocks, {free} free; this one needs {self.reservation_blocks(req)})")

    def remove(self, req: Request) -> None:
        """Forget `req` (finished, aborted or refused while queued). The pool is not touched."""
        if self.in_flight.get(req.req_id) is req:
            del self.in_flight[req.req_id]
            held = self._in_flight_of[req.principal] - 1
            if held:
                self._in_flight_of[req.principal] = held
            else:
                del self._in_flight_of[req.principal]
        else:
            queue = self._queues.get(req.principal)
            if queue is None or req not in queue:
                return
            if self._stopped_at is not None and self._stopped_at[0] is req:
                self._stopped_at = None
            queue.remove(req)
            self._num_queued -= 1
            if not queue:
                del self._queues[req.principal]
        left = self._per_principal[req.principal] - 1
        if left:
            self._per_principal[req.principal] = left
        else:
            del self._per_principal[req.principal]

    def observe_pool(self) -> None:
        """Sample the pool's release counter (once per engine step)."""
        self.drain.observe(self.clock(), self.pool.num_released_total)

    def retry_after_ms(self, blocks_to_drain: int) -> int:
        """How long until `blocks_to_drain` more blocks come back, at the measured rate."""
        rate = self.drain.rate()
        if rate is None:
            # Nothing has drained back since start: the best honest figure is
            # the longest a request would wait in the queue.
            return int(max(self.limits.kv_max_wait_secs, 1.0) * 1000)
        secs = max(blocks_to_drain, 1) / rate
        return int(min(max(secs, 0.1), 600.0) * 1000)

    # --- internals ---------------------------------------------------------

    def _next_principal(self) -> str | None:
        """The first principal in rotation that may take an in-flight place now."""
        for principal, queue in self._queues.items():
            if self._cap_reached(principal) is not None:
                continue  # at its cap: skip its turn, never block the others
            if _head(queue) is None:
                continue  # every one's grammar compiles (grammar.py): the same
            return principal
        return None

    def _cap_reached(self, principal: str) -> str | None:
        """The in-flight cap `principal` is at ("key N"), or None while it may take a place:
        anon_max_in_flight for anonymous callers together, max_in_flight_per_principal
        (where set) for anyone."""
        held = self._in_flight_of.get(principal, 0)
        lim = self.limits
        if principal == "" and held >= lim.anon_max_in_flight:
            return f"anon_max_in_flight {lim.anon_max_in_flight}"
        cap = lim.max_in_flight_per_principal
        if cap is not None and held >= cap:
            return f"max_in_flight_per_principal {cap}"
        return None

    def _prefix_hits(self, req: Request) -> tuple[list[int], int, list[tuple[int, BlockKey]],
                                                  tuple[int, BlockKey] | None]:
        """What `req` reuses of the prefix cache: the device blocks, the snapshot it restores
        (hybrid models; -1: none), and from the host tier the blocks that continue the chain
        and the snapshot after them. A hybrid's hit ends where a snapshot is filed (on the
        device or the host), at the furthest such block boundary of the chain, or there is
        no hit."""
        # one asking for its prompt's logprobs needs every position's logits: it takes no
        # hit, as vLLM's (it files its own blocks for others all the same)
        if not self.prefix_cache or not req.block_hashes or \
                req.sampling.prompt_logprobs is not None:
            return [], -1, [], None
        # Keep at least one prompt token to compute: its logits give the first output token.
        usable = (req.num_prompt_tokens - 1) // self.pool.block_size
        keys = req.block_hashes[:usable]
        hits = self.pool.match_prefix(keys)
        host = self.pool.host
        on_host = host.match(keys[len(hits):]) if host is not None else []
        chain = len(hits) + len(on_host)
        from_host = [(slot, keys[len(hits) + i]) for i, slot in enumerate(on_host)]
        snapshots = self.pool.snapshots
        if snapshots is None:
            return hits, -1, from_host, None
        for n in range(chain, 0, -1):
            key = keys[n - 1]
            slot = snapshots.lookup(key) if n <= len(hits) else None
            if slot is not None:
                return hits[:n], slot, [], None
            held = host.snapshots.lookup(key) if host is not None else None
            if held is not None and snapshots.num_free:
                return hits[:n], -1, from_host[:max(0, n - len(hits))], (held, key)
        return [], -1, [], None

    def _deficit(self, blocks_wanted: int) -> int:
        return blocks_wanted - self.pool.num_free_blocks


def _head(queue: deque[Request]) -> Request | None:
    """The first request of a principal's queue that may be admitted: its grammar, if
    it has one, compiled (grammar.py); None where every one's still compiles."""
    return next((r for r in queue if r.compiling is None), None)
