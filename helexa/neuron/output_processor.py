"""One request's engine updates → the `GenerateResponse` deltas its caller receives. Pure.

The engine sends token ids, never text (docs/architecture.md, "What each process owns").
Everything that turns its per-step `RequestUpdate`s into what a caller sees
is here: incremental detokenisation (helexa/neuron/detokenizer.py), stop
strings across token boundaries, logprobs with each token's text and bytes
(the prompt's too, gathered over its prefill chunks and sent whole with the
first tokens, each with its offset in the prompt's text), the finish reason
and `stop_reason`, and usage (prompt, completion and
cached tokens, speculation and reasoning counts, queue / prefill / decode
times). No gRPC, no asyncio: the servicer feeds it updates and sends what it
returns, so it is tested update by update without a server.

As vLLM's `OutputProcessor` (vllm/v1/engine/output_processor.py), a stop
string found here ends the request before the engine knows: `process`
returns `abort_engine` so the caller tells the engine to stop computing.
Unlike it, one instance serves one request, because each Generate call is
its own task and owns its request's state alone.

It builds the wire message itself rather than a dataclass that mirrors it
field by field: `GenerateResponse` is the delta type (its fields documented
in proto/helexa/neuron/v1/neuron.proto), and a hand-kept copy is what this
redesign removes elsewhere. `Complete` folds the same messages into one with
helexa/responses.py, which stays beside the proto stubs because the router
(for a neuron that predates Complete) and the tests' fake neuron fold them
too, and the router never imports the neuron.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from helexa.neuron.detokenizer import CallTracker, IncrementalDetokenizer, StopChecker
from helexa.neuron.engine import messages
from helexa.proto import neuron_pb2 as pb
from helexa.refusal import Refusal

_MS = 1000.0


@dataclass
class Output:
    """What one engine update gives the caller."""

    response: pb.GenerateResponse | None  # the message to send now; None: nothing new
    abort_engine: bool = False  # a stop string ended the request: the engine still runs it
    abort_reason: str = "stop_string"  # or "stop_token": a caller's stop id (calls, below)
    first_token_secs: float | None = None  # the first tokens came: seconds since arrival
    inter_token_secs: float | None = None  # later tokens: seconds per token since the last


class OutputProcessor:
    """Turns one request's `RequestUpdate`s into `GenerateResponse` deltas, then a summary.

    `stop_token_ids` are the ids the caller asked to stop at (reported as
    `stop_reason`); the eos ids the engine also stops at are not among them.
    `calls` (a model's tool-call tags, where the request offers tools and no grammar
    follows the reply): the engine was not given the caller's stop ids, since one inside
    a call must not cut it (docs/api.md, "Chat and completions: shared fields"); they are
    checked here, token by token, outside calls, and the one that ends the reply ends it
    as the engine would have (its token the last one kept), the engine told to stop. A
    stop id counts as inside a call where the text up to and including its token is: the
    open tag's own token is the call, the close tag's ends it.
    `clock` gives wall seconds (time.time), on the same scale as the request's
    arrival_unix.
    """

    def __init__(self, tokenizer: Any, new: messages.NewRequest, *, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), return_prompt_token_ids: bool = False,
                 requested_max_tokens: int | None = None,
                 calls: tuple[str, str] | None = None,
                 clock: Callable[[], float] = time.time, prompt_text: str | None = None,
                 text_offsets: Sequence[int] = ()) -> None:
        """`prompt_text`: sent on the first message (return_prompt_text); `text_offsets`:
        where each prompt token begins in the prompt's text (prepare.py), for its
        prompt_logprobs entry."""
        self.tokenizer = tokenizer
        self.new = new
        self.clock = clock
        self._detok = IncrementalDetokenizer(tokenizer, new.prompt_token_ids)
        self._stopper = StopChecker(list(stop), calls)  # stop strings apply outside calls
        self._caller_stop_ids = frozenset(stop_token_ids)  # the servicer's set, as it is
        self._calls = CallTracker(calls) if calls and stop_token_ids else None
        self._return_prompt = return_prompt_token_ids
        self._requested_max_tokens = requested_max_tokens  # before fit_max_tokens lowered it
        self.output_token_ids: list[int] = []
        self.cached_tokens = 0
        self.reasoning_tokens = 0
        # Speculation: the request's totals, as the engine last said.
        self.draft_tokens = self.accepted_draft_tokens = 0
        self.admitted_unix = self.first_token_unix = self.last_token_unix = 0.0
        self.prefilled_unix = 0.0  # its prefill's end, where it ended with no token (usage)
        self.finish_reason: int | None = None  # a pb.FinishReason once finished
        self.stop_reason = ""
        self.error = ""
        self._sent_first = False
        self._sent_started = False  # prefill_started was sent
        self._prompt_text, self._text_offsets = prompt_text, list(text_offsets)
        self._texts: dict[int, str] = {}  # token id -> its text (logprobs' alternatives repeat)
        # The message that will carry the prompt's logprobs, gathering them as the engine
        # scores them, chunk by chunk: each update's few are made into entries as it comes,
        # so a long prompt's tens of thousands never hold the event loop at once. None: not
        # asked, or sent.
        self._scored: pb.GenerateResponse | None = None
        if new.sampling.prompt_logprobs is not None:
            self._scored = pb.GenerateResponse()
            self._add_scored([messages.TokenLogprob(new.prompt_token_ids[0], 0.0, [])])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ------------------------------------------------------------------ updates

    def process(self, upd: messages.RequestUpdate) -> Output:
        """The deltas one update adds; raises Refusal when the engine refused the request
        or failed it before it produced anything (the caller then gets a status, no stream)."""
        if upd.refused_code:
            raise Refusal(upd.refused_code, upd.refused_message or upd.refused_code,
                          upd.retry_after_ms)
        out = Output(None)
        if upd.admitted:
            self.admitted_unix, self.cached_tokens = self.clock(), upd.cached_tokens
        self.draft_tokens = max(self.draft_tokens, upd.spec_drafted_tokens)
        self.accepted_draft_tokens = max(self.accepted_draft_tokens, upd.spec_accepted_tokens)
        resp = pb.GenerateResponse()
        if not self._sent_first:
            if self._return_prompt:
                resp.prompt_token_ids.extend(self.new.prompt_token_ids)
            if self.new.thinking is not None and self.new.thinking.starts_open:
                resp.thought_open = True
            if self._prompt_text is not None:
                resp.prompt_text = self._prompt_text
        if upd.started and not self._sent_started:  # it got a row: its prefill begins now
            resp.prefill_started = self._sent_started = True
        if upd.new_token_ids:
            self._tokens(upd, resp, out)
        if upd.waiting_for_row:  # it lost its row after these tokens: the next come later
            resp.waiting_for_row = True
        if self.finish_reason is None and upd.finished is not None:
            self._finish(upd, resp)
        if self._scored is not None:
            self._add_scored(upd.prompt_logprobs or [])
            if resp.token_ids or self.finish_reason is not None:  # its prefill is over
                resp = self._with_scored(resp)
        if self.finish_reason is not None:
            self.reasoning_tokens = upd.reasoning_tokens  # the engine's count, set when finished
            resp.finish_reason = self.finish_reason
            resp.stop_reason = self.stop_reason
            resp.usage.CopyFrom(self.usage())
        # The first message goes out at admission, whatever it holds: the caller learns that
        # no refusal can follow (the router then opens its client's stream and keeps it
        # alive through the prefill, docs/http.md).
        if resp.prompt_logprobs or resp.ByteSize() or self.finish_reason is not None or \
                (upd.admitted and not self._sent_first):  # (ByteSize walks all of them)
            if not self._sent_first:  # the prompt's size, and the max_tokens fitted to the context
                resp.prompt_tokens = len(self.new.prompt_token_ids)
                resp.cached_tokens = self.cached_tokens
                fitted = self.new.max_tokens  # the engine's, where it fitted it again (a switch)
                if upd.admitted and self.new.max_tokens_ceiling is not None:
                    fitted = upd.output_budget
                if fitted is not None and fitted != self._requested_max_tokens:
                    resp.fitted_max_tokens = fitted
            self._sent_first = True
            out.response = resp
        return out

    def _tokens(self, upd: messages.RequestUpdate, resp: pb.GenerateResponse, out: Output) -> None:
        now = self.clock()
        if self.first_token_unix == 0.0:
            self.first_token_unix = now
            out.first_token_secs = now - self.new.arrival_unix
        else:
            out.inter_token_secs = (now - self.last_token_unix) / len(upd.new_token_ids)
        self.last_token_unix = now
        text, ids, stopped = self._text(upd.new_token_ids)
        self.output_token_ids += ids
        resp.token_ids.extend(ids)
        if upd.logprobs:
            resp.logprobs.extend(self._logprobs(upd.logprobs[:len(ids)]))
        text, matched = self._stopper.feed(text)
        resp.text = text
        if matched is not None:  # text past the stop string is never sent
            out.abort_engine = True
            self.finish_reason, self.stop_reason = pb.FINISH_REASON_STOP, matched
        elif stopped:  # a caller's stop id outside a call (calls): the engine goes on
            out.abort_engine, out.abort_reason = True, "stop_token"
            self.finish_reason, self.stop_reason = pb.FINISH_REASON_STOP, str(ids[-1])
            self._flush(resp)

    def _text(self, ids: list[int]) -> tuple[str, list[int], bool]:
        """The text `ids` add, the ids kept, and whether a caller's stop id ends the reply
        at the last of them: where calls are tagged, the first one outside a call does."""
        if self._calls is None:
            return self._detok.add(ids), ids, False
        text = ""
        for i, token in enumerate(ids):
            piece = self._detok.add([token])
            self._calls.feed(piece)
            text += piece
            if token in self._caller_stop_ids and not self._calls.inside:
                return text, ids[:i + 1], True
        return text, ids, False

    def _finish(self, upd: messages.RequestUpdate, resp: pb.GenerateResponse) -> None:
        reason = upd.finished
        assert reason is not None
        self.finish_reason, self.error = int(reason), upd.error
        if reason == messages.FinishReason.LENGTH and not self.output_token_ids:
            self.prefilled_unix = self.clock()  # max_tokens 0: its prefill ends it
        if reason == messages.FinishReason.ERROR and not self.output_token_ids:
            raise Refusal("upstream_error", self.failure_message())
        if reason != messages.FinishReason.ABORT:
            self._flush(resp)
        last = self.output_token_ids[-1] if self.output_token_ids else None
        if reason == messages.FinishReason.STOP and last in self._caller_stop_ids:
            self.stop_reason = str(last)
        elif reason == messages.FinishReason.ERROR:
            self.stop_reason = self.failure_message()
        elif reason == messages.FinishReason.ABORT and upd.error in ("deadline", "shutdown"):
            # the engine enforces deadlines, and says so; `shutdown`: its process was stopped
            # under the request (a drain past drain_secs, a forced unload, the neuron's stop)
            self.stop_reason = upd.error

    def _flush(self, resp: pb.GenerateResponse) -> None:
        """The reply ended: what the detokenizer held back (an incomplete character at the
        very end) may still complete a stop string; what the stop checker held was never
        one."""
        tail, matched = self._stopper.feed(self._detok.flush())
        resp.text += tail
        if matched is not None:
            self.finish_reason, self.stop_reason = pb.FINISH_REASON_STOP, matched
        else:
            resp.text += self._stopper.flush()

    def failure_message(self) -> str:
        """What the caller is told of an engine failure: not the engine's own words (an
        exception's text can hold paths and internals, and reaches any client), but where
        they are: this request's `request.done` line on the neuron, whose `error` holds
        them (docs/errors.md, "The table")."""
        return (f"the engine failed on this request; the neuron's log has the cause under "
                f"req_id {self.new.req_id}")

    def fail(self, error: str) -> None:
        """The engine link broke mid-request (not the caller's doing): finish as an error."""
        self.error = error
        if self.finish_reason is None:
            self.finish_reason = pb.FINISH_REASON_ERROR

    # ------------------------------------------------------------------ summary

    def usage(self) -> pb.Usage:
        """Token counts and times so far: queue (arrival → admitted), prefill (arrival →
        first token, or to the prefill's end where it asked for none: max_tokens 0) and
        decode (first → last token), in milliseconds."""
        arrival = self.new.arrival_unix
        first = self.first_token_unix
        prefilled = first or self.prefilled_unix
        return pb.Usage(
            prompt_tokens=len(self.new.prompt_token_ids),
            completion_tokens=len(self.output_token_ids), cached_tokens=self.cached_tokens,
            queue_ms=(self.admitted_unix - arrival) * _MS if self.admitted_unix else 0.0,
            prefill_ms=(prefilled - arrival) * _MS if prefilled else 0.0,
            decode_ms=(self.last_token_unix - first) * _MS if first else 0.0,
            reasoning_tokens=self.reasoning_tokens, draft_tokens=self.draft_tokens,
            accepted_draft_tokens=self.accepted_draft_tokens)

    def outcome(self, client_gone: bool) -> str:
        """The request's outcome for metrics and request.done: stop, length, abort, error,
        client_gone, or unspecified (ended without a finish)."""
        if client_gone:
            return "client_gone"
        return pb.FinishReason.Name(self.finish_reason or 0).removeprefix("FINISH_REASON_").lower()

    def _logprobs(self, lps: list[messages.TokenLogprob]) -> list[pb.TokenLogprob]:
        tok, text = self.tokenizer, self._token_text
        return [pb.TokenLogprob(token_id=lp.token_id, token=text(lp.token_id),
                                token_bytes=tok.token_bytes(lp.token_id), logprob=lp.logprob,
                                top=[pb.TopLogprob(token_id=t.token_id, token=text(t.token_id),
                                                   token_bytes=tok.token_bytes(t.token_id),
                                                   logprob=t.logprob) for t in lp.top])
                for lp in lps]

    def _add_scored(self, lps: list[messages.TokenLogprob]) -> None:
        """The prompt's next entries (the first token's, with no logprob, came first), each
        at its offset in the prompt's text."""
        assert self._scored is not None
        entries, at = self._scored.prompt_logprobs, len(self._scored.prompt_logprobs)
        entries.extend(self._logprobs(lps))
        for i in range(at, min(len(entries), len(self._text_offsets))):
            entries[i].text_offset = self._text_offsets[i]

    def _with_scored(self, resp: pb.GenerateResponse) -> pb.GenerateResponse:
        """`resp` on the message that gathered the prompt's entries (its few fields copied,
        not the entries); without them where the engine scored fewer than the prompt's
        tokens (it ended the request before its prefill did)."""
        scored, self._scored = self._scored, None
        assert scored is not None
        if len(scored.prompt_logprobs) != len(self.new.prompt_token_ids):
            return resp
        scored.MergeFrom(resp)
        return scored

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text
