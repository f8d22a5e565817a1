"""Constrained decoding and the thinking budget in EngineCore: what the output becomes."""

from __future__ import annotations

import json

import pytest
from support.engine import assert_whole, drive, with_drafter
from support.fake_runner import FakeRunner, fake_next_token

from helexa import grammar
from helexa.fixtures.tiny import init_tiny
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import Draft, Drafter
from helexa.neuron.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = init_tiny(tmp_path_factory.mktemp("tiny") / "m")
    return d, Tokenizer.from_dir(d)


def core_for(model_dir, *, fake: bool) -> EngineCore:
    # bytes_per_token 0: the real runner's KV bytes are not cross-checked against a plan
    spec = EngineSpec(model_id="t", model_dir=str(model_dir), num_blocks=256, block_size=16,
                      context=1024, bytes_per_token=2 if fake else 0,
                      limits=m.Limits(anon_max_in_flight=64))
    return EngineCore(spec, FakeRunner(512, 256, 16) if fake else None)


def validate(obj: dict) -> None:
    assert set(obj) == {"name", "n", "ok"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
    assert isinstance(obj["ok"], bool)


@pytest.mark.parametrize("fake", [True, False], ids=["fake-runner", "tiny-model"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_constrained_output_parses_and_validates(tiny, fake, temperature):
    d, tok = tiny
    core = core_for(d, fake=fake)
    g = grammar.grammar_text(grammar.json_schema(SCHEMA))
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a record."}])
    reqs = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=prompt, max_tokens=200,
                         sampling=m.SamplingParams(temperature=temperature, seed=i),
                         stop_token_ids=tok.eos_token_ids, grammar=g) for i in range(3)]
    free = m.NewRequest(req_id="free", prompt_token_ids=prompt, max_tokens=20,
                        sampling=m.SamplingParams(temperature=temperature))
    tokens, final, _, _ = drive(core, m.ToEngine(new=[*reqs, free]))
    for r in reqs:
        assert final[r.req_id].finished == m.FinishReason.STOP, final[r.req_id]
        ids = [t for t in tokens[r.req_id] if t not in tok.eos_token_ids]
        validate(json.loads(tok.decode(ids)))
    assert final["free"].finished is not None  # an unconstrained row in the same batch
    assert_whole(core)
    core.close()


def test_bad_grammar_is_refused_invalid_request(tiny):
    d, _ = tiny
    core = core_for(d, fake=True)
    bad = m.NewRequest(req_id="bad", prompt_token_ids=[1, 2, 3], max_tokens=4,
                       grammar='{"grammars": [{"lark_grammar": "start: nope"}]}')
    _, final, _, _ = drive(core, m.ToEngine(new=[bad]))
    assert final["bad"].refused_code == "invalid_request_error"
    assert "nope" in final["bad"].refused_message
    assert_whole(core)


def test_router_side_check_names_the_problem():
    with pytest.raises(grammar.GrammarError, match="strnig"):
        grammar.check(grammar.json_schema({"type": "strnig"}))
    with pytest.raises(grammar.GrammarError, match="unclosed group"):
        grammar.check(grammar.Constraint(kind="regex", source="(a"))


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_thinking_budget_closes_the_thought(tiny, budget):
    d, tok = tiny
    core = core_for(d, fake=False)
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    prompt = tok.encode_chat([{"role": "user", "content": "Think."}]) + \
        tok.encode("<think>\n", add_special_tokens=False)
    think = m.Thinking(budget_tokens=budget, close_ids=close, starts_open=True)
    req = m.NewRequest(req_id="t", prompt_token_ids=prompt, max_tokens=budget + 20,
                       sampling=m.SamplingParams(temperature=0.0), thinking=think)
    tokens, final, _, _ = drive(core, m.ToEngine(new=[req]))
    out = tokens["t"]
    # The thought is at most `budget` tokens, then the closing marker, then the answer.
    i = next(i for i in range(len(out)) if out[i:i + len(close)] == close)
    assert i <= budget
    assert final["t"].reasoning_tokens == i
    assert_whole(core)


def test_a_grammar_applies_to_the_answer_after_the_thought(tiny):
    d, tok = tiny
    core = core_for(d, fake=False)
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    prompt = tok.encode_chat([{"role": "user", "content": "Think."}], enable_thinking=True)
    req = m.NewRequest(req_id="t", prompt_token_ids=prompt, max_tokens=200,
                       sampling=m.SamplingParams(temperature=1.0, seed=4),
                       stop_token_ids=tok.eos_token_ids,
                       grammar=grammar.grammar_text(grammar.json_schema(SCHEMA)),
                       thinking=m.Thinking(budget_tokens=6, close_ids=close, starts_open=True))
    tokens, final, _, _ = drive(core, m.ToEngine(new=[req]))
    out = [t for t in tokens["t"] if t not in tok.eos_token_ids]
    i = next(i for i in range(len(out)) if out[i:i + len(close)] == close)
    assert final["t"].finished == m.FinishReason.STOP and final["t"].reasoning_tokens == i <= 6
    validate(json.loads(tok.decode(out[i + len(close):])))
    assert_whole(core)


def eos_next(tok, prompt):
    """`prompt` with one more thought token, so that the fake model's next token is an eos."""
    return next(prompt + [x] for x in range(400, 512)
                if fake_next_token(prompt + [x], 512) in tok.eos_token_ids)


@pytest.mark.parametrize("drafts", [False, True], ids=["plain", "speculating"])
def test_an_eos_sampled_in_the_thought_closes_it_and_the_answer_comes(tiny, drafts):
    """docs/api.md: under constraint the thought comes first and the grammar applies to the
    answer after it. An eos the model samples inside the thought would end the request
    with no answer (finish_reason stop, no JSON): the close is written in its place."""
    d, tok = tiny
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    opened = tok.encode_chat([{"role": "user", "content": "Think."}], enable_thinking=True)
    prompt = eos_next(tok, opened)
    think = m.Thinking(budget_tokens=50, close_ids=close, starts_open=True)
    req = m.NewRequest(req_id="t", prompt_token_ids=prompt, max_tokens=200,
                       sampling=m.SamplingParams(temperature=0.0),
                       stop_token_ids=tok.eos_token_ids, thinking=think,
                       grammar=grammar.grammar_text(grammar.json_schema(SCHEMA)))
    free = m.NewRequest(req_id="free", prompt_token_ids=prompt, max_tokens=200,
                        sampling=m.SamplingParams(temperature=0.0),
                        stop_token_ids=tok.eos_token_ids, thinking=think)
    core = core_for(d, fake=True)
    if drafts:  # a speculating request beside it (a constrained one is never drafted)
        spec = EngineSpec(model_id="t", model_dir=str(d), num_blocks=256, block_size=16,
                          context=1024, bytes_per_token=2,
                          limits=m.Limits(anon_max_in_flight=64, spec_k=4,
                                             spec_full_below=1.0, spec_off_above=1.01))
        core = with_drafter(EngineCore(spec, FakeRunner(512, 256, 16)), ModelDrafter())
    tokens, final, _, _ = drive(core, m.ToEngine(new=[req, free]))
    out = tokens["t"]
    assert out[:len(close)] == close  # the eos became the close, at once
    assert final["t"].finished == m.FinishReason.STOP and final["t"].reasoning_tokens == 0
    answer = [t for t in out[len(close):] if t not in tok.eos_token_ids]
    validate(json.loads(tok.decode(answer)))
    # free text is not owed an answer: the eos ends it there, as before
    assert tokens["free"] == [fake_next_token(prompt, 512)]
    assert final["free"].finished == m.FinishReason.STOP
    assert_whole(core)
    core.close()


def test_a_stop_token_inside_the_constrained_answer_does_not_cut_it(tiny):
    """Only the grammar ends a constrained answer: a client's stop token id the JSON holds
    would leave it half written (a forced call reported whole, or JSON that does not
    parse). Free text still stops at it."""
    d, tok = tiny
    g = grammar.grammar_text(grammar.json_schema(SCHEMA))
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a record."}])

    def run(stop: list[int], constrained: bool = True) -> tuple[list[int], m.RequestUpdate]:
        req = m.NewRequest(req_id="j", prompt_token_ids=prompt, max_tokens=200,
                           sampling=m.SamplingParams(temperature=0.0),
                           stop_token_ids=[*tok.eos_token_ids, *stop],
                           grammar=g if constrained else None)
        core = core_for(d, fake=True)
        tokens, final, _, _ = drive(core, m.ToEngine(new=[req]))
        assert_whole(core)
        core.close()
        return tokens["j"], final["j"]

    whole, _ = run([])
    inside = whole[len(whole) // 2]  # a token in the middle of the JSON
    got, final = run([inside])
    assert got == whole and final.finished == m.FinishReason.STOP
    validate(json.loads(tok.decode([t for t in got if t not in tok.eos_token_ids])))
    free, _ = run([], constrained=False)
    stop_at = free[3]
    assert run([stop_at], constrained=False)[0] == free[:free.index(stop_at) + 1]


class RecordingDrafter(Drafter):
    """Always drafts k copies of token 7 (mostly rejected: greedy output is unchanged) and
    records every request it was asked to draft for."""

    name = "recording"

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def propose(self, req, k):
        self.asked.add(req.req_id)
        return Draft([7] * k)


def test_constrained_requests_are_not_drafted_beside_speculated_ones(tiny):
    d, tok = tiny
    spec = EngineSpec(model_id="t", model_dir=str(d), num_blocks=256, block_size=16,
                      context=1024, bytes_per_token=2,
                      limits=m.Limits(anon_max_in_flight=64, spec_k=4, spec_full_below=1.0,
                                         spec_off_above=1.01))
    drafter = RecordingDrafter()
    core = with_drafter(EngineCore(spec, FakeRunner(512, 256, 16)), drafter)
    g = grammar.grammar_text(grammar.json_schema(SCHEMA))
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a record."}])
    con = m.NewRequest(req_id="con", prompt_token_ids=prompt, max_tokens=200,
                       sampling=m.SamplingParams(temperature=0.0),
                       stop_token_ids=tok.eos_token_ids, grammar=g)
    free = [m.NewRequest(req_id=f"free{i}", prompt_token_ids=[5, 6, 7] * 6, max_tokens=30,
                         sampling=m.SamplingParams(temperature=0.0)) for i in range(2)]
    tokens, final, _, _ = drive(core, m.ToEngine(new=[free[0], con, free[1]]))
    assert final["con"].finished == m.FinishReason.STOP, final["con"]
    validate(json.loads(tok.decode([t for t in tokens["con"] if t not in tok.eos_token_ids])))
    assert "con" not in drafter.asked and {"free0", "free1"} <= drafter.asked
    assert core.speculator.drafted_tokens > 0  # the free rows did speculate in that batch
    plain = core_for(d, fake=True)
    ref = drive(plain, m.ToEngine(new=[free[0], con, free[1]])).tokens
    assert tokens == ref  # greedy: the same tokens as without speculation, masks included
    plain.close()
    assert_whole(core)
    core.close()


class ModelDrafter(Drafter):
    """Drafts the fake model's own greedy continuation, unaware of the thinking budget:
    every draft is accepted unless the budget forces a token in between."""

    name = "model"

    def propose(self, req, k):
        ctx = req.all_token_ids()
        out = []
        for _ in range(k):
            out.append(fake_next_token(ctx + out, 512))
        return Draft(out)


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_thinking_budget_holds_with_speculation(tiny, budget):
    d, tok = tiny
    close = tok.encode("\n</think>\n\n", add_special_tokens=False)
    prompt = tok.encode_chat([{"role": "user", "content": "Think."}]) + \
        tok.encode("<think>\n", add_special_tokens=False)
    think = m.Thinking(budget_tokens=budget, close_ids=close, starts_open=True)
    req = m.NewRequest(req_id="t", prompt_token_ids=prompt, max_tokens=budget + 30,
                       sampling=m.SamplingParams(temperature=0.0), thinking=think)
    want, want_final, _, _ = drive(core_for(d, fake=True), m.ToEngine(new=[req]))
    spec = EngineSpec(model_id="t", model_dir=str(d), num_blocks=256, block_size=16,
                      context=1024, bytes_per_token=2,
                      limits=m.Limits(anon_max_in_flight=64, spec_k=4, spec_full_below=1.0,
                                         spec_off_above=1.01))
    core = with_drafter(EngineCore(spec, FakeRunner(512, 256, 16)), ModelDrafter())
    got, final, _, _ = drive(core, m.ToEngine(new=[req]))
    assert got == want  # the closing marker lands where the budget says, drafts or not
    assert final["t"].reasoning_tokens == want_final["t"].reasoning_tokens <= budget
    assert core.speculator.accepted_tokens > 0
    assert_whole(core)


def test_the_grammar_library_starts_at_model_load_not_at_the_first_request(tiny, tmp_path):
    core = core_for(tiny[0], fake=True)
    # the tokenizer view and a first mask are built: the first constrained request only
    # makes its matcher (under a millisecond), no stall for the streams beside it
    assert core.grammars.warmed and core.grammars._tokenizer is not None
    bare = tmp_path / "bare"  # a checkpoint without tokenizer.json still loads
    bare.mkdir()
    core = core_for(bare, fake=True)
    assert not core.grammars.warmed and "tokenizer.json" in core.grammars.unavailable
