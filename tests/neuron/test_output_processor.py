"""The daemon's output handling, update by update, without gRPC: what a caller would receive.

Each test feeds an `OutputProcessor` the `RequestUpdate`s an engine would send
(one token per update unless said otherwise) and checks the `GenerateResponse`
deltas: text cut at stop strings that span tokens, finish reasons and
stop_reason, usage with cached tokens and times, logprobs with token bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa.neuron.engine import messages as m
from helexa.neuron.output_processor import OutputProcessor
from helexa.neuron.tokenizer import Tokenizer
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

ARRIVAL = 1000.0
ANSWER = "Hello world. STOP here"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


class Clock:
    """Wall seconds that advance by `step` at every reading."""

    def __init__(self, start: float, step: float) -> None:
        self.now, self.step = start, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def processor(tok: Tokenizer, prompt: list[int] | None = None, **kw) -> OutputProcessor:
    new = m.NewRequest(req_id="r", prompt_token_ids=prompt or tok.encode("Once upon"),
                       arrival_unix=ARRIVAL, thinking=kw.pop("thinking", None))
    return OutputProcessor(tok, new, clock=kw.pop("clock", Clock(ARRIVAL, 0.01)), **kw)


def feed(out: OutputProcessor, updates: list[m.RequestUpdate]) -> list[pb.GenerateResponse]:
    """Every message sent, up to the one that finishes (the servicer stops there)."""
    sent = []
    for upd in updates:
        step = out.process(upd)
        if step.response is not None:
            sent.append(step.response)
        if out.finished:
            break
    return sent


def one_by_one(ids: list[int], finished: m.FinishReason | None = None,
               **last: object) -> list[m.RequestUpdate]:
    ups = [m.RequestUpdate(req_id="r", new_token_ids=[i]) for i in ids]
    if finished is not None:
        ups.append(m.RequestUpdate(req_id="r", finished=finished, **last))  # type: ignore[arg-type]
    return ups


def text(sent: list[pb.GenerateResponse]) -> str:
    return "".join(r.text for r in sent)


def test_a_stop_string_split_over_tokens_ends_before_it_and_stops_the_engine(tok) -> None:
    ids = tok.encode(ANSWER, add_special_tokens=False)
    stop_ids = tok.encode(" STOP", add_special_tokens=False)
    assert len(stop_ids) > 1 and all(i in ids for i in stop_ids)  # really across tokens
    out = processor(tok, stop=["STOP"])
    steps = [out.process(u) for u in one_by_one(ids)[:ids.index(stop_ids[-1]) + 1]]
    sent = [s.response for s in steps if s.response is not None]
    assert text(sent) == "Hello world. "  # nothing of "S", "ST", "STO" was let out early
    assert [s.abort_engine for s in steps] == [False] * (len(steps) - 1) + [True]
    assert out.finished and sent[-1].finish_reason == pb.FINISH_REASON_STOP
    assert sent[-1].stop_reason == "STOP"
    assert sent[-1].usage.completion_tokens == len(steps)  # the tokens the engine produced


def test_a_stop_id_in_a_speculated_update_cuts_it_there_outside_a_call(tok) -> None:
    """Where calls are tagged the daemon checks the caller's stop ids (the engine was not
    given them): one update of several tokens (accepted drafts) is kept up to the id outside
    the call, its later tokens neither sent nor counted, and the engine is told to stop;
    the same id inside the call is text."""
    answer = '<tool_call>{"a": "U"}</tool_call> nU more'
    ids = tok.encode(answer, add_special_tokens=False)
    stop = tok.encode("U", add_special_tokens=False)[0]
    second = ids.index(stop, ids.index(stop) + 1)
    assert second % 3 < 2 and len(ids) > second + 1  # its update holds tokens after it
    out = processor(tok, stop_token_ids=[stop], calls=("<tool_call>", "</tool_call>"))
    steps = [out.process(m.RequestUpdate(req_id="r", new_token_ids=ids[i:i + 3]))
             for i in range(0, second + 1, 3)]
    sent = [s.response for s in steps if s.response is not None]
    assert text(sent) == answer[:answer.index("nU") + 2]
    assert [i for r in sent for i in r.token_ids] == ids[:second + 1]
    assert (steps[-1].abort_engine, steps[-1].abort_reason) == (True, "stop_token")
    assert (sent[-1].finish_reason, sent[-1].stop_reason) == (pb.FINISH_REASON_STOP, str(stop))
    assert sent[-1].usage.completion_tokens == second + 1
    assert not any(s.abort_engine for s in steps[:-1])


def test_a_held_prefix_of_a_stop_string_comes_out_when_it_never_completes(tok) -> None:
    ids = tok.encode("Hello world. STO", add_special_tokens=False)
    out = processor(tok, stop=["STOP"])
    sent = feed(out, one_by_one(ids, m.FinishReason.LENGTH))
    assert text(sent[:-1]) == "Hello world. "  # " STO" held while it might become STOP
    assert text(sent) == "Hello world. STO"
    assert sent[-1].finish_reason == pb.FINISH_REASON_LENGTH and sent[-1].stop_reason == ""


def test_a_character_split_over_tokens_is_sent_whole(tok) -> None:
    ids = tok.encode("ok 🙂!", add_special_tokens=False)
    sent = feed(processor(tok), one_by_one(ids, m.FinishReason.STOP))
    assert text(sent) == "ok 🙂!"
    assert all("\ufffd" not in r.text for r in sent)


def test_eos_is_stop_without_a_stop_reason_and_a_caller_stop_token_names_itself(tok) -> None:
    ids = tok.encode("Hi there", add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    plain = feed(processor(tok), one_by_one([*ids, eos], m.FinishReason.STOP))
    assert plain[-1].finish_reason == pb.FINISH_REASON_STOP and plain[-1].stop_reason == ""
    assert text(plain) == "Hi there"  # eos itself is not shown
    own = feed(processor(tok, stop_token_ids=[ids[-1]]), one_by_one(ids, m.FinishReason.STOP))
    assert own[-1].stop_reason == str(ids[-1])


@pytest.mark.parametrize("finished, error, want, stop_reason", [
    (m.FinishReason.LENGTH, "", pb.FINISH_REASON_LENGTH, ""),
    (m.FinishReason.ABORT, "deadline", pb.FINISH_REASON_ABORT, "deadline"),
    (m.FinishReason.ABORT, "shutdown", pb.FINISH_REASON_ABORT, "shutdown"),
    (m.FinishReason.ABORT, "client_gone", pb.FINISH_REASON_ABORT, ""),
    # the engine's words stay on the neuron (request.done's `error`): the caller hears where
    (m.FinishReason.ERROR, "step failed: /srv/x.py boom", pb.FINISH_REASON_ERROR,
     "the engine failed on this request; the neuron's log has the cause under req_id r"),
])
def test_finish_reasons_and_their_stop_reason(tok, finished, error, want, stop_reason) -> None:
    out = processor(tok)
    sent = feed(out, one_by_one(tok.encode("abc", add_special_tokens=False), finished,
                                error=error))
    assert sent[-1].finish_reason == want and sent[-1].stop_reason == stop_reason
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in sent[:-1])
    assert out.outcome(client_gone=False) == pb.FinishReason.Name(want)[14:].lower()
    assert out.outcome(client_gone=True) == "client_gone"


def test_an_engine_refusal_or_an_error_before_any_token_is_a_refusal(tok) -> None:
    with pytest.raises(Refusal) as e:
        processor(tok).process(m.RequestUpdate(req_id="r", refused_code="overloaded",
                                               refused_message="queue full",
                                               retry_after_ms=1500))
    assert e.value == Refusal("overloaded", "queue full", 1500)
    with pytest.raises(Refusal) as e:
        processor(tok).process(m.RequestUpdate(req_id="r", finished=m.FinishReason.ERROR,
                                               error="oom"))
    assert (e.value.code, e.value.message) == (
        "upstream_error", "the engine failed on this request; the neuron's log has the cause "
        "under req_id r")


def test_usage_counts_cached_tokens_and_times_each_phase(tok) -> None:
    prompt = tok.encode("Once upon a time there was")
    out = processor(tok, prompt, clock=Clock(ARRIVAL, 0.010))  # each reading: +10 ms
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert len(ids) >= 3
    updates = [m.RequestUpdate(req_id="r", admitted=True, prompt_tokens=len(prompt),
                               cached_tokens=4),
               *one_by_one(ids, m.FinishReason.LENGTH, reasoning_tokens=2)]
    updates[-1].spec_drafted_tokens, updates[-1].spec_accepted_tokens = 6, 4
    sent = feed(out, updates)
    u = sent[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (len(prompt), len(ids), 4)
    assert (u.reasoning_tokens, u.draft_tokens, u.accepted_draft_tokens) == (2, 6, 4)
    # admitted at +10 ms, then one token every 10 ms from +20 ms
    assert u.queue_ms == pytest.approx(10.0) and u.prefill_ms == pytest.approx(20.0)
    assert u.decode_ms == pytest.approx(10.0 * (len(ids) - 1))
    assert not any(r.HasField("usage") for r in sent[:-1])  # usage on the last message only
    # the first message says the prompt's counts already (Anthropic's message_start)
    assert (sent[0].prompt_tokens, sent[0].cached_tokens) == (len(prompt), 4)


def test_first_and_inter_token_times_for_the_metrics(tok) -> None:
    out = processor(tok, clock=Clock(ARRIVAL, 0.5))
    first = out.process(m.RequestUpdate(req_id="r", new_token_ids=[70]))
    later = out.process(m.RequestUpdate(req_id="r", new_token_ids=[71, 72]))
    assert first.first_token_secs == pytest.approx(0.5) and first.inter_token_secs is None
    assert later.first_token_secs is None and later.inter_token_secs == pytest.approx(0.25)


def test_logprobs_carry_each_token_its_text_and_its_own_bytes(tok) -> None:
    smile = tok.encode("🙂", add_special_tokens=False)
    lps = [m.TokenLogprob(token_id=i, logprob=-0.5,
                          top=[m.TopToken(token_id=i, logprob=-0.5),
                               m.TopToken(token_id=70, logprob=-1.5)]) for i in smile]
    sent = feed(processor(tok), [m.RequestUpdate(req_id="r", new_token_ids=smile, logprobs=lps,
                                                 finished=m.FinishReason.LENGTH)])
    got = sent[0].logprobs
    assert [lp.token_id for lp in got] == smile and [lp.logprob for lp in got] == [-0.5] * 3
    assert b"".join(lp.token_bytes for lp in got) == "🙂".encode()  # part of a character each
    assert [t.token_id for t in got[0].top] == [smile[0], 70]
    assert got[0].top[1].token == tok.decode([70])


def test_prompt_ids_and_an_open_thought_come_on_the_first_message_only(tok) -> None:
    prompt = tok.encode("Think")
    think = m.Thinking(budget_tokens=4, close_ids=[1], starts_open=True)
    sent = feed(processor(tok, prompt, return_prompt_token_ids=True, thinking=think),
                one_by_one(tok.encode("ab", add_special_tokens=False), m.FinishReason.LENGTH))
    assert list(sent[0].prompt_token_ids) == prompt and sent[0].thought_open
    assert not any(r.prompt_token_ids or r.thought_open for r in sent[1:])


def test_a_broken_engine_link_finishes_as_an_error(tok) -> None:
    out = processor(tok)
    out.process(m.RequestUpdate(req_id="r", new_token_ids=[70]))
    out.fail("EOFError: pipe closed")
    assert out.finished and out.outcome(client_gone=False) == "error"
    assert out.error == "EOFError: pipe closed"


def test_the_first_message_comes_at_admission_before_any_token(tok) -> None:
    # A long prompt's prefill takes minutes on a CPU: the caller (the router) hears at
    # admission that the request is being served, whether or not the prompt opened a
    # thought, so it can open its client's stream and keep it alive meanwhile.
    prompt = tok.encode("Once upon a time")
    out = processor(tok, prompt)
    admitted = out.process(m.RequestUpdate(req_id="r", admitted=True)).response
    assert admitted is not None and not admitted.text and not admitted.token_ids
    assert admitted.prompt_tokens == len(prompt)
    assert out.process(m.RequestUpdate(req_id="r")).response is None  # prefill: nothing new
    first = out.process(m.RequestUpdate(req_id="r", new_token_ids=[70])).response
    assert first is not None and first.text and not first.prompt_tokens


def test_the_message_of_the_step_a_row_was_given_says_the_prefill_began(tok) -> None:
    """Admitted with no row free: the first message (at admission) opens the stream but
    says nothing of a prefill; the step that gives the row sends prefill_started, once."""
    out = processor(tok)
    sent = feed(out, [m.RequestUpdate(req_id="r", admitted=True, prompt_tokens=2),
                      m.RequestUpdate(req_id="r", started=True),
                      m.RequestUpdate(req_id="r", new_token_ids=[5]),
                      m.RequestUpdate(req_id="r", started=True, new_token_ids=[6]),
                      m.RequestUpdate(req_id="r", finished=m.FinishReason.LENGTH)])
    assert [r.prefill_started for r in sent] == [False, True, False, False, False]
    out = processor(tok)  # a row free at admission: the first message says both
    sent = feed(out, [m.RequestUpdate(req_id="r", admitted=True, started=True,
                                      prompt_tokens=2)])
    assert sent[0].prefill_started and sent[0].prompt_tokens > 0


def test_a_request_that_lost_its_row_says_it_waits_for_one(tok) -> None:
    """Resumed behind a full batch (or its row reclaimed), the engine's update says the
    request waits for a row: the caller gets a message saying so, with the tokens that came
    before the wait where the update holds some, and nothing is said of it otherwise."""
    out = processor(tok)
    sent = feed(out, [m.RequestUpdate(req_id="r", admitted=True, started=True, prompt_tokens=2),
                      m.RequestUpdate(req_id="r", new_token_ids=[5]),
                      m.RequestUpdate(req_id="r", waiting_for_row=True),
                      m.RequestUpdate(req_id="r", started=True, new_token_ids=[6]),
                      m.RequestUpdate(req_id="r", new_token_ids=[7], waiting_for_row=True),
                      m.RequestUpdate(req_id="r", finished=m.FinishReason.LENGTH)])
    assert [(list(r.token_ids), r.waiting_for_row) for r in sent] == [
        ([], False), ([5], False), ([], True), ([6], False), ([7], True), ([], False)]


def test_prompt_logprobs_come_whole_with_the_first_token_each_at_its_offset(tok) -> None:
    """The engine scores the prompt chunk by chunk; the caller gets every prompt token's
    entry on one message, the first token's (no logprob) first, each with its text and its
    offset in the prompt's text, which comes on the first message where asked."""
    from helexa.neuron.detokenizer import decode_with_offsets

    prompt = tok.encode("café au lait")
    text_, offsets = decode_with_offsets(tok, prompt)
    new = m.NewRequest(req_id="r", prompt_token_ids=prompt, arrival_unix=ARRIVAL,
                       sampling=m.SamplingParams(prompt_logprobs=1))
    out = OutputProcessor(tok, new, clock=Clock(ARRIVAL, 0.01), prompt_text=text_,
                          text_offsets=offsets)
    lps = [m.TokenLogprob(t, -0.5 - i, [m.TopToken(prompt[0], -0.25)])
           for i, t in enumerate(prompt[1:])]
    cut = len(lps) // 2
    sent = feed(out, [m.RequestUpdate(req_id="r", admitted=True),
                      m.RequestUpdate(req_id="r", prompt_logprobs=lps[:cut]),
                      m.RequestUpdate(req_id="r", prompt_logprobs=lps[cut:], new_token_ids=[5]),
                      m.RequestUpdate(req_id="r", new_token_ids=[6],
                                      finished=m.FinishReason.LENGTH)])
    assert sent[0].prompt_text == text_ == "café au lait" and not sent[0].prompt_logprobs
    with_first = [r for r in sent if r.prompt_logprobs]
    assert len(with_first) == 1 and list(with_first[0].token_ids) == [5]
    got = with_first[0].prompt_logprobs
    assert [e.token_id for e in got] == prompt
    assert got[0].logprob == 0 and not got[0].top
    assert [e.logprob for e in got[1:]] == [lp.logprob for lp in lps]
    assert [e.text_offset for e in got] == offsets
    assert [e.token for e in got] == [tok.decode([t]) for t in prompt]
    assert got[1].top[0].token == tok.decode([prompt[0]])


def test_max_tokens_0_sends_the_prompts_logprobs_on_its_last_message(tok) -> None:
    prompt = tok.encode("Once upon")
    new = m.NewRequest(req_id="r", prompt_token_ids=prompt, arrival_unix=ARRIVAL, max_tokens=0,
                       sampling=m.SamplingParams(prompt_logprobs=0))
    out = OutputProcessor(tok, new, clock=Clock(ARRIVAL, 0.01))
    lps = [m.TokenLogprob(t, -1.0, []) for t in prompt[1:]]
    sent = feed(out, [m.RequestUpdate(req_id="r", admitted=True, prompt_logprobs=lps,
                                      finished=m.FinishReason.LENGTH)])
    assert sent[-1].finish_reason == pb.FINISH_REASON_LENGTH and not sent[-1].prompt_text
    assert [e.token_id for e in sent[-1].prompt_logprobs] == prompt
    assert sent[-1].usage.completion_tokens == 0
    # the prefill took until that finish (+20 ms: admitted at +10), not 0 ms
    assert sent[-1].usage.prefill_ms == pytest.approx(20.0)
