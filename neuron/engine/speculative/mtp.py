"""The MTP drafter: the checkpoint's multi-token-prediction head proposes the drafts.

The head (neuron/models/mtp.py) at position t reads the target's final hidden
state h_t and token t + 1, and predicts token t + 2. So it follows the target:

- `observe`, after every engine step: for each request, the positions the target
  computed and kept this step (a prefill chunk; a decode token; a verification
  row's last token and accepted drafts) run through the head with the tokens
  shifted by one. Every such position's next token is known by then (the prompt,
  or the token just sampled), so the head's attention KV (its own layer of the
  pool, under the request's block table) is filled for every position the target
  has, prompt included. The last row's output is kept: its greedy token (through
  the lm_head, for drafting requests only) is the first draft, its hidden state
  the start of the chain.
- `propose_batch`, before the next step: draft 1 is that token; for k > 1 the
  head runs k - 1 more single-token steps for all drafting requests at once,
  each reading its own previous output as the hidden state and its own greedy
  token as the next input, one position further. Those steps write the head's
  KV past the request's computed length; the next `observe` overwrites the
  positions the target keeps, and the rest are overwritten before they are read
  (attention reads positions up to the query's own), as the target's own
  rejected drafts are (speculator.py).

Drafts are greedy: `Draft.probs` is None (one-hot), so a sampled request accepts
a draft with the target's own probability of it (verify.py).

The head runs at tensor parallel 1 only; a model whose checkpoint has no head,
or a larger tp, is refused (`MtpUnavailable`, logged as engine.speculation_refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from helexa.neuron.engine.model_runner import SeqInput
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.speculative.drafters import Draft


class MtpUnavailable(ValueError):
    """This model cannot draft with an MTP head; the message says why."""


@dataclass
class _Tail:
    """A request's last observed position and the head's output there."""

    pos: int  # the target has computed up to here, and the head too
    hidden: torch.Tensor  # [H] the head's output at pos: its logits give draft 1


class MtpDrafter:
    name = "mtp"
    writes_kv = True  # the chain writes the head's KV past the computed length

    def __init__(self, runner: Any) -> None:
        model: Any = getattr(runner, "model", None)  # the fake runner has none
        if getattr(model, "mtp", None) is None:
            raise MtpUnavailable("the model loaded no MTP head (it needs config.json "
                                 "mtp_num_hidden_layers and the mtp.* tensors, in a checkpoint "
                                 "not quantised in the file)")
        if getattr(runner, "mtp_kv_layers", 0) < 1:
            raise MtpUnavailable("the plan counts no KV for the MTP head: the pool holds it "
                                 "where the config names speculation = \"mtp\" at load (engine,"
                                 " a profile) and the planned config.json declares "
                                 "mtp_num_hidden_layers")
        if getattr(runner, "tp_size", 1) > 1:
            raise MtpUnavailable("the MTP head drafts at tensor parallel 1 only")
        self.runner = runner
        model.keep_hidden = True  # the target's step keeps the hidden states observe reads
        self.tails: dict[str, _Tail] = {}

    def propose(self, req: Request, k: int) -> Draft:
        return self.propose_batch([req], [k])[0]

    def observe(self, items: Sequence[tuple[Request, int, int]]) -> None:
        """After a step: (request, its index among the step's sequences, positions it
        computed and kept) for each request still running. No logits here: the lm_head
        is the head's costliest matmul on a large vocabulary, and only requests that
        draft next step need it (propose_batch)."""
        hidden = self.runner.model.last_hidden
        starts = self.runner.seq_starts
        seqs: list[SeqInput] = []
        rows: list[torch.Tensor] = []
        decoding: list[tuple[Request, int]] = []  # (request, its last row): a draft may follow
        num_rows = 0
        for req, index, n in items:
            end = req.num_computed_tokens
            if n <= 0 or req.num_tokens <= end:
                continue
            start = end - n
            seqs.append(SeqInput(req.token_slice(start + 1, end + 1), start, req.block_table,
                                 need_logits=False))
            rows.append(hidden[starts[index]:starts[index] + n])
            num_rows += n
            if req.num_tokens == end + 1:  # a prefill chunk with prompt left drafts nothing
                decoding.append((req, num_rows - 1))
        if not seqs:
            return
        _, out = self.runner.execute_mtp(seqs, torch.cat(rows))
        for req, row in decoding:
            # a copy: a view would keep the whole step's output alive until the next
            self.tails[req.req_id] = _Tail(req.num_computed_tokens - 1, out[row].clone())

    def propose_batch(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        """Drafts for all `reqs` at once (ks[i] tokens at most for reqs[i])."""
        drafts = [Draft([]) for _ in reqs]
        chain: list[tuple[int, Request, int, _Tail]] = []
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            tail = self.tails.get(req.req_id)
            # the head must have seen every position the target computed
            if (k > 0 and tail is not None and tail.pos == req.num_computed_tokens - 1
                    and req.num_tokens == req.num_computed_tokens + 1):
                chain.append((i, req, k, tail))
        if not chain:
            return drafts
        # draft 1: the head's prediction at the last position the target computed
        first = self.runner.mtp_logits(torch.stack([tail.hidden for *_, tail in chain]))
        for (i, *_), token in zip(chain, first.argmax(-1).tolist(), strict=True):
            drafts[i].tokens.append(token)
        # drafts 2..k: the head chained on its own output, one position further each
        hidden = {i: tail.hidden for i, _, _, tail in chain}
        for j in range(1, max(k for _, _, k, _ in chain)):
            active = [(i, req, tail) for i, req, k, tail in chain if k > j]
            seqs = [SeqInput([drafts[i].tokens[-1]], tail.pos + j, req.block_table, True)
                    for i, req, tail in active]
            logits, out = self.runner.execute_mtp(
                seqs, torch.stack([hidden[i] for i, _, _ in active]))
            for row, ((i, _, _), token) in enumerate(zip(active, logits.argmax(-1).tolist(),
                                                         strict=True)):
                drafts[i].tokens.append(token)
                hidden[i] = out[row]
        return drafts

    def release(self, req: Request) -> None:
        self.tails.pop(req.req_id, None)
