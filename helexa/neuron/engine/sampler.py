"""Next-token choice for a batch: penalties, greedy or sampled, logprobs.

Per step the engine calls `Sampler()(logits[n, vocab], states)`. The order
of operations, per row:

1. penalties on the raw logits: repetition (prompt and output tokens:
   positive logits divided by it, negative multiplied, as in CTRL/HF/vLLM),
   then frequency (× count in the output) and presence (once per token seen
   in the output), subtracted as OpenAI specifies;
2. logprobs (when asked) = log_softmax of these penalised logits, before
   temperature (vLLM's default "raw" logprobs);
3. temperature 0 → argmax; else logits / temperature, then top_k, top_p
   (smallest set whose probability reaches top_p) and min_p (drop tokens
   below min_p × the top probability), then one draw.

Draws are inverse-CDF: one uniform per row against the fp64 cumulative
weights. A request with a seed draws its uniform from its own
torch.Generator, so the same seed draws the same uniforms whatever else is in
the batch (tied candidates go in token-id order, ranking.py, however the batch
truncated); the others share torch's default generator. The same tokens follow only
where the logits are the same, and in bfloat16 or float16 they can move with the
batch's row count (docs/api.md, "Seeds and the batch"). On the CPU truncation
looks at the best 1,024 tokens first and sorts the whole vocabulary only when
they do not hold top_p of the mass; on a GPU, where that check would hold the
host until the device is done, it sorts the whole vocabulary wherever a row may
need more (`reads_back`). Everything except taking the seeded uniforms is
vectorised over the batch.

The tokens and the logprobs are computed on the device and reach the host together,
after one wait (`copy_back`, `read_back`). The engine's lookahead steps (lookahead.py)
call the parts, `prepare` (grammar masks, penalties), `choose`, `logprobs` and
`copy_back`, so that nothing is read back until the step is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from helexa.kernels.backends.base import copies_done_event, to_device, to_host
from helexa.neuron.engine.grammar import apply_bitmask
from helexa.neuron.engine.messages import SamplingParams, TokenLogprob, TopToken
from helexa.neuron.engine.ranking import ranked

_GREEDY_BELOW = 1e-5  # temperatures this small are greedy (and would overflow)


@dataclass(eq=False)
class SamplingState:
    """One request's sampling parameters and history (the engine appends output ids)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # made from params.seed on first draw
    # Caches kept across steps so penalties cost O(new tokens) per step.
    _prompt_mask: torch.Tensor | None = field(default=None, repr=False)
    _counts: torch.Tensor | None = field(default=None, repr=False)
    _counted: int = 0

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_token_ids: list[int],
                    output_token_ids: list[int]) -> SamplingState:
        return cls(params, prompt_token_ids, output_token_ids)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < _GREEDY_BELOW

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1

    def seeded_generator(self, device: torch.device) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self.generator

    def output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] fp32 occurrences of each token in the output so far, and of the tokens
        counted ahead (`count_ahead`) that the output has not caught up with yet."""
        if self._counts is None or self._counts.device != device or self._counts.numel() != vocab:
            self._counts, self._counted = torch.zeros(vocab, device=device), 0
        new = [t for t in self.output_token_ids[self._counted:] if 0 <= t < vocab]
        if new:
            idx = to_device(new, torch.long, device)
            self._counts.index_add_(0, idx, torch.ones(len(new), device=device))
        self._counted = max(self._counted, len(self.output_token_ids))
        return self._counts

    def count_ahead(self, token: torch.Tensor, vocab: int) -> None:
        """Count the next output token, still on the device ([1], lookahead.py), before the
        output list holds it: it is skipped when it is appended."""
        counts = self.output_counts(vocab, token.device)
        counts.index_add_(0, token.clamp(0, vocab - 1), torch.ones(1, device=token.device))
        self._counted += 1

    def prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: tokens present in the prompt."""
        m = self._prompt_mask
        if m is None or m.device != device or m.numel() != vocab:
            m = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self.prompt_token_ids if 0 <= t < vocab]
            if ids:
                m[to_device(ids, torch.long, device)] = True
            self._prompt_mask = m
        return m


