"""How the engine's processes start: an engine process (client.py) and its tensor-parallel
ranks 1..N-1 (tp_worker.py).

``spawn``, the default: a fresh interpreter that imports torch and the engine itself (some
seconds on a small host), nothing of the parent carried over, as CUDA requires.

``HELEXA_ENGINE_START=forkserver`` (docs/operating.md, "Engine processes"): they fork from
a server process that imported torch and the engine once, started at the first use in
each process that starts engines (multiprocessing's forkserver): a tensor-parallel rank
starts in a fraction of a second. The test suite's own engines start this way
(set_default), the daemons it runs as a user would. The child still sees the
starting process's environment, and writes to its stdout and stderr, as they are at the
start (``_as_started``), as a spawned one would; what torch reads when it is imported is
the server's. A rank's parent is then the server, so
PR_SET_PDEATHSIG (tp_rank.py) stops it when the server ends; the engine process ending
closes the rank's pipe, which stops it as well.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.context import BaseContext, ForkServerContext, SpawnContext
from typing import Any

ENV = "HELEXA_ENGINE_START"
METHODS = ("spawn", "forkserver")
# what the server imports once, for every process it starts
PRELOAD = ["torch", "helexa.neuron.engine.process", "helexa.neuron.engine.model_runner",
           "helexa.neuron.engine.tp_rank"]


_default = "spawn"


def set_default(name: str) -> None:
    """The method where HELEXA_ENGINE_START is unset, in this process only (the test suite
    picks forkserver for the engines it starts itself; the daemons it runs keep spawn)."""
    global _default
    if name not in METHODS:
        raise ValueError(f"expected one of {', '.join(METHODS)}, got `{name}`")
    _default = name


def method() -> str:
    got = os.environ.get(ENV, "") or _default
    if got not in METHODS:
        raise ValueError(f"{ENV}: expected one of {', '.join(METHODS)}, got `{got}`")
    return got


def context() -> SpawnContext | ForkServerContext:
    """The multiprocessing context the engine's processes start in."""
    if method() == "spawn":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def target(ctx: BaseContext, fn: Callable[..., None], args: tuple[Any, ...]
           ) -> tuple[Callable[..., None], tuple[Any, ...]]:
    """``(target, args)`` for ``ctx.Process``: under forkserver, ``fn`` runs in the
    environment the starting process has now, not the one the server was started in."""
    if ctx.get_start_method() != "forkserver":
        return fn, args
    return _as_started, (dict(os.environ), _StdStreams(), fn, args)


class _StdStreams:
    """The starting process's fds 1 and 2, handed over as the child is started."""

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


def _as_started(environ: dict[str, str], streams: tuple[Any, Any], fn: Callable[..., None],
                args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for target_fd, dup in zip((1, 2), streams, strict=True):
        fd = dup.detach()
        os.dup2(fd, target_fd)
        os.close(fd)
    fn(*args)
