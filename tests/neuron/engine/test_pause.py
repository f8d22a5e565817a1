"""A request whose caller stops taking its tokens is paused (ToEngine.paused, intake.pause):
it makes no tokens and holds no batch row while paused, keeps its reservation, and once
resumed goes on exactly where it stopped (no token lost, repeated or reordered), with or
without lookahead, speculation or a grammar; a deadline or an abort still ends it with
every block back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.engine import assert_whole, drive, grammars_compiled, with_drafter
from support.fake_runner import FakeRunner, fake_continuation

from helexa import grammar
from helexa.fixtures.tiny import init_tiny
from helexa.neuron.engine import lookahead
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import NgramDrafter, OracleDrafter
from helexa.neuron.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 100
GREEDY = m.SamplingParams(temperature=0.0)


def make_core(monkeypatch: pytest.MonkeyPatch, *, ahead: bool = False, model_dir: str = "",
              **limits: Any) -> EngineCore:
    monkeypatch.setenv(lookahead.ENV, "1" if ahead else "0")
    spec = EngineSpec(model_id="fake", model_dir=model_dir, num_blocks=64, block_size=4,
                      context=256, bytes_per_token=2,
                      limits=m.Limits(**{"anon_max_in_flight": 64, **limits}))
    return EngineCore(spec, FakeRunner(VOCAB if not model_dir else 512, 64, 4))


def new(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> m.NewRequest:
    return m.NewRequest(req_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens,
                        sampling=GREEDY, **kw)


def expected(prompt: list[int], n: int) -> list[int]:
    return fake_continuation(prompt, n, VOCAB)


def step(core: EngineCore, tokens: dict[str, list[int]], inbound: m.ToEngine | None = None
         ) -> dict[str, int]:
    """One step; each request's new tokens appended to `tokens`; how many each got."""
    got: dict[str, int] = {}
    for u in core.step(inbound).updates:
        tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
        got[u.req_id] = got.get(u.req_id, 0) + len(u.new_token_ids)
    core.pool.check()
    return got


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "lookahead"])
@pytest.mark.parametrize("drafter", ["none", "ngram", "oracle"])
def test_a_paused_request_makes_nothing_and_resumes_where_it_stopped(monkeypatch, ahead,
                                                                    drafter):
    core = make_core(monkeypatch, ahead=ahead, spec_k=3, spec_off_above=1.01,
                     spec_full_below=1.0)
    pa, pb = [5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]
    want = {"a": expected(pa, 60), "b": expected(pb, 60)}
    if drafter != "none":
        with_drafter(core, NgramDrafter(min_n=1) if drafter == "ngram" else OracleDrafter(
            lambda ctx, k: expected(ctx, k)))
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[new("a", pa, 60), new("b", pb, 60)]))
    for _ in range(3):
        step(core, tokens)
    step(core, tokens, m.ToEngine(paused={"a": True}))  # a held step may still give one
    held = len(tokens["a"])
    st = core.status()
    assert (st.paused, st.running, st.in_flight) == (1, 1, 2)
    b_before = len(tokens["b"])
    for _ in range(6):
        got = step(core, tokens)
        assert got.get("a", 0) == 0  # paused: no row, no token
    assert len(tokens["a"]) == held and len(tokens["b"]) > b_before  # the other goes on
    assert core.status().paused == 1 and core.pool.ledger().reserved_bytes > 0
    step(core, tokens, m.ToEngine(paused={"a": False}))
    run = drive(core, served=True)
    for rid, more in run.tokens.items():
        tokens[rid].extend(more)
    assert tokens == want  # nothing lost, repeated or reordered
    assert run.final["a"].finished == m.FinishReason.LENGTH
    assert_whole(core)


def steps(core: EngineCore, tokens: dict[str, list[int]], inbound: m.ToEngine | None = None
          ) -> dict[str, m.RequestUpdate]:
    """One step (as `step`), its updates by request."""
    out = core.step(inbound).updates
    for u in out:
        tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
    core.pool.check()
    return {u.req_id: u for u in out}


def finish_all(core: EngineCore, tokens: dict[str, list[int]], waits: list[str]) -> None:
    """Drive to the end; `waits`: the requests whose updates said they wait for a row."""
    def seen(u: m.RequestUpdate) -> None:
        if u.waiting_for_row:
            waits.append(u.req_id)
    run = drive(core, served=True, on_update=seen)
    for rid, more in run.tokens.items():
        tokens.setdefault(rid, []).extend(more)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "lookahead"])
