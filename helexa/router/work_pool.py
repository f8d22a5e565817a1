"""A bounded pool of worker threads for request work that grows with the request.

The router's event loop carries every client stream and every neuron's
Watch reports: a request that held it for seconds (30,000 tools compiled, a
1 MB `pattern`) let reports go unheard, the neuron left rotation and every
stream on it was cut. Parsing a body, compiling its schemas and checking a
finished reply against them run here instead. The loop keeps turning while
they run: the router sets a 0.5 ms GIL switch interval (app.py), so a worker
busy in Python gives the loop the interpreter that often.

The pool is bounded twice: `workers` threads, and at most `queue_depth`
tasks waiting for one. Past that, `run` refuses at once with 503
`overloaded` (a client backs off on it) instead of queueing without end; a
background task (`submit`) is dropped and the caller told. A task counts
until its thread finishes it, even when the request that asked for it has
gone, so the bound is on work, not on waiting callers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from helexa.router.errors import ApiError

T = TypeVar("T")


class WorkPool:
    """`workers` threads and a queue of at most `queue_depth` tasks waiting for them."""

    def __init__(self, workers: int, queue_depth: int) -> None:
        self.workers = workers
        self.queue_depth = queue_depth
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="router-work")
        self._lock = threading.Lock()  # _tasks is counted down in the worker threads
        self._tasks = 0  # submitted and not yet finished (running or waiting)

    @property
    def tasks(self) -> int:
        """Tasks running or waiting now."""
        return self._tasks

    def _try_submit(self, fn: Callable[..., T], *args: Any) -> Future[T] | None:
        with self._lock:
            if self._tasks >= self.workers + self.queue_depth:
                return None
            self._tasks += 1
        fut = self._executor.submit(fn, *args)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _: Future[Any]) -> None:
        with self._lock:
            self._tasks -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a worker; its exception (an ApiError among them) is raised here.
        Raises ApiError(503 overloaded) when the pool is full."""
        fut = self._try_submit(fn, *args)
        if fut is None:
            raise ApiError(503, f"the router is busy: {self.workers + self.queue_depth} "
                                f"requests are already being parsed or waiting to be "
                                f"(limits.schema_workers + limits.schema_queue_depth); retry",
                           code="overloaded")
        return await asyncio.wrap_future(fut)

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """fn(*args) on a worker, nobody waiting for it; False (and not run) when full."""
        return self._try_submit(fn, *args) is not None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
