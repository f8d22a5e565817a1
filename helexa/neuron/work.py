"""The neuron's work pool: every call's prompt work, shared fairly between principals.

Before a call reaches admission its prompt is made: the chat template rendered (tools and
all), the text tokenised, images decoded and resized, a constraint grammar built
(Generate and Complete: helexa/neuron/prepare.py; Tokenize: helexa/neuron/tokenize_work.py).
That costs time in proportion to the caller's text (a 2 MB prompt, seconds), before any
admission limit applies. It ran first come first served on threads anyone could fill: one
key's burst of 2 MB prompts kept another's one-word request waiting half a minute, and
calls whose callers had given up still ran.

It runs here instead, on helexa/work_pool.py's pool, the one the router parses on:

- `server.work_threads` threads (unset: half the CPUs the neuron may run on, at least 2
  and at most 8, the engines and the event loop needing the rest, and one more), and at most
  `server.work_queue_depth` calls waiting: beyond that 503 `overloaded`;
- one principal (a key's; every caller without one together) holds at most
  `server.work_per_principal` calls running or waiting (a quarter of the pool's places
  unless set): beyond that 429 `rate_limit_exceeded`, while other principals still get in;
- waiting calls are served round robin between principals, and one principal runs on at
  most all threads but one, so another's call finds a thread while one key's long
  prompts are being tokenised;
- a call whose caller went away (the gRPC call cancelled, its deadline past) is taken
  out of the queue and never runs; one already running finishes and counts till then,
  but Generate's and Tokenize's (`run_stoppable`) are told, and their image work, the
  longest part of a prompt (seconds an image), stops at the next image
  (helexa/neuron/vision/prompt.py): 4 images of 5792 x 5792 pixels went on for 20 s
  of CPU after their client had gone.

Each refusal is counted (`helexa_work_refusals_total`) and logged (`neuron.work_refused`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from helexa.config.neuron import ServerConfig
from helexa.refusal import Refusal
from helexa.work_pool import OVER_SHARE, WorkPool

log = structlog.get_logger(component="neuron")
RETRY_AFTER_MS = 1000
T = TypeVar("T")


class CallerGone(Exception):
    """The work's caller went away: raised by work that checks its `gone` event."""


def work_threads(cfg: ServerConfig) -> int:
    """`server.work_threads`, or half the CPUs this process may run on (2 to 8) and one more:
    the one a principal already running on all the others may not take."""
    if cfg.work_threads:
        return cfg.work_threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(2, min(8, cpus // 2)) + 1


class NeuronWork(WorkPool):
    """The pool sized by `[server]`; its refusals are `Refusal`s naming the key to raise."""

    def __init__(self, cfg: ServerConfig, metrics: Any = None) -> None:
        workers = work_threads(cfg)
        super().__init__(workers, cfg.work_queue_depth, cfg.work_per_principal,
                         max_running=max(1, workers - 1), name="neuron")
        self.metrics = metrics
        self.on_refuse = self._refused
        if metrics is not None:
            metrics.work_tasks.set_function(lambda: self.tasks)
            metrics.work_principals.set_function(lambda: self.principals)

    async def run_stoppable(self, principal: str, fn: Callable[..., T], *args: Any) -> T:
        """`run` of fn(*args, gone): `gone`, a threading.Event, is set when this await is
        cancelled (the caller left), so work already running that checks it (CallerGone)
        stops instead of finishing for nobody."""
        gone = threading.Event()
        try:
            return await self.run(principal, fn, *args, gone)
        except asyncio.CancelledError:
            gone.set()
            raise

    def reshare(self, cfg: ServerConfig) -> None:
        """A reloaded `server.work_per_principal` (threads and queue wait for a restart)."""
        self.set_share(cfg.work_per_principal)

    def refusal(self, reason: str, principal: str) -> Refusal:
        if reason == OVER_SHARE:
            whose = ("callers without an API key (who share one allowance)" if not principal
                     else "this principal")
            return Refusal("rate_limit_exceeded",
                           f"too many calls of {whose} are already having their prompt made "
                           f"on this neuron or waiting to ({self.per_principal}, "
                           f"server.work_per_principal); retry", RETRY_AFTER_MS)
        return Refusal("overloaded",
                       f"this neuron is busy: {self.workers + self.queue_depth} calls are "
                       f"already having their prompt made or waiting to (server.work_threads "
                       f"+ server.work_queue_depth); retry", RETRY_AFTER_MS)

    def _refused(self, reason: str, principal: str) -> None:
        if self.metrics is not None:
            self.metrics.work_refusals.labels(reason).inc()
        log.info("neuron.work_refused", principal=principal or "anonymous", reason=reason,
                 principal_tasks=self.tasks_of(principal), tasks=self.tasks,
                 share=self.per_principal)
