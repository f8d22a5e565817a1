"""One step's rows: what the model runner computes, and what each logits row is for.

`lay_out(plan, ...)` turns the scheduler's plan into the runner's sequences
(SeqInput), drawing each request's reserved blocks as far as the step writes,
and records which logits rows are sampled (one token: a decode row, the chunk
that ends a prompt) and which verify drafts (a decode token and k drafts ask for
k + 1 rows). After the step, `pick_tokens` turns the logits into each request's
new tokens (the sampler for the sampled rows, under any grammar masks; the
rejection rule for the verification rows: speculative/verify.py), and
`StepInputs.kept` says how many positions each request keeps: a verification row
keeps its decode token and the drafts accepted, so the rejected positions are
never counted as computed and later steps overwrite them. A request asking for its prompt's
logprobs has every row of its prefill chunks computed too, the scored rows apart
(prompt_logprobs.py: they are split off before the sampler reads the logits).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.messages import TokenLogprob
from helexa.neuron.engine.prompt_logprobs import PromptRows, scored_rows
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import StepOutput
from helexa.neuron.engine.sampler import Sampler, SamplingState
from helexa.neuron.engine.scheduler import ScheduledChunk, StepPlan
from helexa.neuron.engine.seq_input import SeqInput

# a step's verification rows, each (request, its logits rows, num_draft) -> each one's new
# tokens (Speculator.accept)
Verify = Callable[[list[tuple[Request, torch.Tensor, int]]], list[list[int]]]


@dataclass
class StepInputs:
    """The step's requests and chunks (in plan order), their sequences and logits rows."""

    reqs: list[Request]
    chunks: list[ScheduledChunk]
    seqs: list[SeqInput] = field(default_factory=list)
    sampled: list[tuple[Request, int]] = field(default_factory=list)  # (request, its row)
    # (request, its first row, drafts verified): rows first .. first + drafts
    verified: list[tuple[Request, int, int]] = field(default_factory=list)
    # prefill chunks scoring prompt tokens, their rows numbered among all the runner's
    prompt: list[PromptRows] = field(default_factory=list)

    @property
    def masked(self) -> list[int]:
        """Positions in `sampled` whose token a grammar constrains (an answering request
        with a matcher). A constrained request is never drafted (speculator.py), so it
        always has exactly one sampled row."""
        return [j for j, (r, _) in enumerate(self.sampled) if r.matcher is not None
                and (r.thought is None or r.thought.answering)]

    def kept(self, new_tokens: dict[str, list[int]]) -> list[int]:
        """Positions each request computed and keeps (chunks' order): a verification row
        keeps its decode token and the drafts accepted (its new tokens less the bonus one)."""
        out = []
        for req, chunk in zip(self.reqs, self.chunks, strict=True):
            accepted = len(new_tokens[req.req_id]) - 1 if chunk.num_draft else 0
            out.append(chunk.num_tokens - chunk.num_draft + accepted)
        return out


class StepResult(NamedTuple):
    """A step that ran: its rows, the runner's output, each request's new tokens, and the
    sampled ones' logprobs; and the prompt logprobs its chunks scored."""

    inputs: StepInputs
    out: StepOutput
    new_tokens: dict[str, list[int]]
    logprobs: dict[str, TokenLogprob | None]
    prompt_logprobs: dict[str, list[TokenLogprob]] = {}  # never mutated


def lay_out(plan: StepPlan, reqs: list[Request], pool: BlockPool,
            ensure_blocks: Callable[[Request, int], None]) -> StepInputs:
    """The runner's sequences for `plan` (whose chunks' requests are `reqs`), each
    request's blocks drawn as far as it writes."""
    inputs = StepInputs(reqs, list(plan.chunks))
    rows = 0  # sampled logits rows so far: a verification row has num_draft + 1
    every = 0  # the runner's logits rows so far: those, and the rows scoring the prompt
    for req, chunk in zip(inputs.reqs, inputs.chunks, strict=True):
        start = req.num_computed_tokens
        end = start + chunk.num_tokens
        ensure_blocks(req, end)
        tokens = req.token_slice(start, end - chunk.num_draft)
        if chunk.num_draft:
            assert req.draft is not None
            tokens += req.draft.tokens[:chunk.num_draft]
        need_logits = end - chunk.num_draft == req.num_tokens
        scored = 0 if req.sampling.prompt_logprobs is None else scored_rows(req, start, end)
        seq = SeqInput(token_ids=tokens, num_computed=start, block_table=req.block_table,
                       need_logits=need_logits or scored > 0,
                       state_slot=pool.state_slot(req.req_id), num_logits=chunk.num_draft + 1,
                       all_logits=scored > 0)
        if req.images is not None:  # its chunk's M-RoPE shift and images
            seq.rope_delta, seq.images = req.images.chunk(start, end)
        inputs.seqs.append(seq)
        if scored:
            inputs.prompt.append(PromptRows(req, every, start, scored))
        if chunk.num_draft:
            inputs.verified.append((req, rows, chunk.num_draft))
        elif need_logits:
            inputs.sampled.append((req, rows))
        rows += chunk.num_draft + 1 if need_logits else 0
        every += len(tokens) if scored else chunk.num_draft + 1 if need_logits else 0
    return inputs


def pick_tokens(inputs: StepInputs, logits: torch.Tensor, sampler: Sampler,
                masks: Future[torch.Tensor] | None, verify: Verify
                ) -> tuple[dict[str, list[int]], dict[str, TokenLogprob | None]]:
    """Each request's new tokens from the step's logits, and the sampled ones' logprobs.
    `masks` are the grammar bitmasks of `inputs.masked`, computed while the model ran."""
    sampled, verified = inputs.sampled, inputs.verified
    # rows picked by an index copied from pinned memory (a Python list as an index is a
    # copy to a GPU that waits for it to drain)
    sample_logits = logits.index_select(0, to_device([r for _, r in sampled], torch.long,
                                                     logits.device)) if verified else logits
    states = [_sampling_state(r) for r, _ in sampled]
    if masks is not None:
        picks = sampler(sample_logits, states, bitmask=(inputs.masked, masks.result()))
    else:
        picks = sampler(sample_logits, states) if sampled else []
    new_tokens = {req.req_id: [token] for (req, _), (token, _) in zip(sampled, picks,
                                                                        strict=True)}
    logprobs = {req.req_id: lp for (req, _), (_, lp) in zip(sampled, picks, strict=True)}
    if verified:
        outs = verify([(req, logits[row:row + k + 1], k) for req, row, k in verified])
        new_tokens.update((req.req_id, out) for (req, _, _), out in zip(verified, outs,
                                                                         strict=True))
    return new_tokens, logprobs


def _sampling_state(req: Request) -> SamplingState:
    assert req.sampling_state is not None, "set when the request was queued"
    return req.sampling_state