def test_a_paused_request_lends_its_row_and_takes_it_back_when_resumed(monkeypatch, ahead):
    """max_slots 1: pausing the running request lends its row to the waiting one; resumed,
    it takes the row back at once (it was admitted first), and the one that borrowed it
    says it waits for a row again, then finishes whole once the row frees."""
    core = make_core(monkeypatch, ahead=ahead, max_slots=1, max_in_flight=2)
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[new("a", [1, 2, 3], 30), new("b", [4, 5], 12)]))
    for _ in range(3):
        step(core, tokens)
    assert not tokens.get("b")  # no row for b yet
    step(core, tokens, m.ToEngine(paused={"a": True}))
    for _ in range(3):  # b decodes in the lent row (a held step of a's may give one more)
        step(core, tokens)
    a_before, b_before = len(tokens["a"]), len(tokens["b"])
    assert b_before >= 2 and (core.status().running, core.status().paused) == (1, 1)
    ups = steps(core, tokens, m.ToEngine(paused={"a": False}))
    assert ups["b"].waiting_for_row and ups["a"].started  # a has its row back in this step
    assert not ups["a"].waiting_for_row
    waits: list[str] = []
    for _ in range(3):  # a decodes again at once; b makes nothing
        ups = steps(core, tokens)
        assert not ups.get("b", m.RequestUpdate(req_id="b")).new_token_ids
    assert len(tokens["a"]) >= a_before + 2 and len(tokens["b"]) <= b_before + 1
    finish_all(core, tokens, waits)
    assert tokens == {"a": expected([1, 2, 3], 30), "b": expected([4, 5], 12)}
    assert waits == []  # no second wait: b's row came when a ended
    assert_whole(core)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "lookahead"])
def test_a_request_resumed_behind_a_full_batch_says_it_waits_for_a_row(monkeypatch, ahead):
    """max_slots 1, both paused, `a` (admitted first) resumed first takes the free row; `b`
    resumed behind it finds every row held by a request admitted before it: it waits, and
    its update says so (its caller, the router, then does not count the silence against
    the neuron); once a row frees it goes on where it stopped."""
    core = make_core(monkeypatch, ahead=ahead, max_slots=1, max_in_flight=2)
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[new("a", [1, 2, 3], 20), new("b", [4, 5], 12)]))
    step(core, tokens, m.ToEngine(paused={"a": True}))
    for _ in range(3):
        step(core, tokens)
    step(core, tokens, m.ToEngine(paused={"b": True}))
    ups = steps(core, tokens, m.ToEngine(paused={"a": False}))  # a row is free: no wait
    assert "a" not in ups or not ups["a"].waiting_for_row
    b_before = len(tokens["b"])
    ups = steps(core, tokens, m.ToEngine(paused={"b": False}))
    assert ups["b"].waiting_for_row and not ups["b"].new_token_ids
    st = core.status()
    assert (st.running, st.paused, st.in_flight) == (1, 0, 2)
    waits: list[str] = []
    finish_all(core, tokens, waits)
    assert len(tokens["b"]) > b_before and waits == []
    assert tokens == {"a": expected([1, 2, 3], 20), "b": expected([4, 5], 12)}
    assert_whole(core)


def test_rows_go_back_to_the_requests_admitted_first_and_never_back_and_forth(monkeypatch):
    """max_slots 2, four requests: a and b paused lend their rows to c and d; resumed
    together, both take them back in one step (c and d wait, saying so), and the rows stay
    with a and b while they read, whatever c and d do."""
    core = make_core(monkeypatch, max_slots=2, max_in_flight=4)
    tokens: dict[str, list[int]] = {}
    reqs = [new(r, [i + 1, i + 2], 40) for i, r in enumerate("abcd")]
    step(core, tokens, m.ToEngine(new=reqs))
    step(core, tokens)
    step(core, tokens, m.ToEngine(paused={"a": True, "b": True}))
    for _ in range(3):
        step(core, tokens)
    assert tokens["c"] and tokens["d"]
    ups = steps(core, tokens, m.ToEngine(paused={"a": False, "b": False}))
    assert ups["c"].waiting_for_row and ups["d"].waiting_for_row
    assert ups["a"].new_token_ids and ups["b"].new_token_ids  # back in the batch at once
    c_d = len(tokens["c"]) + len(tokens["d"])
    for _ in range(5):
        got = step(core, tokens)
        assert got.get("a") == 1 and got.get("b") == 1 and not got.get("c") and not got.get("d")
    assert len(tokens["c"]) + len(tokens["d"]) == c_d
    waits: list[str] = []
    finish_all(core, tokens, waits)
    assert tokens == {r.req_id: expected(list(r.prompt_token_ids), 40) for r in reqs}
    assert waits == []
    assert_whole(core)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "lookahead"])
