"""Grammars compile off the engine's step loop (engine/grammar.py): the batch keeps stepping
while a large grammar compiles, the request waits queued (no place, KV or row) until its
matcher is ready, a bad grammar is still refused with llguidance's message, a request that
ends while its grammar compiles leaves nothing behind, and the n choices of one request
compile their grammar once."""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import pytest
from support.engine import assert_whole, drive
from support.fake_runner import FakeRunner

from helexa import grammar
from helexa.fixtures.tiny import init_tiny
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.tokenizer import Tokenizer

SMALL = grammar.grammar_text(grammar.json_schema({
    "type": "object", "additionalProperties": False, "required": ["n"],
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}))
BAD = '{"grammars": [{"lark_grammar": "start: nope"}]}'  # `nope` is no rule


def wide_schema(n: int) -> str:
    """A JSON schema of `n` required properties: compiling it takes ~0.1 CPU s a 1,000."""
    return grammar.grammar_text(grammar.json_schema({
        "type": "object", "additionalProperties": False,
        "required": [f"p{i}" for i in range(n)],
        "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = init_tiny(tmp_path_factory.mktemp("tiny") / "m")
    return d, Tokenizer.from_dir(d)


def core_for(model_dir, *, fake: bool = True) -> EngineCore:
    spec = EngineSpec(model_id="t", model_dir=str(model_dir), num_blocks=256, block_size=16,
                      context=1024, bytes_per_token=2 if fake else 0,
                      limits=m.Limits(anon_max_in_flight=64))
    return EngineCore(spec, FakeRunner(512, 256, 16) if fake else None)


class Builds:
    """llguidance.LLMatcher counted, and held until `go` is set where `hold` is: a test
    decides when a compile ends (at most 10 s later, so an engine that compiles on its
    step loop ends the wait and fails the test's assertions instead of hanging)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, hold: bool = False) -> None:
        self.grammars: list[str] = []
        self.go, self.began = threading.Event(), threading.Event()
        if not hold:
            self.go.set()
        self.real = llguidance.LLMatcher
        monkeypatch.setattr(llguidance, "LLMatcher", self)

    def __call__(self, tokenizer: Any, text: str, **kw: Any) -> Any:
        self.grammars.append(text)
        self.began.set()
        self.go.wait(10)
        return self.real(tokenizer, text, **kw)

    def __getattr__(self, name: str) -> Any:  # its static methods (helexa.grammar's)
        return getattr(self.real, name)


def new(rid: str, prompt: list[int], max_tokens: int = 20, **kw: Any) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=m.SamplingParams(temperature=0.0), **kw)


def test_a_running_stream_keeps_its_tokens_while_a_large_grammar_compiles(tiny):
    """A 3,000-property schema arrives beside a decoding stream: until the schema's request
    is admitted, steps go on and the stream gets a token in each (on the step loop, the
    compile held every stream for its whole time: no step ran between its arrival and its
    admission)."""
    d, tok = tiny
    core = core_for(d, fake=False)
    prompt = tok.encode_chat([{"role": "user", "content": "Talk."}])
    core.step(m.ToEngine(new=[new("free", prompt, max_tokens=900)]))
    while "free" not in [r.req_id for r in core.running]:
        core.step()
    big = new("big", prompt, max_tokens=4, grammar=wide_schema(3000))
    inbound: m.ToEngine | None = m.ToEngine(new=[big])
    steps_before = tokens_before = 0  # while "big" was not yet admitted and "free" ran
    free_on = True  # a slow compile may outlast free's 900 tokens: its steps after count not
    for _ in range(100_000):
        updates = {u.req_id: u for u in core.step(inbound).updates}
        inbound = None
        if "big" in updates and updates["big"].admitted:
            break
        assert "big" not in updates or updates["big"].refused_code is None
        if free_on:
            steps_before += 1
            tokens_before += len(updates["free"].new_token_ids) if "free" in updates else 0
            free_on = "free" not in updates or updates["free"].finished is None
    assert steps_before >= 1 and tokens_before >= steps_before, (steps_before, tokens_before)
    core.step(m.ToEngine(aborts=[m.Abort(req_id="free")]))
    run = drive(core)
    assert run.final["big"].finished == m.FinishReason.LENGTH  # it decoded under its grammar
    assert_whole(core)
    core.close()


def test_a_request_behind_one_whose_grammar_compiles_is_not_held(tiny, monkeypatch):
    """The same caller's next request (here anonymous, as every anonymous caller) passes
    the one whose grammar compiles: it is admitted and served meanwhile; the first is
    admitted once its grammar has compiled."""
    d, _ = tiny
    core = core_for(d)
    builds = Builds(monkeypatch, hold=True)
    run = drive(core, m.ToEngine(new=[new("g", [1, 2, 3], 4, grammar=SMALL),
                                      new("free", [4, 5, 6], 6)]), max_steps=1000,
                on_update=lambda u: u.req_id != "free" or u.finished is None
                or builds.go.set())
    assert run.final["free"].finished == m.FinishReason.LENGTH
    assert run.admitted["free"].req_id == "free" and run.final["g"].finished is not None
    order = list(run.final)
    assert order.index("free") < order.index("g")
    assert_whole(core)
    core.close()


def test_a_bad_grammar_is_refused_with_llguidances_message_compiled_once(tiny, monkeypatch):
    d, _ = tiny
    core = core_for(d)
    builds = Builds(monkeypatch)
    reqs = [new(f"bad{i}", [1, 2, 3], 4, grammar=BAD) for i in range(3)]
    run = drive(core, m.ToEngine(new=[*reqs, new("free", [4, 5, 6], 8)]))
    for r in reqs:
        assert run.final[r.req_id].refused_code == "invalid_request_error"
        message = run.final[r.req_id].refused_message
        assert message.startswith("response_format: ") and "nope" in message, message
    assert run.final["free"].finished == m.FinishReason.LENGTH
    assert builds.grammars == [BAD]  # the three choices' one grammar, compiled once
    assert_whole(core)
    core.close()


def test_the_n_choices_of_a_request_compile_their_grammar_once(tiny, monkeypatch):
    """Three choices of one caller's schema compile it once and each decodes under its own
    copy (a valid answer each); the same schema from another key compiles again (the
    cache is salted per key as the prefix cache is), and from the first key, not again."""
    d, tok = tiny
    core = core_for(d)
    builds = Builds(monkeypatch)
    prompt = tok.encode_chat([{"role": "user", "content": "A number."}])
    choices = [m.NewRequest(req_id=f"c{i}", prompt_token_ids=prompt, max_tokens=60,
                            sampling=m.SamplingParams(temperature=1.0, seed=i),
                            stop_token_ids=tok.eos_token_ids, grammar=SMALL, principal="k1")
               for i in range(3)]
    run = drive(core, m.ToEngine(new=choices), served=True)
    for c in choices:
        ids = [t for t in run.tokens[c.req_id] if t not in tok.eos_token_ids]
        assert set(json.loads(tok.decode(ids))) == {"n"}
    assert builds.grammars == [SMALL]
    other = [m.NewRequest(req_id=f"o{p}", prompt_token_ids=prompt, max_tokens=60,
                          stop_token_ids=tok.eos_token_ids, grammar=SMALL, principal=p)
             for p in ("k2", "k1")]
    drive(core, m.ToEngine(new=other), served=True)
    assert builds.grammars == [SMALL, SMALL]  # k2's compile; k1's schema was kept
    assert_whole(core)
    core.close()


def test_the_compiled_grammars_kept_are_bounded(tiny, monkeypatch):
    """After as many other grammars as the engine keeps, the first compiles again."""
    d, _ = tiny
    core = core_for(d)
    builds = Builds(monkeypatch)
    grammars = [grammar.grammar_text(grammar.Constraint(kind="regex", source=f"a{{{i}}}"))
                for i in range(1, 34)]
    for i, g in enumerate([*grammars, grammars[-1], grammars[0]]):
        drive(core, m.ToEngine(new=[new(f"r{i}", [1, 2, 3], 2, grammar=g)]))
    assert builds.grammars == [*grammars, grammars[0]]  # the last kept, the first not
    assert_whole(core)
    core.close()


@pytest.mark.parametrize("end", ["abort", "deadline", "drain", "shutdown"])
def test_a_request_that_ends_while_its_grammar_compiles_leaves_nothing(tiny, monkeypatch,
                                                                       end):
    """Until its matcher is ready a request is queued: no in-flight place, no KV. Ended
    then (abort, deadline, a drain refusing what is queued, shutdown), it gets its final
    update, the pool and admission are whole, no compile is left waiting for it, and its
    grammar, queued behind another's compile, is never compiled."""
    d, _ = tiny
    core = core_for(d)
    builds = Builds(monkeypatch, hold=True)
    now = [1000.0]
    core.admission.clock = core.admission.wall_clock = lambda: now[0]
    free = core.pool.num_free_blocks
    first = new("g1", [1, 2, 3], 8, grammar=SMALL)
    second = new("g2", [1, 2, 3], 8, grammar=wide_schema(50), deadline_unix=now[0] + 5)
    out = core.step(m.ToEngine(new=[first, second])).updates
    assert not any(u.admitted or u.refused_code for u in out), out
    st = core.status()
    assert (st.in_flight, st.queued, st.running) == (0, 2, 0)
    assert core.pool.num_free_blocks == free  # no KV taken while it compiles
    assert builds.began.wait(10)  # g1's grammar compiles; g2's waits behind it
    if end == "abort":
        final = core.step(m.ToEngine(aborts=[m.Abort(req_id="g2")])).updates
    elif end == "deadline":
        now[0] += 6
        final = core.step().updates
    elif end == "drain":
        final = core.step(m.ToEngine(stop_admitting=True, refuse_queued=True,
                                          refuse_new=True)).updates
    else:
        final = core.step(m.ToEngine(shutdown=True)).updates
    g2 = next(u for u in final if u.req_id == "g2")
    if end == "drain":
        assert g2.refused_code == "shutting_down"
    else:
        assert g2.finished == m.FinishReason.ABORT
        assert g2.error == {"abort": "client_gone"}.get(end, end)
    assert "g2" not in core.requests and "g2" not in core.grammars.compiling
    st = core.status()
    assert (st.in_flight, st.queued) == ((0, 1) if end in ("abort", "deadline") else (0, 0))
    assert core.pool.num_free_blocks == free
    builds.go.set()  # g1's compile ends; then the next request's grammar compiles
    last = wide_schema(40)
    run = drive(core, m.ToEngine(new=[new("g3", [1, 2, 3], 8, grammar=last)]))
    assert run.final["g3"].finished == m.FinishReason.LENGTH
    assert builds.grammars == [SMALL, last]  # g2's was cancelled before it began
    assert not core.grammars.compiling
    assert_whole(core)
    core.close()
