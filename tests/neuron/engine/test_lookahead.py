"""Lookahead decode (helexa/neuron/engine/lookahead.py): a step launched from the held
step's device tokens before they are read. On the CPU nothing overlaps, but the engine's
bookkeeping is the CUDA path's, so these tests hold it to what a user sees: the same
tokens and finish reasons as the synchronous engine, every block back, aborts and failures
handled, and no lookahead where the host would change a token."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from support.engine import assert_whole, drive, grammars_compiled, with_drafter
from support.fake_runner import FakeRunner
from support.mtp import requests as mtp_requests

from helexa.neuron.engine import lookahead
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative import policy
from helexa.neuron.engine.speculative.drafters import Draft, Drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 100
GREEDY = m.SamplingParams(temperature=0.0)


class Counted:
    """Counts the steps launched held (from the scheduler) and following (from tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held = self.followed = 0
        real = lookahead.launch

        def launch(core: EngineCore, plan: Any, inputs: Any, tokens: Any = None,
                   **kw: Any) -> Any:
            if tokens is None:
                self.held += 1
            else:
                self.followed += 1
            return real(core, plan, inputs, tokens, **kw)

        monkeypatch.setattr(lookahead, "launch", launch)


def engine(monkeypatch: pytest.MonkeyPatch, on: bool, *, model_dir: str = "",
           runner: Any = None, prefix_cache: bool = False, num_blocks: int = 96,
           block_size: int = 4, **limits: Any) -> EngineCore:
    monkeypatch.setenv(lookahead.ENV, "1" if on else "0")
    spec = EngineSpec(model_id="la", model_dir=model_dir, num_blocks=num_blocks,
                      block_size=block_size, context=256, bytes_per_token=0 if model_dir else 2,
                      prefix_cache=prefix_cache,
                      limits=m.Limits(**{"anon_max_in_flight": 64, **limits}))
    if not model_dir and runner is None:
        runner = FakeRunner(VOCAB, num_blocks, block_size)
    core = EngineCore(spec, runner)
    assert core.lookahead is on
    return core


def mixed(vocab_hint: int, stop: int | None = None) -> list[m.NewRequest]:
    """Greedy and seeded sampling, budgets that end mid-chain at different steps."""
    out = []
    for i in range(6):
        sampling = GREEDY if i % 2 else m.SamplingParams(temperature=0.9, top_p=0.9, seed=i)
        out.append(m.NewRequest(req_id=f"r{i}", prompt_token_ids=[(7 * i + j) % vocab_hint + 3
                                                                  for j in range(5 + 3 * i)],
                                max_tokens=6 + 5 * i, sampling=sampling,
                                stop_token_ids=[stop] if stop is not None and i == 3 else []))
    return out


def test_the_model_gives_the_synchronous_tokens_and_every_block_back(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("qwen3"))
    sync = drive(engine(monkeypatch, False, model_dir=model, block_size=8), mixed(400),
                 served=True)
    stop = sync.tokens["r3"][4]  # r3 stops at its 5th token (or sooner: the same one)
    sync = drive(engine(monkeypatch, False, model_dir=model, block_size=8), mixed(400, stop),
                 served=True)
    counted = Counted(monkeypatch)
    core = engine(monkeypatch, True, model_dir=model, block_size=8)
    run = drive(core, mixed(400, stop), served=True)
    assert run.tokens == sync.tokens
    assert {k: u.finished for k, u in run.final.items()} == \
        {k: u.finished for k, u in sync.final.items()}
    assert run.final["r3"].finished == m.FinishReason.STOP
    assert counted.held >= 1 and counted.followed >= 20  # the chain ran, not the sync path
    assert run.steps <= sync.steps + counted.held  # one step of delay a chain, no more
    assert_whole(core)


def test_a_hybrid_with_prefix_snapshots_gives_the_synchronous_tokens_and_hits(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    """Snapshots at decode positions are saved by following steps and filed when they are
    read: a second turn that extends the first one's answer hits as far as without."""
    model = str(tiny_checkpoint("qwen3_5"))

    def turns(on: bool) -> tuple[dict[str, list[int]], dict[str, int], Counted | None]:
        counted = Counted(monkeypatch) if on else None
        core = engine(monkeypatch, on, model_dir=model, block_size=8, prefix_cache=True,
                      max_in_flight=8)
        first = drive(core, mixed(400), served=True)
        assert_whole(core, hybrid=True)
        follow_ups = [m.NewRequest(req_id=f"t{rid}", max_tokens=6, sampling=GREEDY,
                                   prompt_token_ids=r.prompt_token_ids + first.tokens[rid][:-1]
                                   + [11, 12, 13])
                      for r in mixed(400) for rid in [r.req_id]]
        second = drive(core, follow_ups, served=True)
        assert_whole(core, hybrid=True)
        hits = {k: u.cached_tokens for k, u in second.admitted.items()}
        return {**first.tokens, **second.tokens}, hits, counted

    sync_tokens, sync_hits, _ = turns(False)
    tokens, hits, counted = turns(True)
    assert tokens == sync_tokens
    assert hits == sync_hits
    assert counted is not None and counted.followed >= 20
    lengths = {f"t{r.req_id}": len(r.prompt_token_ids) for r in mixed(400)}
    # some second turn hit past its first turn's prompt: a snapshot a decode step saved
    assert any(hits[k] > lengths[k] for k in hits), (hits, lengths)


def test_no_row_is_computed_for_a_request_its_budget_has_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a stop token, which no one can know before it is read, costs a wasted row."""
    def rows_run(on: bool, stop: list[int]) -> tuple[int, dict[str, list[int]]]:
        runner = FakeRunner(VOCAB, 96, 4)
        real, rows = runner.run_step, [0]

        def run_step(seqs: Any, **kw: Any) -> Any:
            rows[0] += len(seqs)
            return real(seqs, **kw)

        runner.run_step = run_step  # type: ignore[method-assign]
        news = [m.NewRequest(req_id=f"r{n}", prompt_token_ids=[2, n], max_tokens=n,
                             sampling=GREEDY, stop_token_ids=stop) for n in (3, 7, 12)]
        tokens = drive(engine(monkeypatch, on, runner=runner), news).tokens
        return rows[0], tokens

    sync_rows, sync = rows_run(False, [])
    la_rows, la = rows_run(True, [])
    assert la == sync and la_rows == sync_rows
    stop = [sync["r12"][5]]  # r12 now stops at its 6th token
    sync_rows, sync = rows_run(False, stop)
    la_rows, la = rows_run(True, stop)
    assert la == sync and len(la["r12"]) <= 6 and la_rows == sync_rows + 1


@pytest.mark.parametrize("steps", range(2, 7))  # the held row completes a block at one
def test_an_abort_while_a_step_is_held_returns_its_blocks_at_once(
        monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    news = [m.NewRequest(req_id=r, prompt_token_ids=[3, 4, 5, i], max_tokens=30,
                         sampling=GREEDY) for i, r in enumerate(("a", "b"))]
    sync = drive(engine(monkeypatch, False, prefix_cache=True), news, served=True)
    core = engine(monkeypatch, True, prefix_cache=True)
    core.step(m.ToEngine(new=news))
    for _ in range(steps):
        core.step()
    assert core.ahead is not None
    used = core.pool.ledger().used_bytes
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id="a")]))
    assert {u.req_id: u.finished for u in out.updates}["a"] == m.FinishReason.ABORT
    assert core.pool.ledger().used_bytes < used  # a's blocks are back before its row is read
    core.pool.check()
    rest = drive(core)
    got = [t for u in out.updates if u.req_id == "b" for t in u.new_token_ids]
    assert sum(len(v) for v in rest.tokens.values()) > 0
    assert set(rest.tokens) == {"b"} and rest.final["b"].finished == m.FinishReason.LENGTH
    assert sync.tokens["b"][-len(rest.tokens["b"]) - len(got):] == got + rest.tokens["b"]
    assert_whole(core)


def test_penalties_count_the_held_token_as_the_synchronous_engine_does(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("qwen3"))
    kinds = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0),
             dict(presence_penalty=1.5), dict(presence_penalty=1.0, temperature=0.8, seed=3),
             dict()]

    def run(on: bool, penalties: bool = True) -> dict[str, list[int]]:
        news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=[5, 5, 6, 5, 6, 7 + i],
                             max_tokens=24, sampling=m.SamplingParams(
                                 **{"temperature": 0.0, **(k if penalties else {})}))
                for i, k in enumerate(kinds)]
        core = engine(monkeypatch, on, model_dir=model, block_size=8)
        tokens = drive(core, news, served=True).tokens
        assert_whole(core)
        return tokens

    sync = run(False)
    assert sync != run(False, penalties=False)  # the penalties change what is sampled
    counted = Counted(monkeypatch)
    assert run(True) == sync
    assert counted.followed >= 20


@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.5)])
def test_the_held_token_is_penalised_in_the_step_after_it(
        monkeypatch: pytest.MonkeyPatch, penalty: dict[str, float]) -> None:
    """A model that repeats its last token unless a penalty moves it on: each step's
    choice turns on the token the step before chose, still unread when it samples. (Its
    best logit is 0, which a repetition penalty leaves as it is: the model test above.)"""
    import support.fake_runner

    monkeypatch.setattr(support.fake_runner, "fake_next_token", lambda ctx, vocab: ctx[-1])
    news = [m.NewRequest(req_id="r", prompt_token_ids=[40, 50], max_tokens=16,
                         sampling=m.SamplingParams(temperature=0.0, **penalty))]
    sync = drive(engine(monkeypatch, False), news, served=True).tokens["r"]
    assert len(set(sync)) > 8  # moved on, not stuck repeating one token
    counted = Counted(monkeypatch)
    assert drive(engine(monkeypatch, True), news, served=True).tokens["r"] == sync
    assert counted.followed >= 10


def test_constrained_and_thinking_requests_give_the_synchronous_tokens(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    """A grammar's mask for a following step needs its matcher past the held token: that
    step's forward is launched at once, its sampling once the held step is read. A
    thinking budget's forced close is known a step ahead: the chain stops for it. With a
    grammar after a thought, the mask starts at the first answering token, as without."""
    from helexa import grammar
    from helexa.neuron.tokenizer import Tokenizer

    model = tiny_checkpoint("qwen3")
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a record."}])
    g = grammar.grammar_text(grammar.json_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}))
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    think = m.Thinking(budget_tokens=6, close_ids=close, starts_open=True)
    opened = prompt + tok.encode("<think>\n", add_special_tokens=False)
    sampled = m.SamplingParams(temperature=0.8, seed=3)
    constrained = [m.NewRequest(req_id="json", prompt_token_ids=prompt, max_tokens=60,
                                sampling=GREEDY, stop_token_ids=tok.eos_token_ids, grammar=g),
                   m.NewRequest(req_id="json-sampled", prompt_token_ids=prompt, max_tokens=60,
                                sampling=sampled, stop_token_ids=tok.eos_token_ids, grammar=g),
                   m.NewRequest(req_id="plain", prompt_token_ids=prompt, max_tokens=30,
                                sampling=sampled)]
    thinking = [m.NewRequest(req_id="think", max_tokens=30, sampling=GREEDY, thinking=think,
                             prompt_token_ids=opened),
                m.NewRequest(req_id="think-json", max_tokens=60, sampling=GREEDY, grammar=g,
                             thinking=think, prompt_token_ids=opened,
                             stop_token_ids=tok.eos_token_ids)]
    tokens: dict[str, list[int]] = {}
    for news in (constrained, thinking):
        sync = drive(engine(monkeypatch, False, model_dir=str(model), block_size=8), news,
                     served=True)
        counted = Counted(monkeypatch)
        core = engine(monkeypatch, True, model_dir=str(model), block_size=8)
        run = drive(core, news, served=True)
        assert run.tokens == sync.tokens
        assert {k: u.finished for k, u in run.final.items()} == \
            {k: u.finished for k, u in sync.final.items()}
        assert counted.followed >= 10, news[0].req_id
        assert_whole(core)
        tokens.update(run.tokens)
    for rid in ("think", "think-json"):
        assert tokens[rid][6:6 + len(close)] == close  # closed after its budget of 6
    answers = {rid: tok.decode(tokens[rid][skip:], skip_special_tokens=True) for rid, skip
               in (("json", 0), ("json-sampled", 0), ("think-json", 6 + len(close)))}
    for rid, text in answers.items():  # each answer is what its grammar allows
        assert isinstance(json.loads(text)["n"], int), (rid, text)


def test_an_eos_in_a_thought_a_grammar_follows_gives_the_synchronous_tokens(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    """The host writes the thought's close in place of an eos sampled in it (a grammar's
    answer is owed): a step launched from that eos on the device would have computed the
    wrong token, so such a thought is not chained; its answer is."""
    from support.fake_runner import fake_continuation

    from helexa import grammar
    from helexa.neuron.tokenizer import Tokenizer

    model = tiny_checkpoint("qwen3")
    tok = Tokenizer.from_dir(model)
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    opened = tok.encode_chat([{"role": "user", "content": "x"}], enable_thinking=True)
    # a thought the fake model ends with an eos after a few tokens, inside its budget
    prompt = next(opened + [x] for x in range(300, 512) if any(
        t in tok.eos_token_ids for t in fake_continuation(opened + [x], 12, 512)[4:]))
    # a string's tokens are the model's own (mostly allowed): the answer reads the context
    g = grammar.grammar_text(grammar.json_schema({"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 8}}, "required": ["s"]}))
    news = [m.NewRequest(req_id="t", prompt_token_ids=prompt, max_tokens=80, sampling=GREEDY,
                         stop_token_ids=tok.eos_token_ids, grammar=g,
                         thinking=m.Thinking(budget_tokens=40, close_ids=close,
                                             starts_open=True))]
    runs = []
    for on in (False, True):
        counted = Counted(monkeypatch)
        core = engine(monkeypatch, on, model_dir=str(model), block_size=8,
                      runner=FakeRunner(512, 96, 8))
        runs.append(drive(core, news, served=True))
        assert_whole(core)
    sync, run = runs
    assert run.tokens == sync.tokens
    out = run.tokens["t"]
    i = next(i for i in range(len(out)) if out[i:i + len(close)] == close)
    assert 4 <= i < 12 and run.final["t"].finished == m.FinishReason.STOP
    answer = [t for t in out[i + len(close):] if t not in tok.eos_token_ids]
    assert isinstance(json.loads(tok.decode(answer))["s"], str)
    assert counted.followed > 0  # the answer chained


def test_a_constrained_request_aborted_in_the_chain_gives_its_blocks_back(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    """An abort of a constrained request between two lookahead steps: its blocks come
    back at once, the following step's sampling leaves its row alone, and the plain
    request beside it streams what the synchronous engine gives it."""
    from helexa import grammar
    from helexa.neuron.tokenizer import Tokenizer

    model = str(tiny_checkpoint("qwen3"))
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a record."}])
    g = grammar.grammar_text(grammar.json_schema({"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]}))
    news = [m.NewRequest(req_id="json", prompt_token_ids=prompt, max_tokens=40,
                         sampling=GREEDY, grammar=g),
            m.NewRequest(req_id="plain", prompt_token_ids=prompt, max_tokens=20,
                         sampling=GREEDY)]
    sync = drive(engine(monkeypatch, False, model_dir=model, block_size=8), news, served=True)
    core = engine(monkeypatch, True, model_dir=model, block_size=8)
    got: dict[str, list[int]] = {}
    for step in range(7):
        for u in core.step(m.ToEngine(new=news) if step == 0 else None).updates:
            got.setdefault(u.req_id, []).extend(u.new_token_ids)
        if step == 0:  # "json"'s grammar compiles off the step loop: the next step admits it
            grammars_compiled(core)
    assert core.ahead is not None and core.ahead.tokens is not None  # sampled, held
    used = core.pool.num_used_blocks
    out = core.step(m.ToEngine(aborts=[m.Abort(req_id="json")]))
    assert {u.req_id: u.finished for u in out.updates}["json"] == m.FinishReason.ABORT
    assert core.pool.num_used_blocks < used
    for u in out.updates:
        got.setdefault(u.req_id, []).extend(u.new_token_ids)
    rest = drive(core, served=True)
    assert set(rest.tokens) == {"plain"}
    assert got["plain"] + rest.tokens["plain"] == sync.tokens["plain"]
    assert got["json"] == sync.tokens["json"][:len(got["json"])]
    assert_whole(core)


def test_logprobs_come_back_with_the_tokens_as_the_synchronous_engine_gives_them(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    model = str(tiny_checkpoint("qwen3"))
    news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=[5, 6, 7 + i], max_tokens=10 + i,
                         sampling=m.SamplingParams(temperature=0.0 if i else 0.8, seed=i,
                                                   logprobs=i != 1, top_logprobs=i // 2 * 2))
            for i in range(3)]

    def run(on: bool) -> tuple[dict[str, list[int]], dict[str, list[m.TokenLogprob]]]:
        got: dict[str, list[m.TokenLogprob]] = {}
        tokens = drive(engine(monkeypatch, on, model_dir=model, block_size=8), news,
                       served=True, on_update=lambda u: got.setdefault(u.req_id, []).extend(
                           u.logprobs or [])).tokens
        return tokens, got

    sync_tokens, sync_lps = run(False)
    counted = Counted(monkeypatch)
    tokens, lps = run(True)
    assert counted.followed >= 8
    assert tokens == sync_tokens and lps == sync_lps
    assert [len(lps.get(f"r{i}", [])) for i in range(3)] == [10, 0, 12]
    assert [len(e.top) for e in lps["r2"]] == [2] * 12
    assert all(e.token_id == t for e, t in zip(lps["r2"], tokens["r2"], strict=True))


def test_a_failed_lookahead_step_fails_its_requests_and_the_engine_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = FakeRunner(VOCAB, 96, 4)
    real = runner.run_step
    failures = {"left": 1}

    def run_step(seqs: Any, *, keep_hidden: bool = False, tokens: Any = None) -> Any:
        if tokens is not None and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("device lost the step")
        return real(seqs, keep_hidden=keep_hidden, tokens=tokens)

    runner.run_step = run_step  # type: ignore[method-assign]
    core = engine(monkeypatch, True, runner=runner)
    news = [m.NewRequest(req_id="a", prompt_token_ids=[3, 4], max_tokens=9, sampling=GREEDY)]
    run = drive(core, news)
    assert run.final["a"].finished == m.FinishReason.ERROR
    assert "device lost the step" in run.final["a"].error
    assert run.tokens["a"], "the held step's token was read and sent before the failure"
    assert core.num_failed_steps == 1
    assert_whole(core)
    again = drive(core, [m.NewRequest(req_id="b", prompt_token_ids=[3, 4], max_tokens=9,
                                      sampling=GREEDY)], served=True)
    assert len(again.tokens["b"]) == 9
    assert_whole(core)


def test_device_tokens_feed_the_model_as_its_token_ids_would(tiny_checkpoint) -> None:
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.engine.seq_input import SeqInput

    r = ModelRunner(tiny_checkpoint("qwen3"), num_blocks=8, block_size=8, max_num_seqs=2,
                    max_batched_tokens=64, device="cpu", dtype="float32")
    r.execute([SeqInput([5, 6, 7], 0, [0], True), SeqInput([8, 9], 0, [1], True)])
    ids = r.execute([SeqInput([11], 3, [0], True), SeqInput([12], 2, [1], True)])
    fed = r.execute([SeqInput([0], 3, [0], True), SeqInput([0], 2, [1], True)],
                    torch.tensor([11, 12]))
    assert torch.equal(ids, fed)
    with pytest.raises(ValueError, match="pure decode steps"):
        r.execute([SeqInput([1, 2], 4, [0], True)], torch.tensor([3]))


def test_lookahead_is_on_for_cuda_and_says_why_not_elsewhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class R:
        def __init__(self, device: str) -> None:
            self.device = torch.device(device)

    monkeypatch.delenv(lookahead.ENV, raising=False)
    assert lookahead.wanted(R("cuda")) == (True, "cuda")  # type: ignore[arg-type]
    on, why = lookahead.wanted(R("cpu"))  # type: ignore[arg-type]
    assert not on and "CPU" in why
    monkeypatch.setenv(lookahead.ENV, "0")
    assert lookahead.wanted(R("cuda")) == (False, f"{lookahead.ENV}=0")  # type: ignore[arg-type]
    monkeypatch.setenv(lookahead.ENV, "1")
    assert lookahead.wanted(R("cpu"))[0]  # type: ignore[arg-type]


def test_a_step_that_ran_in_the_chain_clears_the_failure_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine process gives up after so many failed steps in a row: steps that ran in
    a lookahead chain break the row, as the scheduler's steps do."""
    core = engine(monkeypatch, True)
    core.step(m.ToEngine(new=[m.NewRequest(req_id="a", prompt_token_ids=[3, 4],
                                           max_tokens=20, sampling=GREEDY)]))
    core.step()
    assert core.ahead is not None
    core.consecutive_failed_steps = 2  # as if the steps before had failed
    out = core.step()
    assert core.ahead is not None and [u.new_token_ids for u in out.updates] != [[]]
    assert core.consecutive_failed_steps == 0
    drive(core)
    assert_whole(core)


# ---- a model with a drafter: the chain runs between the steps that draft ----------------

FULL = dict(spec_k=2, spec_full_below=0.0, spec_off_above=0.0)  # every batch full: probes only


class Probes(Drafter):
    """Always drafts token 0 (the fake model all but never gives it: acceptance near 0,
    so a request drafts only its probes), and records each ask: (the speculator's step
    count, the requests asked)."""

    def __init__(self) -> None:
        self.core: EngineCore | None = None
        self.asks: list[tuple[int, list[str]]] = []

    def propose_batch(self, reqs: Any, ks: Any) -> list[Draft]:
        assert self.core is not None
        self.asks.append((self.core.speculator.steps, sorted(r.req_id for r in reqs)))
        return [Draft([0] * k) for k in ks]


def test_a_drafters_probes_fall_on_shared_steps_and_the_chain_runs_between(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a full batch a request drafts a one-token probe at once, then only on every
    8th step, on the same steps as every other request (here two waves that arrived
    apart): the steps between draft nothing and run as a lookahead chain. The drafts, the
    tokens and the ledger are the synchronous engine's."""
    def run(on: bool) -> tuple[Probes, dict[str, list[int]], Counted, EngineCore]:
        counted = Counted(monkeypatch)
        core = engine(monkeypatch, on, **FULL)
        probes = Probes()
        probes.core = with_drafter(core, probes)
        news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=[3 + i, 9, 4], max_tokens=40,
                             sampling=GREEDY) for i in range(6)]
        tokens: dict[str, list[int]] = {}
        for step in range(400):
            arrive = news[:3] if step == 0 else news[3:] if step == 5 else []
            for u in core.step(m.ToEngine(new=arrive) if arrive else None).updates:
                assert u.error == "" and u.refused_code is None, u
                tokens.setdefault(u.req_id, []).extend(u.new_token_ids)
            if not core.has_work and step > 5:
                break
        assert_whole(core)
        return probes, tokens, counted, core

    sync, sync_tokens, _, _ = run(False)
    ahead, tokens, counted, core = run(True)
    assert tokens == sync_tokens and all(len(t) == 40 for t in tokens.values())
    assert ahead.asks == sync.asks
    first: set[str] = set()
    for step, ids in ahead.asks:  # a known request probes only with the others
        assert step % policy.PROBE_EVERY == 0 or not first & set(ids), (step, ids)
        first |= set(ids)
    assert first == {f"r{i}" for i in range(6)}
    assert core.status().spec_drafted_tokens > 6  # probes after the first ones
    assert counted.followed >= 25  # 6 steps in 8: a probe, a held step, six following