def test_a_row_taken_back_during_a_long_prefill_is_never_left_empty(monkeypatch, ahead):
    """max_slots 2, a budget of 4 a step, a 60-token prompt prefilling in `a`'s lent row:
    `a` resumed takes `b`'s row back and decodes in the same step, every step, while the
    prefill goes on in the budget left; no step leaves a row empty."""
    core = make_core(monkeypatch, ahead=ahead, max_slots=2, max_in_flight=3,
                     max_batched_tokens=4, prefill_chunk_tokens=4)
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[new("a", [1, 2, 3], 40), new("b", [4, 5], 40)]))
    step(core, tokens)
    step(core, tokens, m.ToEngine(new=[new("c", list(range(10, 70)), 5)]))
    step(core, tokens, m.ToEngine(paused={"a": True}))  # c takes a's row: it prefills
    step(core, tokens)
    assert core.requests["c"].is_prefilling
    a_before = len(tokens["a"])
    ups = steps(core, tokens, m.ToEngine(paused={"a": False}))
    assert ups["b"].waiting_for_row
    decoded = 0
    while core.requests["c"].is_prefilling:
        got = step(core, tokens)
        assert len(core.running) == 2 and got.get("a") == 1  # a row each: a's and c's
        decoded += 1
    assert decoded >= 10 and len(tokens["a"]) >= a_before + decoded
    finish_all(core, tokens, [])
    assert tokens == {"a": expected([1, 2, 3], 40), "b": expected([4, 5], 40),
                      "c": expected(list(range(10, 70)), 5)}
    assert_whole(core)


def test_a_paused_request_still_ends_by_abort_or_deadline(monkeypatch):
    now = [1000.0]
    core = make_core(monkeypatch)
    core.admission.wall_clock = core.admission.clock = lambda: now[0]
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[new("a", [1, 2], 50), new("b", [3, 4], 50,
                                                                   deadline_unix=1001.0)]))
    step(core, tokens, m.ToEngine(paused={"a": True, "b": True}))
    assert core.status().paused == 2
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id="a")]))
    assert [(u.req_id, u.finished) for u in out.updates] == [("a", m.FinishReason.ABORT)]
    now[0] = 1002.0
    out = core.step()
    assert [(u.req_id, u.finished, u.error) for u in out.updates] == [
        ("b", m.FinishReason.ABORT, "deadline")]
    assert core.status().paused == 0
    assert_whole(core)
    # words about requests it does not hold (ended, or never seen) change nothing
    core.step(m.ToEngine(paused={"a": False, "zz": True}))
    assert_whole(core)


def test_a_paused_constrained_request_resumes_inside_its_grammar(monkeypatch, tmp_path):
    d = init_tiny(tmp_path / "m")
    tok = Tokenizer.from_dir(d)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    g = grammar.grammar_text(grammar.json_schema(schema))
    prompt = tok.encode_chat([{"role": "user", "content": "A record."}])

    def request() -> m.NewRequest:
        return m.NewRequest(req_id="g", prompt_token_ids=prompt, max_tokens=200,
                            sampling=m.SamplingParams(temperature=1.0, seed=3),
                            stop_token_ids=tok.eos_token_ids, grammar=g)

    ref_core = make_core(monkeypatch, model_dir=str(d))
    reference = drive(ref_core, [request()], served=True)
    ref_core.close()
    core = make_core(monkeypatch, model_dir=str(d))
    tokens: dict[str, list[int]] = {}
    step(core, tokens, m.ToEngine(new=[request()]))
    grammars_compiled(core)  # off the step loop: the next step admits it
    step(core, tokens)
    step(core, tokens)
    assert tokens.get("g")
    step(core, tokens, m.ToEngine(paused={"g": True}))
    for _ in range(3):
        assert not step(core, tokens).get("g")
    step(core, tokens, m.ToEngine(paused={"g": False}))
    run = drive(core, served=True)
    tokens["g"].extend(run.tokens.get("g", []))
    assert tokens["g"] == reference.tokens["g"]
    assert run.final["g"].finished == m.FinishReason.STOP
    ids = [t for t in tokens["g"] if t not in tok.eos_token_ids]
    assert set(json.loads(tok.decode(ids))) == {"name", "n"}
    assert_whole(core)
    core.close()


def test_a_following_step_that_fails_does_not_fail_a_request_paused_as_it_launched(
        monkeypatch):
    """With a step held (lookahead), pausing `a` launches the next step without its row; when
    that launch fails, `b` (its one row) ends with the error and `a` stays paused, whole."""
    core = make_core(monkeypatch, ahead=True)
    real, armed = core.runner.run_step, [False]

    def run_step(seqs: Any, *, keep_hidden: bool = False, tokens: Any = None) -> Any:
        if tokens is not None and armed[0]:
            armed[0] = False
            raise RuntimeError("device lost the step")
        return real(seqs, keep_hidden=keep_hidden, tokens=tokens)

    core.runner.run_step = run_step  # type: ignore[method-assign]
    core.step(m.ToEngine(new=[new(r, [3, 4], 40) for r in ("a", "b")]))
    for _ in range(3):
        core.step()
    assert core.ahead is not None  # a chain is on: the held step has rows for a and b
    armed[0] = True
    out = core.step(m.ToEngine(paused={"a": True}))
    ended = {u.req_id: u.error for u in out.updates if u.finished is not None}
    assert "device lost the step" in ended.get("b", ""), ended
    assert "a" not in ended and "a" in core.paused
    run = drive(core, m.ToEngine(paused={"a": False}))
    assert run.final["a"].error == "" and len(run.tokens["a"]) > 0
    assert_whole(core)
