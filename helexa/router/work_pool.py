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
`overloaded` (a client backs off on it) instead of queueing without end. A
task counts until its thread finishes it, even when the request that asked
for it has gone, so the bound is on work, not on waiting callers; a task still
waiting when its caller leaves is taken out of the queue and stops counting at
once.

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

Background work (`submit`: checking a finished reply against its schema, which
nobody waits for) is a lane of its own, so a principal's finished requests can
never make its next one 429 or 503: it counts toward neither the principal's
share nor the pool's bound, and it runs only when no request's task is waiting
and on at most `workers - 1` threads (the one thread of a pool of one), so
with two workers or more it never holds every thread. Its own bound is
`background_depth` tasks running or waiting (`workers + queue_depth` unless
given), served round robin between principals too; when it is full the task
dropped is the newest of the principal with the most waiting (the new one, when
that is its own principal), so one key's checks cannot push out everyone
else's. A dropped task's caller is told (`on_drop`); it is diagnostics, not
the client's answer. Nobody awaits background work, so an exception it raises is
told to `on_background_error` (app.py counts it and logs
`router.background_work_failed` with its traceback), never kept on a future
nobody reads; the thread goes on to the next task.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from helexa.log import get_logger
from helexa.router.errors import ApiError

T = TypeVar("T")
# What a refusal was for: a principal over its share, or the pool as a whole full.
OVER_SHARE = "principal_share"
POOL_FULL = "pool_full"
# Why background work was dropped: its own lane was full (or the pool closing).
BACKGROUND_FULL = "background_full"


def default_share(workers: int, queue_depth: int) -> int:
    """`limits.schema_per_principal` when unset: a quarter of the pool's places, so it takes at
    least four principals at their cap to fill it."""
    return max(1, (workers + queue_depth) // 4)


def _ignore(reason: str) -> None:
    pass


def log_background_failure(principal: str, task: str, error: BaseException) -> None:
    """`on_background_error` unless the router sets its own: the failure, logged."""
    get_logger("router").error("router.background_work_failed", principal=principal,
                               task=task, error=repr(error), exc_info=error)


class _Task:
    __slots__ = ("args", "fn", "fut", "on_drop", "principal")

    def __init__(self, principal: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 on_drop: Callable[[str], None] | None = None) -> None:
        self.principal = principal
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] = args
        self.fut: Future[Any] = Future()
        self.on_drop = on_drop  # None: a request's task; else background work


class _Lane:
    """Tasks waiting, per principal oldest first, and the principals in turn."""

    def __init__(self) -> None:
        self.waiting: dict[str, deque[_Task]] = {}
        self.turns: deque[str] = deque()  # the principals with tasks waiting, next first

    def put(self, task: _Task, first: bool = False) -> None:
        queue = self.waiting.get(task.principal)
        if queue is None:
            queue = self.waiting[task.principal] = deque()
            (self.turns.appendleft if first else self.turns.append)(task.principal)
        (queue.appendleft if first else queue.append)(task)

    def take(self) -> _Task:
        """The oldest task of the principal whose turn it is, which then goes to the back
        of the line if it has more."""
        principal = self.turns.popleft()
        queue = self.waiting[principal]
        task = queue.popleft()
        if queue:
            self.turns.append(principal)
        else:
            del self.waiting[principal]
        return task

    def remove(self, task: _Task) -> None:
        queue = self.waiting[task.principal]
        queue.remove(task)
        if not queue:
            del self.waiting[task.principal]
            self.turns.remove(task.principal)

    def all(self) -> list[_Task]:
        return [t for q in self.waiting.values() for t in q]


