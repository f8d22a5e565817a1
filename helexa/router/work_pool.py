"""The router's work pool: request work that grows with the request, off the event loop.

The router's event loop carries every client stream and every neuron's
Watch reports: a request that held it for seconds (30,000 tools compiled, a
1 MB `pattern`) let reports go unheard, the neuron left rotation and every
stream on it was cut. Parsing a body, compiling its schemas, building its
neuron requests, encoding a whole reply and checking a finished reply
against its schemas run on this pool instead (helexa/work_pool.py: bounded,
shared round robin between principals). The loop keeps turning while they
run: the router sets a 0.5 ms GIL switch interval (app.py), so a worker busy
in Python gives the loop the interpreter that often.

Its bounds are `limits.schema_workers` threads and `limits.schema_queue_depth`
tasks waiting (503 `overloaded` beyond), and `limits.schema_per_principal`
tasks of one principal (the caller's API key's, or `anonymous` for every
caller without one), running or waiting: 429 `rate_limit_exceeded` beyond.
Encoding a reply once the neuron has answered (`share=False`) is never
refused, and a finished reply's schema check is background work
(`submit`; app.py counts and logs a failure as `router.background_work_failed`).
Compiling a request's grammars, once its body is parsed, runs on a second pool of
the same kind (`limits.compile_workers` threads; agent_request.py): a schema that
takes seconds to compile holds a compile thread, never one that parses bodies.
Where the router has keys (`auth.keys_file`), one principal runs on at most
`limits.schema_workers` - 1 threads (`max_running`; the one thread of a pool of
one), so a key's slow bodies never keep another key's parse waiting for a
thread; without keys every caller is one principal, and it runs on all of them.
"""

from __future__ import annotations

from helexa.log import get_logger
from helexa.router.errors import ApiError
from helexa.work_pool import BACKGROUND_FULL, OVER_SHARE, POOL_FULL
from helexa.work_pool import WorkPool as _Pool
from helexa.work_pool import default_share as default_share

__all__ = ["BACKGROUND_FULL", "OVER_SHARE", "POOL_FULL", "WorkPool", "default_share",
           "log_background_failure"]


def log_background_failure(principal: str, task: str, error: BaseException) -> None:
    """`on_background_error` unless the router sets its own: the failure, logged."""
    get_logger("router").error("router.background_work_failed", principal=principal,
                               task=task, error=repr(error), exc_info=error)


class WorkPool(_Pool):
    """The generic pool, its refusals the router's ApiErrors and its threads `router-work-N`
    (`compiling`: the compile pool, `router-compile-work-N`, whose refusals say so)."""

    def __init__(self, workers: int, queue_depth: int, per_principal: int | None = None,
                 background_depth: int | None = None, *, compiling: bool = False) -> None:
        super().__init__(workers, queue_depth, per_principal, background_depth,
                         name="router-compile" if compiling else "router")
        self.doing, self.workers_key = (("having their grammars compiled", "compile_workers")
                                        if compiling else ("being parsed", "schema_workers"))

    def refusal(self, reason: str, principal: str) -> ApiError:
        if reason == OVER_SHARE:
            whose = ("callers without an API key (who share one allowance)"
                     if principal == "anonymous" else "this API key")
            return ApiError(429, f"too many requests of {whose} are already {self.doing} "
                                 f"or waiting to be ({self.per_principal}, "
                                 f"limits.schema_per_principal); retry",
                            code="rate_limit_exceeded")
        return ApiError(503, f"the router is busy: {self.workers + self.queue_depth} "
                             f"requests are already {self.doing} or waiting to be "
                             f"(limits.{self.workers_key} + limits.schema_queue_depth); retry",
                        code="overloaded")

    def report_failure(self, principal: str, task: str, error: BaseException) -> None:
        log_background_failure(principal, task, error)
