"""The engine's speculation: per step, drafts for the decoding requests; after it, the count.

EngineCore owns one Speculator per model. Before scheduling, `draft` asks the
policy how many tokens each decoding request may draft (policy.py) and the
drafter for them, and leaves them on the request (`Request.draft`); the
scheduler then gives that request a row of 1 + len(draft) tokens (when the
step's token budget has room) and the engine scores it with logits at every
position. `accept` verifies a step's rows (verify.py) and keeps the figures, per model
and per request; `observe` shows the drafter the step (the MTP head follows the
target), `release` tells it a request ended. A drafter that fails costs drafts,
never output: its exception is logged (engine.draft_failed) and the step goes on
without them.

`configure` applies the speculation that applies now (limits in force: a reload,
a profile switch), switching drafter when it names another (setup.py makes it).

The KV of drafted tokens is written past the request's computed length; the
engine advances `num_computed_tokens` by the accepted ones only, so rejected
positions are simply overwritten by later steps and attention never reads
them (it reads positions below the query's own). Drafts are capped at the
request's remaining output budget less one, so every position written lies
inside its reservation: speculation never draws a block the reservation
does not cover, and the ledger is unchanged by it. A growable request's budget
grows only once its output reaches it (engine/growth.py): its drafts shrink in
the last spec_k tokens before, and the room is read anew after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from helexa.config.speculation import Speculation
from helexa.neuron.engine import messages
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import Runners, StepOutput
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import Draft, Drafter, Kept
from helexa.neuron.engine.speculative.policy import choose_k, probe_due, update_acceptance
from helexa.neuron.engine.speculative.setup import Drafters, EnsureBlocks
from helexa.neuron.engine.speculative.verify import Row, verify_rows


class Speculator:
    def __init__(self, runners: Runners, ensure_blocks: EnsureBlocks, spec: EngineSpec,
                 limits: messages.Limits, *, log: Any = None) -> None:
        """The model's drafters (setup.py) over its runners, and the one the speculation of
        `limits` names; `ensure_blocks(req, n)` draws a request's reserved blocks for a
        drafter."""
        self.drafters = Drafters(runners, ensure_blocks, spec, limits)
        self.log, self.model_id = log, spec.model_id
        self.drafted_tokens = 0  # cumulative: tokens verified, and of those accepted
        self.accepted_tokens = 0
        self.policy: Speculation = limits
        self.drafter: Drafter | None = None
        self.pinned = False  # a drafter pinned (tests) stays whatever a speculation names
        self.steps = 0  # steps drafted for (draft) or counted quiet: when probes fall due
        self.configure(limits)

    @property
    def name(self) -> str:
        return self.drafter.name if self.drafter is not None else "off"

    def figures(self) -> dict[str, Any]:
        """The model's status fields of speculation: the drafter and the cumulative counts."""
        return {"drafter": self.name, "spec_drafted_tokens": self.drafted_tokens,
                "spec_accepted_tokens": self.accepted_tokens}

    @property
    def follows_target(self) -> bool:
        """Whether the step must keep its hidden states for the drafter (observe)."""
        return self.drafter is not None and self.drafter.follows_target

    def pin(self, drafter: Drafter | None) -> None:
        """Draft with `drafter` from now on, whatever a speculation names."""
        self.drafter, self.pinned = drafter, True

    def configure(self, speculation: Speculation) -> None:
        """The speculation in force: its policy, and its drafter unless pinned (None, logged
        as engine.speculation_refused, where the drafter it names cannot run here)."""
        self.policy = speculation
        if self.pinned or speculation.speculation == self.name:
            return
        try:
            self.drafter = self.drafters.drafter_for(speculation)
        except ValueError as e:
            self.drafter = None
            if self.log is not None:
                self.log.warning("engine.speculation_refused", model=self.model_id,
                                 speculation=speculation.speculation, reason=str(e))

    def draft(self, running: Sequence[Request], max_slots: int) -> None:
        """Leave this step's draft (possibly none) on every decoding request."""
        for req in running:
            req.draft = None
        asks = self._asks(running, len(running), max_slots)
        if asks:
            self._propose(asks)
        self.steps += 1

    def _propose(self, asks: list[tuple[Request, int]]) -> None:
        assert self.drafter is not None
        try:
            drafts = self.drafter.propose_batch([r for r, _ in asks], [k for _, k in asks])
        except Exception:  # a draft model's forward, the MTP head's pass: costs only drafts
            self._failed()
            return
        for (req, k), d in zip(asks, drafts, strict=True):
            if d.tokens:
                probs = d.probs[:k] if d.probs is not None else None
                req.draft = Draft(d.tokens[:k], probs)

    def quiet(self, reqs: Sequence[Request], num_running: int, max_slots: int) -> bool:
        """Whether `draft` would ask the drafter for nothing for `reqs` this step, with
        `num_running` requests running (lookahead.follow asks before it launches a step
        without drafts). Where quiet, the step is counted as `draft` counts it."""
        if self.drafter is not None and self._asks(reqs, num_running, max_slots):
            return False
        self.steps += 1
        return True

    def _asks(self, reqs: Sequence[Request], num_running: int, max_slots: int
              ) -> list[tuple[Request, int]]:
        """(request, most tokens it may draft) of each request of `reqs` that drafts this
        step (the policy's k > 0); nothing without a drafter. Changes nothing."""
        if self.drafter is None:
            return []
        occupancy = num_running / max(1, max_slots)
        probe = probe_due(self.steps)
        asks: list[tuple[Request, int]] = []
        for req in reqs:
            if req.is_prefilling or req.num_uncomputed_tokens != 1:
                continue
            st = req.sampling_state
            if st is not None and (st.has_penalties or st.wants_logprobs):
                continue  # their next distribution depends on which drafts are accepted
            if req.matcher is not None:
                continue  # a grammar mask acts on the one row sampled per step
            if req.images is not None:
                continue  # drafters place tokens at 1-D positions; its are M-RoPE's
            room = req.output_budget - req.num_output_tokens - 1  # the bonus token needs one
            if req.thought is not None:  # no draft may reach a token the budget forces
                unforced = req.thought.unforced_tokens()
                if unforced is not None:
                    room = min(room, unforced - 1)
            k = min(room, choose_k(self.policy, occupancy=occupancy,
                                   acceptance=req.spec_acceptance, probe=probe))
            if k > 0:
                asks.append((req, k))
        return asks

    def observe(self, step: StepOutput, kept: Sequence[Kept]) -> None:
        """After a step: what it computed, and (request, index among the step's sequences,
        positions computed and kept) for each request still running."""
        # an image request never drafts (choose, above): the drafter need not follow it
        kept = [k for k in kept if k[0].images is None]
        if self.drafter is None or not kept:
            return
        try:
            self.drafter.observe(step, kept)
        except Exception:  # a drafter that follows the target (MTP): costs drafts, not output
            self._failed()

    def release(self, req: Request) -> None:
        """`req` ended: the drafter drops what it kept for it."""
        if self.drafter is not None:
            self.drafter.release(req)

    def accept(self, rows: list[tuple[Request, torch.Tensor, int]]) -> list[list[int]]:
        """Verify a step's rows, each (request, its logits [num_draft + 1, vocab], num_draft):
        the tokens each produces. One call a step, so that the rows share their reads from
        the device (verify.verify_rows)."""
        checked = []
        for req, logits, num_draft in rows:
            assert req.draft is not None and req.sampling_state is not None
            q = req.draft.probs[:num_draft] if req.draft.probs is not None else None
            checked.append(Row(logits, req.draft.tokens[:num_draft], q, req.sampling_state))
        outs = verify_rows(checked)
        for (req, _, num_draft), out in zip(rows, outs, strict=True):
            accepted = len(out) - 1
            self.drafted_tokens += num_draft
            self.accepted_tokens += accepted
            req.spec_drafted_tokens += num_draft  # the request's own usage (docs/api.md)
            req.spec_accepted_tokens += accepted
            req.spec_acceptance = update_acceptance(req.spec_acceptance, num_draft, accepted)
            req.draft = None
        return outs

    def _failed(self) -> None:
        if self.log is not None:
            self.log.exception("engine.draft_failed", drafter=self.name)