class WorkPool:
    """`workers` threads, at most `queue_depth` tasks waiting for them and `per_principal`
    tasks of one principal; waiting tasks served round robin between principals. Background
    work in a lane of its own: `background_depth` tasks, after every request's task."""

    def __init__(self, workers: int, queue_depth: int, per_principal: int | None = None,
                 background_depth: int | None = None) -> None:
        self.workers = workers
        self.queue_depth = queue_depth
        self.per_principal = per_principal or default_share(workers, queue_depth)
        self.background_depth = background_depth or workers + queue_depth
        self.background_threads = max(1, workers - 1)
        # Told of each refusal, on the caller's thread: (reason, principal). app.py logs and
        # counts it.
        self.on_refuse: Callable[[str, str], None] = lambda reason, principal: None
        # Told of each background task that raised, on its worker: (principal, the
        # function's name, the exception).
        self.on_background_error: Callable[[str, str, BaseException], None] = \
            log_background_failure
        self._cv = threading.Condition(threading.Lock())
        self._lane = _Lane()  # requests' tasks waiting
        self._bg_lane = _Lane()  # background tasks waiting
        self._tasks = 0  # requests' tasks submitted and not yet finished (running or waiting)
        self._of: dict[str, int] = {}  # the same per principal; none at 0
        self._bg_waiting = 0
        self._bg_running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"router-work-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def tasks(self) -> int:
        """Requests' tasks running or waiting now."""
        return self._tasks

    def tasks_of(self, principal: str) -> int:
        """One principal's requests' tasks running or waiting now."""
        return self._of.get(principal, 0)

    @property
    def principals(self) -> int:
        """Principals with a request's task running or waiting now."""
        return len(self._of)

    @property
    def background(self) -> int:
        """Background tasks running or waiting now."""
        return self._bg_waiting + self._bg_running

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
            # work whose tokens are made goes first: before its principal's parses, and (when
            # its principal had none waiting) before the other principals' turns
            self._lane.put(task, first=not share)
            self._cv.notify()
        # Added outside the lock: a callback run at once (the task already done) takes it.
        task.fut.add_done_callback(lambda _: self._finished(task))
        return task.fut

    def _finished(self, task: _Task) -> None:
        """A request's task's future is done (result, error or cancelled): its place is
        free. Runs exactly once per task, on whichever thread completed or cancelled it."""
        with self._cv:
            self._tasks -= 1
            left = self._of[task.principal] - 1
            if left:
                self._of[task.principal] = left
            else:
                del self._of[task.principal]
            if task.fut.cancelled() and task in self._lane.waiting.get(task.principal, ()):
                self._lane.remove(task)  # its caller left while it waited: its body goes now
        task.fn, task.args = None, ()

    def _next(self) -> _Task | None:
        """The next task in turn (None once closed): a request's while any waits, else
        background work while fewer than `background_threads` of it run."""
        with self._cv:
            while not self._closed:
                if self._lane.turns:
                    return self._lane.take()
                if self._bg_lane.turns and self._bg_running < self.background_threads:
                    self._bg_waiting -= 1
                    self._bg_running += 1
                    return self._bg_lane.take()
                self._cv.wait()
            return None

    def _work(self) -> None:
        while (task := self._next()) is not None:
            try:
                self._run_one(task)
            finally:
                if task.on_drop is not None:
                    with self._cv:
                        self._bg_running -= 1
                        self._cv.notify()  # another thread may take background work now
                    task.fn, task.args = None, ()

    def _run_one(self, task: _Task) -> None:
        fn, args = task.fn, task.args
        if fn is None or not task.fut.set_running_or_notify_cancel():
            return  # cancelled between leaving the queue and here: already uncounted
        try:
            result = fn(*args)
        except BaseException as e:
            if task.on_drop is None:  # as ThreadPoolExecutor: the caller gets it
                task.fut.set_exception(e)
            else:  # background work: nobody reads its future
                task.fut.set_result(None)
                self._report(task.principal, fn, e)
        else:
            task.fut.set_result(result)

    def _report(self, principal: str, fn: Callable[..., Any], error: BaseException) -> None:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            self.on_background_error(principal, name, error)
        except Exception:  # the hook's own failure must not end this thread, nor hide this
            log_background_failure(principal, name, error)

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

    def submit(self, principal: str, fn: Callable[..., Any], *args: Any,
               on_drop: Callable[[str], None] = _ignore) -> None:
        """fn(*args) on a worker in the background lane, nobody waiting for it, counted
        toward none of the requests' bounds. Where it is dropped unrun, now or later to make
        room for another principal's, on_drop(BACKGROUND_FULL) is called once, on the
        thread that dropped it (this one or a later submit's); never on close."""
        task = _Task(principal, fn, args, on_drop)
        with self._cv:
            dropped = task if self._closed else self._room_for(task)
            if dropped is not task:
                self._bg_lane.put(task)
                self._bg_waiting += 1
                self._cv.notify()
        if dropped is not None:
            dropped.fn, dropped.args = None, ()
            (dropped.on_drop or _ignore)(BACKGROUND_FULL)

    def _room_for(self, task: _Task) -> _Task | None:
        """With the lock held, before a background task is added: None when there is room;
        else the task to drop. That is the newest waiting of the principal with the most
        waiting, taken out of the lane, or `task` itself where its own principal would then
        have the most (or nothing waits: every place runs)."""
        if self._bg_waiting + self._bg_running < self.background_depth:
            return None
        waiting = self._bg_lane.waiting
        mine = len(waiting.get(task.principal, ()))
        most = max(waiting, key=lambda p: len(waiting[p]), default=None)
        if most is None or len(waiting[most]) <= mine:
            return task
        victim = waiting[most][-1]
        self._bg_lane.remove(victim)
        self._bg_waiting -= 1
        return victim

    def close(self) -> None:
        """Stop the threads once their running tasks end; waiting tasks are cancelled (the
        background ones without on_drop: the router is stopping)."""
        with self._cv:
            self._closed = True
            background = self._bg_lane.all()
            self._bg_waiting -= len(background)  # never to run: no longer counted
            waiting = self._lane.all() + background
            self._cv.notify_all()
        for t in waiting:
            t.fut.cancel()