@dataclass
class Logprobs:
    """What a step's rows that want logprobs get (their positions ``rows``): the chosen
    token's logprob [m] and the best ``k`` [m, k], where the logits are until ``to_host``
    (copy_back brings them with the step's tokens)."""

    rows: list[int]
    chosen: torch.Tensor
    top_v: torch.Tensor
    top_i: torch.Tensor

    def to_host(self) -> Logprobs:
        """Copies in pinned host memory that do not wait (read them once the device is
        past the copies: a lookahead step's event, lookahead.py)."""
        return Logprobs(self.rows, to_host(self.chosen), to_host(self.top_v),
                        to_host(self.top_i))

    def entries(self, tokens: list[int], states: list[SamplingState]) -> dict[int, TokenLogprob]:
        """Each row's TokenLogprob (its own top_logprobs of the best), by position."""
        chosen, top_v, top_i = self.chosen.tolist(), self.top_v.tolist(), self.top_i.tolist()
        out = {}
        for j, i in enumerate(self.rows):
            want = states[i].params.top_logprobs
            top = [TopToken(t, lp) for t, lp in zip(top_i[j][:want], top_v[j][:want],
                                                    strict=True)]
            out[i] = TokenLogprob(tokens[i], chosen[j], top)
        return out


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, states: list[SamplingState]
             ) -> Logprobs | None:
    """The logprobs of the rows that want them (None: no row does): log_softmax of the
    logits as given (penalised, before temperature), computed where they are."""
    rows = [i for i, s in enumerate(states) if s.wants_logprobs]
    if not rows:
        return None
    sel = to_device(rows, torch.long, logits.device)
    lps = torch.log_softmax(logits[sel], dim=-1)
    chosen = lps.gather(1, tokens[sel].unsqueeze(1)).squeeze(1)
    k = min(max(states[i].params.top_logprobs for i in rows), logits.shape[1])
    top_v, top_i = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
    return Logprobs(rows, chosen, top_v, top_i)


def copy_back(tokens: torch.Tensor, lps: Logprobs | None
              ) -> tuple[torch.Tensor, Logprobs | None, Any]:
    """A step's chosen tokens and logprobs on their way to the host, none waiting for the
    others: (tokens, logprobs, ready) for ``read_back``. On a GPU, copies in pinned memory
    and an event recorded after them on the stream of the device they queued on; elsewhere
    the tensors themselves, ready None."""
    ready = copies_done_event(tokens.device)
    if ready is None:
        return tokens, lps, None
    host = to_host(tokens)
    lps = lps.to_host() if lps is not None else None
    ready.record()
    return host, lps, ready


def read_back(tokens: torch.Tensor, lps: Logprobs | None, ready: Any,
              states: list[SamplingState]) -> tuple[list[int], dict[int, TokenLogprob]]:
    """``copy_back``'s tokens as ints and each logprob row's TokenLogprob (by position),
    after one wait for the device: until ``ready`` has passed (a GPU's copies)."""
    if ready is not None:
        ready.synchronize()
    picked = tokens.tolist()
    return picked, {} if lps is None else lps.entries(picked, states)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (a NaN counts as the maximum), int64: numpy's on CPU, where
    torch's took 23 µs for one row of 8192 fp32 logits and 174 µs for eight, numpy's 3 and 9
    (the machine of bench/gguf_vs_llamacpp.py)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)


def reads_back(device: torch.device) -> bool:
    """Whether sampling may read a value back from ``device`` to decide its next op: on
    the CPU that is free, and truncate's first-candidates shortcut saves a full sort; on a
    GPU it would hold the host until the device is done (and a lookahead step with it)."""
    return device.type == "cpu"


