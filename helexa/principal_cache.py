"""Caches of grammar work, kept per principal: what one API key compiled is never another's.

helexa.grammar and helexa/router/schema_check.py keep what they computed for a schema
(its grammar, whether it ends, a compiled `pattern`): a repeated schema then costs
nothing. A cache shared by every key would be an oracle (a hit answers in microseconds
where a compile takes seconds, so key B could time whether key A recently sent a schema),
and one key could push every other key's entries out. So each entry is filed under the
principal whose work made it, as the neuron's compiled grammars are filed under its
prefix-cache salt (helexa/neuron/engine/grammar.py): key B never finds key A's entry.

The principal is the one `as_principal` runs a task for: each work-pool task runs as its
own (helexa/work_pool.py: the router's body parsing, grammar compiling and reply checks,
the neuron's prompt work). Outside any (a test, the engine's warm-up) the work is not
cached at all, so nothing computed for nobody can be found by somebody.

Each cache is bounded in total, in entries and in bytes of the strings it holds (a
schema's grammar can be megabytes). Past either bound the entry dropped is the least
recently used of the principal holding the most (entries or bytes, whichever bound is
over), so one key filling the cache pushes out its own entries, not a key that holds
less than it.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_PRINCIPAL: ContextVar[str | None] = ContextVar("helexa_cache_principal", default=None)


def as_principal(principal: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs), its cached grammar work filed under `principal`."""
    token = _PRINCIPAL.set(principal)
    try:
        return fn(*args, **kwargs)
    finally:
        _PRINCIPAL.reset(token)


def _size(args: tuple[Any, ...], value: Any) -> int:
    """The bytes an entry holds, about: its string arguments and result (the rest is small)."""
    return 64 + sum(len(a) for a in (*args, value) if isinstance(a, (str, bytes)))


class PrincipalCache(Generic[T]):
    """fn's results by (principal, arguments), at most `entries` and `max_bytes` in all.
    An exception is not kept (the next call computes again), as with functools.lru_cache."""

    def __init__(self, fn: Callable[..., T], entries: int, max_bytes: int) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.entries, self.max_bytes = fn, entries, max_bytes
        self._by: dict[str, OrderedDict[tuple[Any, ...], tuple[T, int]]] = {}
        self._bytes: dict[str, int] = {}
        self._count = self._total_bytes = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> T:
        principal = _PRINCIPAL.get()
        if principal is None:
            return self.fn(*args)
        with self._lock:
            mine = self._by.get(principal)
            hit = mine.get(args) if mine is not None else None
            if hit is not None:
                mine.move_to_end(args)  # type: ignore[union-attr]
                return hit[0]
        value = self.fn(*args)  # outside the lock: a compile takes seconds
        self._put(principal, args, value)
        return value

    def _put(self, principal: str, args: tuple[Any, ...], value: T) -> None:
        size = _size(args, value)
        with self._lock:
            mine = self._by.setdefault(principal, OrderedDict())
            old = mine.pop(args, None)
            grown = size - (old[1] if old is not None else 0)  # another thread's, replaced
            mine[args] = (value, size)
            self._count += old is None
            self._total_bytes += grown
            self._bytes[principal] = self._bytes.get(principal, 0) + grown
            while self._count > self.entries or (self._total_bytes > self.max_bytes
                                                 and self._count > 1):
                by_bytes = self._total_bytes > self.max_bytes
                victim = max(self._by, key=lambda p: self._bytes[p] if by_bytes
                             else len(self._by[p]))
                _, (_, dropped) = self._by[victim].popitem(last=False)
                self._drop(victim, dropped)

    def _drop(self, principal: str, size: int) -> None:
        self._count -= 1
        self._total_bytes -= size
        self._bytes[principal] -= size
        if not self._by[principal]:
            del self._by[principal], self._bytes[principal]

    def held(self) -> tuple[int, int]:
        """(entries, bytes) held, over every principal."""
        with self._lock:
            return self._count, self._total_bytes

    def cache_clear(self) -> None:
        with self._lock:
            self._by.clear()
            self._bytes.clear()
            self._count = self._total_bytes = 0


def per_principal(entries: int, max_bytes: int = 32 * 2**20
                  ) -> Callable[[Callable[..., T]], PrincipalCache[T]]:
    """Decorator: the function's results kept per principal (PrincipalCache)."""
    return lambda fn: PrincipalCache(fn, entries, max_bytes)