def test_the_mtp_head_observes_every_step_of_a_chain(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    """MTP under a full batch: the chain's steps keep their hidden states for the head,
    which observes them as each is read. The tokens are plain decoding's, and the head
    drafts the probes the synchronous engine's drafts."""
    model = str(tiny_checkpoint("qwen3_5", mtp=True))
    news = mtp_requests(2, 4)
    plain = drive(engine(monkeypatch, False, model_dir=model), news, served=True)
    runs = []
    for on in (False, True):
        counted = Counted(monkeypatch)
        core = engine(monkeypatch, on, model_dir=model, speculation="mtp", **FULL)
        assert core.status().drafter == "mtp"
        runs.append((drive(core, news, served=True), core.status(), counted))
        assert_whole(core, hybrid=True)
    (sync, sync_status, _), (run, status, counted) = runs
    assert run.tokens == sync.tokens == plain.tokens
    assert status.spec_drafted_tokens == sync_status.spec_drafted_tokens > 0
    assert status.spec_accepted_tokens == sync_status.spec_accepted_tokens
    assert counted.followed >= 10


def test_a_waiting_request_starts_when_the_held_token_ends_a_slot_holder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots full, one request waiting: the step whose held token ends a running request by
    its budget frees a slot, so the next step is the scheduler's and promotes the waiting
    one, at the step the synchronous engine would."""
    def first_token_steps(on: bool) -> dict[str, int]:
        core = engine(monkeypatch, on, max_slots=2)
        news = [m.NewRequest(req_id=r, prompt_token_ids=[2, 3, n], max_tokens=n,
                             sampling=GREEDY) for r, n in (("a", 3), ("b", 12), ("c", 4))]
        inbound: m.ToEngine | None = m.ToEngine(new=news)
        first: dict[str, int] = {}
        for steps in range(1, 200):
            for u in core.step(inbound).updates:
                if u.new_token_ids:
                    first.setdefault(u.req_id, steps)
            inbound = None
            if not core.has_work:
                break
        assert_whole(core)
        return first

    sync, la = first_token_steps(False), first_token_steps(True)
    assert sync["c"] > sync["a"]  # c waited for a's slot
    assert la == sync


def test_a_request_without_max_tokens_grows_inside_the_chain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A held token that would end a growable request's budget grows it (growth.py) before
    the following step is launched, so the chain goes on past kv.default_output_tokens with
    the synchronous tokens; with a request queued for KV it ends there as synchronously."""
    growths = ("kv_growths", "kv_growths_refused_no_room", "kv_growths_refused_queued")

    def run(on: bool, num_blocks: int, news: list[m.NewRequest]
            ) -> tuple[Any, Counted, list[int]]:
        counted = Counted(monkeypatch)
        core = engine(monkeypatch, on, num_blocks=num_blocks, default_output_tokens=8)
        out = drive(core, news, served=True)
        assert_whole(core)
        return out, counted, [getattr(core.status(), k) for k in growths]

    idle = [m.NewRequest(req_id=f"g{i}", prompt_token_ids=[3, 4, 5, i], sampling=GREEDY)
            for i in range(2)] + [m.NewRequest(req_id="n", prompt_token_ids=[3, 4, 5, 9],
                                               max_tokens=8, sampling=GREEDY)]
    sync, _, _ = run(False, 96, idle)
    la, counted, _ = run(True, 96, idle)
    # 96 blocks hold one full context (64) and not two: g1 is cut where the pool runs out
    # (as synchronously), then g0 grows into what g1 gave back, to the context
    assert la.tokens == sync.tokens and len(la.tokens["g0"]) == 256 - 4
    assert 8 < len(la.tokens["g1"]) < 256 - 4 and len(la.tokens["n"]) == 8
    assert counted.held == 1 and counted.followed >= 200  # one chain: no break to grow
    # 8 blocks: g0 reserves 3, h (4 + 20 tokens: 6) is queued for KV: g0 ends at 8
    queued = [m.NewRequest(req_id="g0", prompt_token_ids=[3, 4, 5, 0], sampling=GREEDY),
              m.NewRequest(req_id="h", prompt_token_ids=[1, 2, 3, 4], max_tokens=20,
                           sampling=GREEDY, principal="q")]
    sync, _, sync_growths = run(False, 8, queued)
    la, _, la_growths = run(True, 8, queued)
    assert la.tokens == sync.tokens and len(la.tokens["g0"]) == 8
    assert la.final["g0"].finished == m.FinishReason.LENGTH
    # the chain's try to grow is not a refusal; the end, read back, is: counted once
    assert la_growths == sync_growths == [0, 0, 1]