class Sampler:
    """Picks one token per row; returns (token id, TokenLogprob or None) per row."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState], *,
                 bitmask: tuple[list[int], torch.Tensor] | None = None
                 ) -> list[tuple[int, TokenLogprob | None]]:
        """`bitmask` = (rows, int32 mask [len(rows), words]): those rows may only pick the
        tokens their grammar allows (grammar.py); applied before everything else."""
        n = logits.shape[0]
        assert n == len(states), f"{n} logit rows for {len(states)} requests"
        logits = self.prepare(logits, states, bitmask)
        tokens = self.choose(logits, states)
        lps = logprobs(logits, tokens, states)
        picked, entries = read_back(*copy_back(tokens, lps), states)  # one wait
        return [(t, entries.get(i)) for i, t in enumerate(picked)]

    def prepare(self, logits: torch.Tensor, states: list[SamplingState],
                bitmask: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """The logits tokens are chosen from: fp32, the grammar masks of ``bitmask`` (as
        ``__call__`` takes it) applied, then the penalties; in a copy wherever anything
        applies (the caller's tensor stays as the model produced it)."""
        logits = logits.float()
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask(logits, *bitmask)
        return self.penalised(logits, states, copied=bitmask is not None)

    def penalised(self, logits: torch.Tensor, states: list[SamplingState], *,
                  copied: bool = False) -> torch.Tensor:
        """The logits with the rows of requests with penalties penalised, in a copy unless
        ``copied`` (the caller's tensor stays as the model produced it)."""
        pen_rows = [i for i, s in enumerate(states) if s.has_penalties]
        if not pen_rows:
            return logits
        logits = logits if copied else logits.clone()
        rows = to_device(pen_rows, torch.long, logits.device)
        logits[rows] = self._penalise(logits[rows], [states[i] for i in pen_rows])
        return logits

    def choose(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Each row's token [n] int64 where the logits are, nothing read back: greedy rows'
        argmax, the others drawn. No penalties or grammar masks here: ``prepare`` applies
        them first (``__call__`` and the engine's lookahead steps, lookahead.sample)."""
        tokens = argmax(logits)
        sample_rows = [i for i, s in enumerate(states) if not s.greedy]
        if sample_rows:
            rows = to_device(sample_rows, torch.long, logits.device)
            tokens[rows] = self._sample(logits[rows], [states[i] for i in sample_rows])
        return tokens

    @staticmethod
    def _penalise(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[m, vocab] penalised copy of the rows of requests with penalties."""
        m, vocab = logits.shape
        dev = logits.device
        counts = torch.stack([s.output_counts(vocab, dev) for s in states])
        seen_out = counts > 0
        reps = [s.params.repetition_penalty for s in states]
        if any(r != 1 for r in reps):
            rep = to_device(reps, torch.float32, dev).unsqueeze(1)
            seen = seen_out | torch.stack([s.prompt_mask(vocab, dev) for s in states])
            scaled = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, scaled, logits)
        if any(s.params.frequency_penalty for s in states):
            freq = to_device([s.params.frequency_penalty for s in states], torch.float32, dev)
            logits = logits - freq.unsqueeze(1) * counts
        if any(s.params.presence_penalty for s in states):
            pres = to_device([s.params.presence_penalty for s in states], torch.float32, dev)
            logits = logits - pres.unsqueeze(1) * seen_out
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[m] drawn token ids for the rows that sample."""
        m, vocab = logits.shape
        dev = logits.device
        p = [s.params for s in states]
        # What the parameters decide is decided on the host, and their tensors reach the
        # device from pinned memory: nothing here waits for the device, so a lookahead step
        # (lookahead.py) samples without a read-back.
        x = logits / to_device([q.temperature for q in p], torch.float32, dev).unsqueeze(1)
        # min_p keeps tokens whose probability is ≥ min_p × the top one's: a logit
        # floor of max + log(min_p), unchanged by top_k/top_p (they keep the max).
        floor = None
        if any(q.min_p > 0 for q in p):
            min_p = to_device([min(q.min_p, 1.0) for q in p], torch.float32, dev)
            floor = x.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # log 0 = -inf: no cut
        top_k = [q.top_k if 0 < q.top_k < vocab else vocab for q in p]
        # top_p ≤ 0 still keeps the best token (the cut is "mass before ≥ top_p")
        top_p = [max(q.top_p, 1e-9) if q.top_p < 1 else 2.0 for q in p]
        u = _uniforms(states, dev)
        out = torch.empty(m, dtype=torch.long, device=dev)
        trunc = [k < vocab or tp <= 1 for k, tp in zip(top_k, top_p, strict=True)]
        plain = [i for i, t in enumerate(trunc) if not t]
        if plain:
            sel = to_device(plain, torch.long, dev)
            xp = x[sel]
            if floor is not None:
                xp = xp.masked_fill(xp < floor[sel], float("-inf"))
            out[sel] = _draw(xp, u[sel])
        rows = [i for i, t in enumerate(trunc) if t]
        if rows:
            sel = to_device(rows, torch.long, dev)
            ks = [top_k[i] for i in rows]
            cand, idx = truncate(x[sel], to_device(ks, torch.long, dev),
                                 to_device([top_p[i] for i in rows], torch.float32, dev),
                                 host_top_k=None if reads_back(dev) else ks)
            if floor is not None:
                cand = cand.masked_fill(cand < floor[sel], float("-inf"))
            out[sel] = idx.gather(1, _draw(cand, u[sel]).unsqueeze(1)).squeeze(1)
        return out


_FIRST_CANDIDATES = 1024  # top_p-only rows try this many before a full sort


def truncate(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
             host_top_k: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k then top_p over x [m, vocab]: (candidate logits [m, k], their token ids [m, k]).

    Candidates are sorted best first; cut ones are -inf. top_k is vocab where
    off, top_p > 1 where off. top_p is taken over the top_k-renormalised
    distribution, as transformers does. The first _FIRST_CANDIDATES tokens of
    a top_p-only row suffice when they already hold top_p of the mass (they
    nearly always do): a full sort of the vocab is the fallback. With ``host_top_k``
    (top_k's values, known on the host: the CUDA path) nothing is read back from the
    device: the vocab is sorted whole wherever a row may want more than those first
    tokens, as vLLM's torch path sorts it.
    """
    vocab = x.shape[1]
    need = max(host_top_k) if host_top_k is not None else int(top_k.max())
    k = min(need, _FIRST_CANDIDATES) if need < vocab else min(vocab, _FIRST_CANDIDATES)
    lse_full = None
    if host_top_k is not None and need > k:
        k = vocab
    vals, idx = ranked(x, k, on_host=reads_back(x.device))
    if k < vocab and host_top_k is None and bool((top_k > k).any()):
        lse_full = torch.logsumexp(x, dim=-1, keepdim=True)
        mass = (vals - lse_full).exp().sum(dim=-1)
        closes = (top_k <= k) | ((top_k >= vocab) & (mass >= top_p))
        if not bool(closes.all()):
            k, lse_full = vocab, None
            vals, idx = ranked(x, k, on_host=reads_back(x.device))
    ranks = torch.arange(k, device=x.device).unsqueeze(0)
    vals = vals.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(vals, dim=-1, keepdim=True)
    if lse_full is not None:  # top_p-only rows: probabilities over the whole vocab
        lse = torch.where((top_k >= vocab).unsqueeze(1), lse_full, lse)
    probs = (vals - lse).exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
    return vals.masked_fill(before >= top_p.unsqueeze(1), float("-inf")), idx


def _uniforms(states: list[SamplingState], device: torch.device) -> torch.Tensor:
    """[m] fp64 in [0, 1): seeded rows from their own generator, the rest from torch's."""
    u = torch.rand(len(states), dtype=torch.float64, device=device)
    for j, s in enumerate(states):
        g = s.seeded_generator(device)
        if g is not None:  # this row's randomness is its own
            u[j] = torch.rand(1, dtype=torch.float64, device=device, generator=g)[0]
    return u


def _draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from softmax(x) [m, n] with uniforms u [m]: column ids [m].

    fp64 cumulative sums keep the bias from rounding far below anything a test
    could see; scaling u by the total makes normalising unnecessary, and a
    token of weight 0 is never picked (its cdf step is empty).
    """
    w = (x - x.amax(dim=-1, keepdim=True)).exp().double()
    cdf = w.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
