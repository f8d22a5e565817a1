"""The MTP drafter: the checkpoint's multi-token-prediction head proposes the drafts.

The head (helexa/neuron/models/mtp.py) at position t reads the target's final hidden
state h_t and token t + 1, and predicts token t + 2. So it follows the target:

- `observe`, after every engine step: for each request, the target's hidden
  states (the step's StepOutput.hidden: `follows_target` asks the runner to keep
  them) of the positions it computed and kept this step (a prefill chunk; a
  decode token; a verification row's last token and accepted drafts) are kept
  as the request's backlog. Every such position's next token is known by then
  (the prompt, or the token just sampled).
- The backlog runs through the head (tokens shifted by one), which writes the
  head's attention KV (its own layer of the pool, under the request's block
  table) for every position the target has, prompt included: at once for a
  request whose backlog reaches CATCH_UP_ROWS (a long prompt chunk, or a request
  that has not drafted for a while), else when the request drafts. A request
  the policy keeps from drafting (low acceptance, a full batch) so costs the
  head one batched pass per CATCH_UP_ROWS positions, not one per step.
- `propose_batch`, before the next step: the drafting requests' backlogs run in
  one pass; the head's output at the last position, through the lm_head, gives
  draft 1; for k > 1 the head runs k - 1 more single-token steps for all of them
  at once, each reading its own previous output as the hidden state and its own
  greedy token as the next input, one position further (the tokens stay on the
  device, as lookahead's do, each pass launched without waiting for the one before;
  all the drafts are read back once, at the end). Those steps write the
  head's KV past the request's computed length; the backlog's pass overwrites
  the positions the target keeps, and the rest are overwritten before they are
  read (attention reads positions up to the query's own), as the target's own
  rejected drafts are (speculator.py).

Drafts are greedy: `Draft.probs` is None (one-hot), so a sampled request accepts
a draft with the target's own probability of it (verify.py).

At tensor parallel > 1 every pass runs on every rank (mtp_passes.py,
tp_worker.py): the drafts are decided here, on rank 0, from the gathered logits,
and reach the other ranks as the next pass's tokens, broadcast from rank 0's
device. A model whose checkpoint
has no head is refused (`MtpUnavailable`, logged as engine.speculation_refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import Runner, StepOutput
from helexa.neuron.engine.seq_input import SeqInput
from helexa.neuron.engine.speculative.drafters import Draft, Drafter, Kept

# A request's backlog runs through the head once it holds this many positions.
CATCH_UP_ROWS = 64


class MtpUnavailable(ValueError):
    """This model cannot draft with an MTP head; the message says why."""


@dataclass
class _Follow:
    """How far the head has followed one request's target."""

    start: int  # first position the head has not run (its KV there is not written)
    rows: list[torch.Tensor] = field(default_factory=list)  # target hidden, start onwards
    num_rows: int = 0
    out: torch.Tensor | None = None  # [H] the head's output at start - 1 (draft 1's logits)


