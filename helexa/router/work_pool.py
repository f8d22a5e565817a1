"""A bounded pool of worker threads for request work that grows with the request, shared
fairly between principals.

The router's event loop carries every client stream and every neuron's
Watch reports: a request that held it for seconds (30,000 tools compiled, a
1 MB `pattern`) let reports go unheard, the neuron left rotation and every
stream on it was cut. Parsing a body, compiling its schemas, building its
neuron requests, encoding a whole reply and checking a finished reply
against its schemas run here instead. The loop keeps turning while they run:
the router sets a 0.5 ms GIL switch interval (app.py), so a worker busy in
Python gives the loop the interpreter that often.

The pool is bounded twice: `workers` threads, and at most `queue_depth`
tasks waiting for one. Past that, `run` refuses at once with 503
`overloaded` (a client backs off on it) instead of queueing without end; a
background task (`submit`) is dropped and the caller told. A task counts
until its thread finishes it, even when the request that asked for it has
gone, so the bound is on work, not on waiting callers; a task still waiting
when its caller leaves is taken out of the queue and stops counting at once.

One client must not take the pool from everyone (docs/http.md, "Generation
requests"), so each task belongs to a principal (the caller's API key's, or
`anonymous` for every caller without one) and the pool shares itself two ways:

- a cap, `per_principal` tasks running or waiting of one principal
  (`limits.schema_per_principal`): past it that principal's `run` is 429
  `rate_limit_exceeded` while everyone else's still gets in. The cap is
  checked before the pool's own bound, so a principal over its share hears
  that it is, not that the router is busy. Work a request needs once the
  neuron has answered (`share=False`: encoding the reply) counts toward the
  cap and the pool's bound but is never refused by either, and waits ahead of
  the parses: the tokens are made (a 503 would throw them away and invite a
  retry that makes them again), and the neuron's own admission already bounds
  such work.
- the order: waiting tasks are served round robin between principals, each
  principal's in the order they came, so one key's backlog delays another's
  task by at most one task per principal with work waiting, not by the whole
  backlog.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from helexa.router.errors import ApiError

T = TypeVar("T")
# What a refusal was for: a principal over its share, or the pool as a whole full.
OVER_SHARE = "principal_share"
POOL_FULL = "pool_full"


def default_share(workers: int, queue_depth: int) -> int:
    """`limits.schema_per_principal` when unset: a quarter of the pool's places, so it takes at
    least four principals at their cap to fill it."""
    return max(1, (workers + queue_depth) // 4)


class _Task:
    __slots__ = ("args", "fn", "fut", "principal")

    def __init__(self, principal: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.principal = principal
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args
        self.fut: Future[Any] = Future()


class WorkPool:
    """`workers` threads, at most `queue_depth` tasks waiting for them and `per_principal`
    tasks of one principal; waiting tasks served round robin between principals."""

    def __init__(self, workers: int, queue_depth: int, per_principal: int | None = None) -> None:
        self.workers = workers
        self.queue_depth = queue_depth
        self.per_principal = per_principal or default_share(workers, queue_depth)
        # Told of each refusal, on the caller's thread: (reason, principal). app.py logs and
        # counts it.
        self.on_refuse: Callable[[str, str], None] = lambda reason, principal: None
        self._cv = threading.Condition(threading.Lock())
        self._waiting: dict[str, deque[_Task]] = {}  # per principal, oldest first
        self._turns: deque[str] = deque()  # the principals with tasks waiting, next first
        self._tasks = 0  # submitted and not yet finished (running or waiting)
        self._of: dict[str, int] = {}  # the same per principal; none at 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"router-work-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def tasks(self) -> int:
        """Tasks running or waiting now."""
        return self._tasks

    def tasks_of(self, principal: str) -> int:
        """One principal's tasks running or waiting now."""
        return self._of.get(principal, 0)

    @property
    def principals(self) -> int:
        """Principals with a task running or waiting now."""
        return len(self._of)

    def _try_submit(self, principal: str, fn: Callable[..., Any], args: tuple[Any, ...],
                    share: bool) -> Future[Any] | str:
        """The task's future, or why it was refused (OVER_SHARE, POOL_FULL)."""
        task = _Task(principal, fn, args)
        with self._cv:
            mine = self._of.get(principal, 0)
            if share and mine >= self.per_principal:
                return OVER_SHARE
            if self._closed or (share and self._tasks >= self.workers + self.queue_depth):
                return POOL_FULL
            self._tasks += 1
            self._of[principal] = mine + 1
            queue = self._waiting.get(principal)
            if queue is None:
                queue = self._waiting[principal] = deque()
                (self._turns.append if share else self._turns.appendleft)(principal)
            # work whose tokens are made goes first: before its principal's parses, and (when
            # its principal had none waiting) before the other principals' turns
            (queue.append if share else queue.appendleft)(task)
            self._cv.notify()
        # Added outside the lock: a callback run at once (the task already done) takes it.
        task.fut.add_done_callback(lambda _: self._finished(task))
        return task.fut

    def _finished(self, task: _Task) -> None:
        """A task's future is done (result, error or cancelled): its place is free. Runs
        exactly once per task, on whichever thread completed or cancelled it."""
        with self._cv:
            self._tasks -= 1
            left = self._of[task.principal] - 1
            if left:
                self._of[task.principal] = left
            else:
                del self._of[task.principal]
            queue = self._waiting.get(task.principal)
            if queue is not None and task.fut.cancelled() and task in queue:
                queue.remove(task)  # its caller left while it waited: its body goes now
                if not queue:
                    del self._waiting[task.principal]
                    self._turns.remove(task.principal)
        task.fn, task.args = None, ()

    def _next(self) -> _Task | None:
        """The next task in turn (None once closed): the oldest of the principal whose turn it
        is, which then goes to the back of the line if it has more."""
        with self._cv:
            while not self._turns and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            principal = self._turns.popleft()
            queue = self._waiting[principal]
            task = queue.popleft()
            if queue:
                self._turns.append(principal)
            else:
                del self._waiting[principal]
            return task

    def _work(self) -> None:
        while (task := self._next()) is not None:
            self._run_one(task)

    @staticmethod
    def _run_one(task: _Task) -> None:
        fn, args = task.fn, task.args
        if fn is None or not task.fut.set_running_or_notify_cancel():
            return  # cancelled between leaving the queue and here: already uncounted
        try:
            result = fn(*args)
        except BaseException as e:  # as ThreadPoolExecutor: the caller gets it
            task.fut.set_exception(e)
        else:
            task.fut.set_result(result)

    async def run(self, principal: str, fn: Callable[..., T], *args: Any,
                  share: bool = True) -> T:
        """fn(*args) on a worker, counted as `principal`'s; its exception (an ApiError among
        them) is raised here. Raises ApiError 429 rate_limit_exceeded when the principal
        holds its share, 503 overloaded when the pool is full; neither where `share` is
        False (work whose tokens are made: it waits ahead of the parses instead)."""
        got = self._try_submit(principal, fn, args, share)
        if isinstance(got, str):
            self.on_refuse(got, principal)
            if got == OVER_SHARE:
                whose = ("callers without an API key (who share one allowance)"
                         if principal == "anonymous" else "this API key")
                raise ApiError(429, f"too many requests of {whose} are already being parsed "
                                    f"or waiting to be ({self.per_principal}, "
                                    f"limits.schema_per_principal); retry",
                               code="rate_limit_exceeded")
            raise ApiError(503, f"the router is busy: {self.workers + self.queue_depth} "
                                f"requests are already being parsed or waiting to be "
                                f"(limits.schema_workers + limits.schema_queue_depth); retry",
                           code="overloaded")
        result: T = await asyncio.wrap_future(got)
        return result

    def submit(self, principal: str, fn: Callable[..., Any], *args: Any) -> str | None:
        """fn(*args) on a worker, nobody waiting for it, counted as `principal`'s; None when
        taken, else why it was dropped (OVER_SHARE, POOL_FULL) and not run."""
        got = self._try_submit(principal, fn, args, True)
        return got if isinstance(got, str) else None

    def close(self) -> None:
        """Stop the threads once their running tasks end; waiting tasks are cancelled."""
        with self._cv:
            self._closed = True
            waiting = [t for q in self._waiting.values() for t in q]
            self._cv.notify_all()
        for t in waiting:
            t.fut.cancel()
