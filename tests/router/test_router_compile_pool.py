"""Grammar compiling is bounded and kept apart from body parsing (docs/http.md, "Generation
requests"): a custom tool's grammar over its cap is a 400 naming the cap before anything is
compiled, and requests whose schemas take long to compile, holding every compile thread,
never keep another request's body from being parsed and served."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading

import httpx2
from router_fleet import ALICE_KEY

from helexa import grammar

MSG = [{"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def custom(definition: str, syntax: str) -> dict:
    return {"model": "tiny", "input": "x", "max_output_tokens": 3, "tools": [{
        "type": "custom", "name": "g", "format": {"type": "grammar", "syntax": syntax,
                                                  "definition": definition}}]}


def test_a_grammar_over_its_cap_is_a_400_naming_it_before_anything_is_compiled(fl,
                                                                                monkeypatch):
    compiled: list[str] = []
    real = grammar.check
    monkeypatch.setattr(grammar, "check", lambda c: (compiled.append(c.kind), real(c))[1])
    caps = dataclasses.replace(fl.state.caps, max_grammar_bytes=4096)  # the body cap is 64 KiB
    monkeypatch.setattr(fl.state, "caps", caps)
    lark = "start: x\nx: " + " | ".join(f'"w{i}"' for i in range(caps.max_grammar_bytes // 6))
    for body, cap in ((custom(lark, "lark"), "limits.max_grammar_bytes"),
                      (custom("a" * (caps.max_pattern_chars + 1), "regex"),
                       "limits.max_pattern_chars")):
        r = httpx2.post(fl.url + "/v1/responses", timeout=30, json=body)
        assert r.status_code == 400, r.text[:300]
        e = r.json()["error"]
        assert e["param"] == "tools[0].format.definition" and cap in e["message"], e
    assert compiled == []  # refused on its size, never compiled
    r = httpx2.post(fl.url + "/v1/responses", timeout=30, json=custom('start: "ab"', "lark"))
    assert r.status_code == 200 and compiled == ["lark"], r.text[:300]


def test_schemas_compiling_on_every_thread_never_hold_up_a_plain_request(fl, monkeypatch):
    """Two principals' (alice's, and the callers without a key) response schemas hold both
    compile threads (their compile waits here until released); a plain chat request of
    alice's is parsed and answered meanwhile. Where compiling shared the parsing threads,
    both were held and the plain request waited for a compile to end."""
    entered, release = [], threading.Event()
    real = grammar.enforceable

    def slow(schema):
        entered.append(schema)
        assert release.wait(30)
        return real(schema)
    monkeypatch.setattr(grammar, "enforceable", slow)
    heavy = {"model": "tiny", "messages": MSG, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}}
    alice = {"Authorization": f"Bearer {ALICE_KEY}"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow_ones = [pool.submit(httpx2.post, fl.url + "/v1/chat/completions", timeout=60,
                                 json=heavy, headers=h) for h in (alice, {})]
        try:
            for _ in range(500):
                if len(entered) == 2 or any(f.done() for f in slow_ones):
                    break
                threading.Event().wait(0.02)
            assert len(entered) == 2, [f.result().text[:200] for f in slow_ones if f.done()]
            plain = httpx2.post(fl.url + "/v1/chat/completions", timeout=10, headers=alice,
                                json={"model": "tiny", "messages": MSG, "max_tokens": 2})
            assert plain.status_code == 200, plain.text[:300]
            assert not any(f.done() for f in slow_ones)  # still compiling
        finally:
            release.set()
        assert [f.result().status_code for f in slow_ones] == [200, 200]


def test_a_schema_another_key_sent_is_compiled_again_and_a_keys_repeat_is_not(fl, monkeypatch):
    """The router's compiled grammars are kept per principal (helexa/principal_cache.py):
    where they were shared, the caller without a key got alice's compiled schema at once
    and could time that she had sent it."""
    import llguidance

    real, compiled = llguidance.LLMatcher, []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *a, **kw):
            return real(*a, **kw)

        def grammar_from_json_schema(self, schema, *a, **kw):
            compiled.append(json.dumps(schema))
            return real.grammar_from_json_schema(schema, *a, **kw)
    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    own = {"type": "object", "properties": {"alices_own": {"type": "integer"}}}
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "o", "schema": own}}}
    alice = {"Authorization": f"Bearer {ALICE_KEY}"}
    for headers, total in ((alice, 1), (alice, 1), ({}, 2), ({}, 2), (alice, 2)):
        r = httpx2.post(fl.url + "/v1/chat/completions", timeout=30, json=body, headers=headers)
        assert r.status_code == 200, r.text[:300]
        assert sum("alices_own" in s for s in compiled) == total, (headers, compiled)
