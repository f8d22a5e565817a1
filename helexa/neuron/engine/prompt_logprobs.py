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
at once; and a step scores at most `allowance` rows (the scheduler's scoring_rows, shared
between the requests scoring in it), so its logits stay within what the load's probe
measured. A scored row costs at most SCORED_LOGIT_BYTES a logit (its fp32 logits and, as
they are made, the LM head's output: ≤ 10 B a logit at tp > 1). Two bounds, the larger:
- rows: ROWS_PER_SLOT × max_slots; their logits stay under what the probe measured for
  sampling max_slots rows (pool_probe.decode_peaks: the fp32 logits and ~50 B a logit
  beside them), 4 × 14 B ≤ 54 B a logit.
- bytes (`room`, set at load by pool_probe): a step of at most max_batched_tokens tokens
  peaks in its layers at no more than the probe's prefill step of that many (measured on
  CUDA; on CPU step_memory.step_activations' estimate of it), and its scored logits come
  after them, when of a layer's live bytes only the stream it passes on is held
  (3 × hidden × weight bytes a token, checkpoint/memory.py `held`). So the room is that
  peak less the stream, less the sampled rows' peak (decode_peaks: they are sampled with
  the scored rows' logits still held), less the scoring's own temporaries (_PIECE rows at
  PIECE_BYTES a logit); rows = room / (vocab × SCORED_LOGIT_BYTES). A small vocabulary
  or wide layers so score far more rows a step than 4 a slot: the tiny test Qwen3 (64
  hidden, 512 vocab, fp32), 2,048 tokens a step, ~2.3 KB a token of a layer beyond its
  stream: ~4.7 MB, ~600 rows of 7 KB (against 32); an 8B Qwen3 in bf16 at 8,192 tokens
  ~90 KB a token: ~740 MB less 66 MB sampled and 233 MB of pieces, ~200 rows of 2.1 MB.

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
SCORED_LOGIT_BYTES = 14  # a scored logit: fp32 (4 B) and the LM head's output (≤ 10 B)
_PIECE = 128  # rows scored at once: the log-sum-exp's temporaries are [_PIECE, vocab]
PIECE_BYTES = 12  # _score's a logit of a piece: a float copy, x - lse, exp's (fp32)


def allowance(runner: object, max_slots: int) -> int:
    """Rows a step scores (module doc): ROWS_PER_SLOT × max_slots, or more where the room
    the probe left (`runner.scoring_room`, bytes) holds more rows of this vocabulary."""
    rows = ROWS_PER_SLOT * max_slots
    vocab, room = getattr(runner, "vocab_size", 0), getattr(runner, "scoring_room", 0)
    if not isinstance(vocab, int) or not isinstance(room, int) or vocab <= 0:
        return rows  # (a runner that says neither: the test's fakes)
    room -= _PIECE * vocab * PIECE_BYTES
    return max(rows, room // (vocab * SCORED_LOGIT_BYTES))


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
