"""A bounded pool of worker threads for request work that grows with the request, shared
fairly between principals: the router's parsing (helexa/router/work_pool.py) and the
neuron's prompt work (helexa/neuron/work.py) each run one.

An event loop that carries every stream and report must not hold itself for seconds on one
request's work (30,000 tools compiled, a 1 MB `pattern`, a 2 MB prompt tokenised); that work
runs here instead. What the pool refuses, and in whose words, is the daemon's: `refusal`
makes the exception a refused `run` raises.

The pool is bounded twice: `workers` threads, and at most `queue_depth`
tasks waiting for one. Past that, `run` refuses at once (the daemons' 503
`overloaded`: a client backs off on it) instead of queueing without end. A
task counts until its thread finishes it, even when the request that asked
for it has gone, so the bound is on work, not on waiting callers; a task still
waiting when its caller leaves is taken out of the queue, never runs, and stops
counting at once.

One client must not take the pool from everyone (docs/http.md, "Generation
requests"), so each task belongs to a principal (the caller's API key's, or
one for every caller without one) and the pool shares itself three ways:

- a cap, `per_principal` tasks running or waiting of one principal: past it
  that principal's `run` is refused (the daemons' 429 `rate_limit_exceeded`)
  while everyone else's still gets in. The cap is checked before the pool's
  own bound, so a principal over its share hears that it is, not that the
  pool is busy. Work a request needs once its tokens are made (`share=False`:
  the router encoding a reply) counts toward the cap and the pool's bound
  but is never refused by either, and waits ahead of the rest: a refusal
  would throw the tokens away and invite a retry that makes them again.
- the order: waiting tasks are served round robin between principals, each
  principal's in the order they came, so one key's backlog delays another's
  task by at most one task per principal with work waiting, not by the whole
  backlog.
- optionally, `max_running` tasks of one principal running at once (the
  neuron: one thread fewer than the pool, so another principal's task finds a
  thread free while one principal's long tasks run); a principal at it waits
  for its own tasks, not anyone else's. Unset (the router), a principal may
  run on every thread.

Background work (`submit`: checking a finished reply against its schema, which
nobody waits for) is a lane of its own, so a principal's finished requests can
never make its next one refused: it counts toward neither the principal's
share nor the pool's bound, and it runs only when no request's task is waiting
and on at most `workers - 1` threads (the one thread of a pool of one), so
with two workers or more it never holds every thread. Its own bound is
`background_depth` tasks running or waiting (`workers + queue_depth` unless
given), served round robin between principals too; when it is full the task
dropped is the newest of the principal with the most waiting (the new one, when
that is its own principal), so one key's checks cannot push out everyone
else's. A dropped task's caller is told (`on_drop`); it is diagnostics, not
the client's answer. Nobody awaits background work, so an exception it raises is
told to `on_background_error` (the router counts it and logs it with its
traceback), never kept on a future nobody reads; the thread goes on to the next
task.

A task runs as its principal (helexa/principal_cache.py): the grammar work it caches is
filed under that principal, never found by another's task.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from helexa.principal_cache import as_principal

T = TypeVar("T")
# What a refusal was for: a principal over its share, or the pool as a whole full.
OVER_SHARE = "principal_share"
POOL_FULL = "pool_full"
# Why background work was dropped: its own lane was full (or the pool closing).
BACKGROUND_FULL = "background_full"


def default_share(workers: int, queue_depth: int) -> int:
    """A principal's share when its daemon's config names none: a quarter of the pool's
    places, so it takes at least four principals at their cap to fill it."""
    return max(1, (workers + queue_depth) // 4)


def _ignore(reason: str) -> None:
    pass


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

    def take(self, held: Callable[[str], bool] = lambda p: False) -> _Task | None:
        """The oldest task of the first principal in turn that `held` does not hold back,
        which then goes to the back of the line if it has more; None if all are held."""
        principal = next((p for p in self.turns if not held(p)), None)
        if principal is None:
            return None
        self.turns.remove(principal)
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
    tasks of one principal (`max_running` of them running at once, where given); waiting
    tasks served round robin between principals. Background work in a lane of its own:
    `background_depth` tasks, after every request's task. A daemon's subclass says what a
    refusal is (`refusal`)."""

    def __init__(self, workers: int, queue_depth: int, per_principal: int | None = None,
                 background_depth: int | None = None, *, max_running: int | None = None,
                 name: str = "work") -> None:
        self.workers = workers
        self.queue_depth = queue_depth
        self.per_principal = 0
        self.set_share(per_principal)
        self.max_running = max_running or workers
        self.background_depth = background_depth or workers + queue_depth
        self.background_threads = max(1, workers - 1)
        # Told of each refusal, on the caller's thread: (reason, principal).
        self.on_refuse: Callable[[str, str], None] = lambda reason, principal: None
        # Told of each background task that raised, on its worker: (principal, the
        # function's name, the exception).
        self.on_background_error: Callable[[str, str, BaseException], None] = \
            self.report_failure
        self._cv = threading.Condition(threading.Lock())
        self._lane = _Lane()  # requests' tasks waiting
        self._bg_lane = _Lane()  # background tasks waiting
        self._tasks = 0  # requests' tasks submitted and not yet finished (running or waiting)
        self._of: dict[str, int] = {}  # the same per principal; none at 0
        self._running_of: dict[str, int] = {}  # requests' tasks on a thread, per principal
        self._bg_waiting = 0
        self._bg_running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-work-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def set_share(self, per_principal: int | None) -> None:
        """`per_principal`, or where None the default share of this pool's places."""
        self.per_principal = per_principal or default_share(self.workers, self.queue_depth)

    def refusal(self, reason: str, principal: str) -> Exception:
        """What a refused `run` raises: OVER_SHARE (the principal holds `per_principal`) or
        POOL_FULL (`workers + queue_depth` tasks held). The daemon's words."""
        return RuntimeError(f"work pool: {reason} ({principal})")

    def report_failure(self, principal: str, task: str, error: BaseException) -> None:
        """`on_background_error` unless the daemon sets its own (and where its hook fails)."""
        print(f"background work {task} of {principal} failed:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)

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
        # Added outside the lock: a callback run at once (the task already done) takes it,
        # and _finished drops task.fut: the future is read first
        fut = task.fut
        fut.add_done_callback(lambda _: self._finished(task))
        return fut

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
        # the future's callbacks hold this task, the task the future, the future its error,
        # whose traceback the caller's frames: a cycle only the collector's rare full pass
        # frees (a refused 7.8 MB prompt's request and text). Nothing reads it now (_run_one
        # stops at fn None).
        del task.fut

    def _held(self, principal: str) -> bool:
        return self._running_of.get(principal, 0) >= self.max_running

    def _next(self) -> _Task | None:
        """The next task in turn (None once closed): a request's while any waits whose
        principal runs fewer than `max_running`, else background work while fewer than
        `background_threads` of it run."""
        with self._cv:
            while not self._closed:
                if self._lane.turns and (task := self._lane.take(self._held)) is not None:
                    self._running_of[task.principal] = \
                        self._running_of.get(task.principal, 0) + 1
                    return task
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
                with self._cv:
                    if task.on_drop is None:
                        left = self._running_of[task.principal] - 1
                        if left:
                            self._running_of[task.principal] = left
                        else:
                            del self._running_of[task.principal]
                    else:
                        self._bg_running -= 1
                    self._cv.notify()  # another thread may take held or background work now
                if task.on_drop is not None:
                    task.fn, task.args = None, ()

    def _run_one(self, task: _Task) -> None:
        # its future first: a cancel on another thread may finish the task (_finished drops
        # task.fut) between this thread taking it from the queue and here
        fut: Future[Any] | None = getattr(task, "fut", None)
        fn, args = task.fn, task.args
        if fut is None or fn is None or not fut.set_running_or_notify_cancel():
            return  # cancelled between leaving the queue and here: already uncounted
        try:
            result = as_principal(task.principal, fn, *args)  # its grammar caches' owner
        except BaseException as e:
            if task.on_drop is None:  # as ThreadPoolExecutor: the caller gets it
                fut.set_exception(e)
            else:  # background work: nobody reads its future
                fut.set_result(None)
                self._report(task.principal, fn, e)
        else:
            fut.set_result(result)
        del fut  # (set_exception: the error's traceback holds this frame)

    def _report(self, principal: str, fn: Callable[..., Any], error: BaseException) -> None:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            self.on_background_error(principal, name, error)
        except Exception:  # the hook's own failure must not end this thread, nor hide this
            self.report_failure(principal, name, error)

    async def run(self, principal: str, fn: Callable[..., T], *args: Any,
                  share: bool = True) -> T:
        """fn(*args) on a worker, counted as `principal`'s; its exception is raised here.
        Raises `refusal(OVER_SHARE)` when the principal holds its share, `refusal(POOL_FULL)`
        when the pool is full; neither where `share` is False (work whose tokens are made:
        it waits ahead of the rest instead). Cancelled while its task waits, the task never
        runs."""
        got = self._try_submit(principal, fn, args, share)
        if isinstance(got, str):
            self.on_refuse(got, principal)
            raise self.refusal(got, principal)
        try:
            result: T = await asyncio.wrap_future(got)
        finally:  # a raised e's traceback holds this frame, and got holds e: no cycle
            del got
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
            fut = getattr(t, "fut", None)  # None: a worker took it and it finished meanwhile
            if fut is not None:
                fut.cancel()
