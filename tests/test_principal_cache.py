"""Grammar work is cached per principal (helexa/principal_cache.py): a schema one key had
compiled is compiled again for another key (no timing oracle on what others sent), a key's
repeat is not, and the cache stays within its bounds however many keys fill it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import llguidance
import pytest

from helexa import grammar
from helexa.principal_cache import PrincipalCache, as_principal
from helexa.router import schema_check
from helexa.work_pool import WorkPool


class Counting:
    """llguidance.LLMatcher, counting the JSON schemas it compiles into grammars."""

    def __init__(self, real: Any) -> None:
        self.real, self.schemas = real, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def __call__(self, *a: Any, **kw: Any) -> Any:
        return self.real(*a, **kw)

    def grammar_from_json_schema(self, schema: Any, *a: Any, **kw: Any) -> Any:
        self.schemas.append(json.dumps(schema))
        return self.real.grammar_from_json_schema(schema, *a, **kw)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Counting:
    counting = Counting(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    return counting


def schema(name: str) -> grammar.Constraint:
    return grammar.json_schema({"type": "object", "properties": {name: {"type": "integer"}},
                                "required": [name]})


def test_a_schema_one_key_compiled_is_compiled_again_for_another(compiles: Counting) -> None:
    s = schema("only_alice_sent_this")
    as_principal("alice", grammar.check, s)
    as_principal("alice", grammar.check, s)
    assert len(compiles.schemas) == 1  # alice's repeat: her own cached grammar
    as_principal("bob", grammar.check, s)
    assert len(compiles.schemas) == 2  # bob finds nothing of alice's: compiled again
    as_principal("alice", grammar.check, s)
    assert len(compiles.schemas) == 2
    grammar.check(s)
    grammar.check(s)
    assert len(compiles.schemas) == 4  # run as nobody: never cached, never found


def test_a_work_pool_task_caches_as_its_principal(compiles: Counting) -> None:
    """The router's compile pool and the neuron's prompt work run their tasks here."""
    pool = WorkPool(2, 8)
    s = schema("sent_through_the_pool")

    async def go() -> None:
        for who in ("alice", "alice", "bob", "bob", "alice"):
            await pool.run(who, grammar.check, s)
    try:
        asyncio.run(go())
    finally:
        pool.close()
    assert len(compiles.schemas) == 2  # once per principal


def test_the_cache_stays_within_its_bounds_and_a_flood_evicts_its_own() -> None:
    calls: list[str] = []

    def work(x: str) -> str:
        calls.append(x)
        return x * 2

    cache = PrincipalCache(work, entries=16, max_bytes=10**9)
    for k in ("a1", "a2"):
        as_principal("alice", cache, k)
    for i in range(1000):  # bob sends a thousand schemas
        as_principal(f"bob{i % 3}", cache, f"b{i}")
        assert cache.held()[0] <= 16
    before = len(calls)
    for k in ("a1", "a2"):  # alice, holding less than any flooding key, kept hers
        as_principal("alice", cache, k)
    assert len(calls) == before
    big = PrincipalCache(work, entries=1000, max_bytes=64 * 1024)
    for i in range(200):
        as_principal(f"p{i % 5}", big, f"{i:04}" + "x" * 4096)
        assert big.held()[1] <= 64 * 1024  # the bytes bound: ~8 KiB an entry
    assert 0 < big.held()[0] < 10


def test_schema_checks_patterns_are_kept_per_principal(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[str] = []
    real = schema_check.re.compile
    monkeypatch.setattr(schema_check.re, "compile",
                        lambda p, *a: (compiled.append(p), real(p, *a))[1])
    s = {"type": "string", "pattern": "^only-alice-[0-9]+$"}
    for who in ("alice", "alice", "bob"):
        assert as_principal(who, schema_check.json_violations, '"x"', s)
    assert compiled.count("^only-alice-[0-9]+$") == 2