class MtpDrafter(Drafter):
    name = "mtp"
    follows_target = True

    def __init__(self, runner: Runner, ensure_blocks: Callable[[Request, int], None]) -> None:
        """`ensure_blocks(req, n)`: the engine draws req's blocks (from its reservation)
        until its table covers n tokens, so the chain can write the head's KV there."""
        if not runner.has_mtp_head:
            raise MtpUnavailable("the model loaded no MTP head (it needs config.json "
                                 "mtp_num_hidden_layers and the mtp.* tensors, in a checkpoint "
                                 "not quantised in the file)")
        if runner.mtp_kv_layers < 1:
            raise MtpUnavailable("the plan counts no KV for the MTP head: the pool holds it "
                                 "where the config names speculation = \"mtp\" at load (engine,"
                                 " a profile) and the planned config.json declares "
                                 "mtp_num_hidden_layers")
        self.runner = runner
        self.ensure_blocks = ensure_blocks
        self.follows: dict[str, _Follow] = {}

    def observe(self, step: StepOutput, kept: Sequence[Kept]) -> None:
        """Keep the target's hidden states of the positions each request kept."""
        hidden, starts = step.hidden, step.row_starts
        assert hidden is not None, "the step kept no hidden states (follows_target)"
        due: list[Request] = []
        for req, index, n in kept:
            end = req.num_computed_tokens
            f = self.follows.get(req.req_id)
            if f is None or f.start + f.num_rows != end - n:  # first step (or lost track)
                f = self.follows[req.req_id] = _Follow(end - n)
            if n > 0:  # a copy: the step's hidden states are gone by the next step
                f.rows.append(hidden[starts[index]:starts[index] + n].clone())
                f.num_rows += n
            if f.num_rows >= CATCH_UP_ROWS:
                due.append(req)
        self._catch_up(due)

    def _catch_up(self, reqs: Sequence[Request]) -> None:
        """Run `reqs`' backlogs through the head in one pass (its KV, its last output)."""
        todo = [(req, self.follows[req.req_id]) for req in reqs
                if self.follows[req.req_id].num_rows]
        if not todo:
            return
        seqs = [SeqInput(req.token_slice(f.start + 1, f.start + f.num_rows + 1), f.start,
                         req.block_table, need_logits=False) for req, f in todo]
        _, out = self.runner.execute_mtp(seqs, torch.cat([r for _, f in todo for r in f.rows]))
        last = 0
        for _, f in todo:
            last += f.num_rows
            f.out = out[last - 1].clone()  # a copy: a view would hold the whole pass
            f.start += f.num_rows
            f.rows, f.num_rows = [], 0

    def propose_batch(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Drafts for all `reqs` at once (ks[i] tokens at most for reqs[i])."""
        drafts = [Draft([]) for _ in reqs]
        chain: list[tuple[int, Request, int, _Follow]] = []
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            f = self.follows.get(req.req_id)
            # the head can follow every position the target computed, the last one's
            # next token is known (the one the target decodes next)
            if (k > 0 and f is not None and f.start + f.num_rows == req.num_computed_tokens
                    and req.num_tokens == req.num_computed_tokens + 1):
                chain.append((i, req, k, f))
        for _, req, k, _ in chain:  # the chain writes up to position num_tokens + k - 3
            self.ensure_blocks(req, req.num_tokens + k - 1)
        self._catch_up([req for _, req, _, _ in chain])
        chain = [c for c in chain if c[3].out is not None]
        if not chain:
            return drafts
        # draft 1: the head's prediction at the last position the target computed
        hidden = {i: f.out for i, _, _, f in chain if f.out is not None}
        first = self.runner.mtp_logits(torch.stack([hidden[i] for i, *_ in chain]))
        # drafts 2..k: the head chained on its own output, one position further each, its
        # tokens kept on the device (each pass launched without waiting for the one
        # before) and all read back at the end, at once
        passes = [([i for i, *_ in chain], first.argmax(-1))]
        for j in range(1, max(k for _, _, k, _ in chain)):
            before, tokens = passes[-1]
            active = [(i, req, f) for i, req, k, f in chain if k > j]
            ids = [i for i, _, _ in active]
            if ids != before:  # fewer rows go on: theirs of the last pass's tokens
                at = {i: row for row, i in enumerate(before)}
                tokens = tokens[to_device([at[i] for i in ids], torch.long, tokens.device)]
            seqs = [SeqInput([0], f.start - 1 + j, req.block_table, True)
                    for _, req, f in active]
            logits, out = self.runner.execute_mtp(
                seqs, torch.stack([hidden[i] for i in ids]), tokens)
            passes.append((ids, logits.argmax(-1)))
            for row, i in enumerate(ids):
                hidden[i] = out[row]
        picked = iter(torch.cat([t for _, t in passes]).tolist())
        for ids, _ in passes:
            for i in ids:
                drafts[i].tokens.append(next(picked))
        return drafts

    def release(self, req: Request) -> None:
        self.follows.pop(req.req_id, None)
