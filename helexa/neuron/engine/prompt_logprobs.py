"""Prompt logprobs: the logprob of every prompt token after the first, and the best k
there, for a request that asks (SamplingParams.prompt_logprobs; the router's echo with
logprobs on /v1/completions, as vLLM's prompt_logprobs).

Token p's entry is the log-softmax, in float32, of the logits at position p - 1 evaluated
at token p, beside the k best tokens there. They are made in prefill: each chunk of such
a request asks the runner for logits at every row (SeqInput.all_logits) rather than at its
last alone, and its rows before the prompt's last position score the token after each
(`scored_rows`). After the step `split` scores them in pieces of _PIECE rows (so no
[chunk, vocab] temporary beside the logits themselves) and hands the sampler the step's
other rows only: the rows it samples and verifies are laid out (step_inputs.lay_out)
as if the scored rows were not there, and a step without such a request takes none of
this. The chunk ends as usual, so the [prompt, vocab] logits of a long prompt never exist
at once; and a step scores at most ROWS_PER_SLOT × max_slots rows (scheduler.py), so its
logits stay within what the load's probe measured for sampling max_slots rows
(pool_probe.decode_peaks: the fp32 logits and ~50 B a logit beside them).

A prefix-cache hit would skip positions whose logits these need: such a request takes
none (admission.py), though it files its own blocks for the requests after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine.messages import TokenLogprob, TopToken
from helexa.neuron.engine.runner import StepOutput
from helexa.neuron.engine.seq_input import logits_count

if TYPE_CHECKING:
    from helexa.neuron.engine.request import Request
    from helexa.neuron.engine.step_inputs import StepInputs

# Rows a step scores, per decode row it is built for: 4 rows' fp32 logits and the LM head's
# output before them (≤ 10 B a logit at tp > 1) stay under the 54 B a logit the probe
# measured for each sampled decode row.
ROWS_PER_SLOT = 4
_PIECE = 128  # rows scored at once: the log-sum-exp's temporaries are [_PIECE, vocab]


def wants(req: Request) -> bool:
    return req.sampling.prompt_logprobs is not None


def shares(need: list[int], rows: int) -> list[int]:
    """`rows` shared between requests needing `need` rows each: equal shares (the first
    ones one more where they do not divide), a share one needs less of going to the rest."""
    out = [0] * len(need)
    open_ = [i for i, n in enumerate(need) if n > 0]
    while open_ and rows > 0:
        each, extra = divmod(rows, len(open_))
        for j, i in enumerate(open_):
            give = min(need[i] - out[i], each + (j < extra))
            out[i] += give
            rows -= give
        open_ = [i for i in open_ if out[i] < need[i]]
    return out


def scored_rows(req: Request, start: int, end: int) -> int:
    """How many rows of req's chunk of positions [start, end) score a prompt token: those
    before the prompt's last position (each scores the next token); 0 where it asks none."""
    if not wants(req):
        return 0
    return max(0, min(end, req.num_prompt_tokens - 1) - start)


@dataclass
class PromptRows:
    """A chunk's scored rows: `count` logits rows from `row` (the runner's numbering, the
    scored rows counted), positions `start`.. of `req`, scoring tokens start + 1..."""

    req: Request
    row: int
    start: int
    count: int


def split(out: StepOutput, inputs: StepInputs) -> tuple[StepOutput, dict[str, list[TokenLogprob]]]:
    """The step's output without its scored rows (what the sampler and the verifier read),
    and each scoring request's entries; `out` itself where none scored."""
    if not inputs.prompt:
        return out, {}
    scored = {p.req.req_id: _score(out.logits, p) for p in inputs.prompt}
    keep: list[int] = []
    row, prompt = 0, iter(inputs.prompt)
    for s in inputs.seqs:
        n = logits_count(s) if s.need_logits else 0
        skip = next(prompt).count if s.all_logits else 0
        keep.extend(range(row + skip, row + n))
        row += n
    logits = out.logits.index_select(0, to_device(keep, torch.long, out.logits.device))
    return StepOutput(logits, out.row_starts, out.hidden), scored


def _score(logits: torch.Tensor, p: PromptRows) -> list[TokenLogprob]:
    """p's rows' entries: each next prompt token's logprob and the k best, in float32."""
    vocab = logits.shape[1]
    k = min(p.req.sampling.prompt_logprobs or 0, vocab)
    targets = p.req.prompt_token_ids[p.start + 1:p.start + 1 + p.count]
    tgt = to_device(targets, torch.long, logits.device)
    chosen, top_v, top_i = [], [], []
    for a in range(0, p.count, _PIECE):
        x = logits[p.row + a:p.row + min(a + _PIECE, p.count)].float()
        lse = torch.logsumexp(x, dim=-1, keepdim=True)
        chosen.append(x.gather(1, tgt[a:a + x.shape[0]].unsqueeze(1)) - lse)
        if k:
            v, i = x.topk(k, dim=-1)
            top_v.append(v - lse)
            top_i.append(i)
    lps = torch.cat(chosen).squeeze(1).tolist()
    if not k:
        return [TokenLogprob(t, lp, []) for t, lp in zip(targets, lps, strict=True)]
    vs, ids = torch.cat(top_v).tolist(), torch.cat(top_i).tolist()
    return [TokenLogprob(t, lp, [TopToken(j, v) for j, v in zip(row_i, row_v, strict=True)])
            for t, lp, row_i, row_v in zip(targets, lps, ids, vs, strict=True)]
