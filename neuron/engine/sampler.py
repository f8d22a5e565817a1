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

Draws use the exponential race (argmax p / E with E ~ Exp(1), equivalent
to a categorical draw). A request with a seed draws its E from its own
torch.Generator, so the same seed gives the same tokens whatever else is in
the batch; the others share torch's default generator. Everything except
the seeded draws is vectorised over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from helexa.neuron.engine.messages import SamplingParams, TokenLogprob, TopToken

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
        """[vocab] fp32 occurrences of each token in the output so far."""
        if self._counts is None or self._counts.device != device or self._counts.numel() != vocab:
            self._counts, self._counted = torch.zeros(vocab, device=device), 0
        new = [t for t in self.output_token_ids[self._counted:] if 0 <= t < vocab]
        if new:
            idx = torch.tensor(new, device=device, dtype=torch.long)
            self._counts.index_add_(0, idx, torch.ones(len(new), device=device))
        self._counted = len(self.output_token_ids)
        return self._counts

    def prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: tokens present in the prompt."""
        m = self._prompt_mask
        if m is None or m.device != device or m.numel() != vocab:
            m = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = [t for t in self.prompt_token_ids if 0 <= t < vocab]
            if ids:
                m[torch.tensor(ids, device=device, dtype=torch.long)] = True
            self._prompt_mask = m
        return m


class Sampler:
    """Picks one token per row; returns (token id, TokenLogprob or None) per row."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]
                 ) -> list[tuple[int, TokenLogprob | None]]:
        n, vocab = logits.shape
        assert n == len(states), f"{n} logit rows for {len(states)} requests"
        logits = logits.float()
        pen_rows = [i for i, s in enumerate(states) if s.has_penalties]
        if pen_rows:
            logits = logits.clone()  # the caller's tensor stays as the model produced it
            logits[pen_rows] = self._penalise(logits[pen_rows], [states[i] for i in pen_rows])

        tokens = logits.argmax(dim=-1)
        sample_rows = [i for i, s in enumerate(states) if not s.greedy]
        if sample_rows:
            tokens[sample_rows] = self._sample(logits[sample_rows], [states[i] for i in sample_rows])
        token_list = tokens.tolist()

        out: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in token_list]
        lp_rows = [i for i, s in enumerate(states) if s.wants_logprobs]
        if lp_rows:
            lps = torch.log_softmax(logits[lp_rows], dim=-1)
            chosen = lps.gather(1, tokens[lp_rows].unsqueeze(1)).squeeze(1).tolist()
            k = min(max(states[i].params.top_logprobs for i in lp_rows), vocab)
            top_v, top_i = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp_rows):
                want = states[i].params.top_logprobs
                top = [TopToken(tid, lp) for tid, lp in zip(top_i[j][:want], top_v[j][:want],
                                                            strict=True)]
                out[i] = (token_list[i], TokenLogprob(token_list[i], chosen[j], top))
        return out

    @staticmethod
    def _penalise(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[m, vocab] penalised copy of the rows of requests with penalties."""
        m, vocab = logits.shape
        dev = logits.device
        counts = torch.stack([s.output_counts(vocab, dev) for s in states])
        seen_out = counts > 0
        rep = torch.tensor([s.params.repetition_penalty for s in states], device=dev).unsqueeze(1)
        if (rep != 1).any():
            seen = seen_out | torch.stack([s.prompt_mask(vocab, dev) for s in states])
            scaled = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, scaled, logits)
        freq = torch.tensor([s.params.frequency_penalty for s in states], device=dev).unsqueeze(1)
        pres = torch.tensor([s.params.presence_penalty for s in states], device=dev).unsqueeze(1)
        return logits - freq * counts - pres * seen_out.float()

    @staticmethod
    def _sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[m] drawn token ids for the rows that sample."""
        m, vocab = logits.shape
        dev = logits.device
        p = [s.params for s in states]
        x = logits / torch.tensor([q.temperature for q in p], device=dev).unsqueeze(1)
        top_k = torch.tensor([q.top_k if 0 < q.top_k < vocab else vocab for q in p], device=dev)
        top_p = torch.tensor([q.top_p if q.top_p < 1 else 2.0 for q in p], device=dev)
        if (top_k < vocab).any() or (top_p <= 1).any():
            sorted_x, order = x.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            sorted_x = sorted_x.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
            probs = sorted_x.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
            sorted_x = sorted_x.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
        min_p = torch.tensor([q.min_p for q in p], device=dev)
        if (min_p > 0).any():
            probs = x.softmax(dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            x = x.masked_fill(probs < floor, float("-inf"))
        probs = x.softmax(dim=-1)

        race = torch.empty_like(probs)
        race.exponential_()
        for j, s in enumerate(states):
            g = s.seeded_generator(dev)
            if g is not None:  # this row's randomness is its own
                race[j].exponential_(generator=g)
        return (probs / race.clamp_min(torch.finfo(race.dtype).tiny)).argmax(dim=-1)
