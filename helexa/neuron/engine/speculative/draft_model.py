"""The draft-model drafter: a smaller checkpoint of the same tokenizer proposes the tokens.

`speculation = "draft:<model id>"` on a [[models]] entry loads that entry's
checkpoint in the target's engine process, on the same device in the same
weight and KV dtypes (docs/speculation.md). Its KV lives in the target's pool:
the draft runner allocates its layers over the same block ids, so the pool's
bytes per block (and helexa plan's bytes per token) are the target's plus
the draft's, and a request's block table addresses both. A reservation
therefore covers the draft's KV for every position it covers, and the
request's blocks return the draft's KV with the target's, in the same
release. The draft writes only its own layers, so the target's KV (prefix
cache included) is never touched by it.

Per step, for the requests the policy lets draft (`propose_batch`):
1. catch up: each request's tokens the draft has not seen (the prompt, the
   tokens accepted or sampled since its last draft, up to and including the
   last token) go through the draft model in one batched forward (split when
   longer than the runner's token budget), which yields its first draft;
2. chain: k − 1 more batched forwards of one token per request (a request
   leaves the batch once it has its k).

The drafts stay on the device: each forward's input tokens are the drafts the one
before chose (ModelRunner takes them as ``tokens``, as a lookahead step's), so the
passes are launched without waiting for each other, and all the drafts are read back
once, at the end (one wait for the device a proposal, not one a draft of every request).

Greedy requests draft the draft model's argmax (q one-hot: `Draft.probs`
None); sampled ones draw each draft from the draft model's distribution
under the request's own temperature / top-k / top-p / min-p and return it as
q, so the rejection rule (verify.py) keeps the target's distribution exactly.

What the draft has seen is tracked per request as (positions whose draft KV
holds the request's real tokens, the drafts written after them): at the next
proposal the drafts the target accepted extend the first, so accepted tokens
are not recomputed. Positions it wrote for rejected drafts are overwritten
before they are read (attention reads only positions below the query's).

Tensor parallelism: not supported; a draft model runs at tp = 1 only (the
config refuses it at tp > 1: the draft's KV would sit on one rank's card
while the ledger counts every card alike).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine import messages
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import Runner
from helexa.neuron.engine.seq_input import SeqInput
from helexa.neuron.engine.spec import EngineSpec
from helexa.neuron.engine.speculative.drafters import Draft, Drafter
from helexa.neuron.engine.speculative.verify import target_probs

_NO_DRAFT = Draft([])


@dataclass
class _Seen:
    req: Request  # identity: a req_id reused by a new request starts afresh
    computed: int = 0  # leading positions whose draft KV holds the request's real tokens
    pending: list[int] = field(default_factory=list)  # drafts written at computed, computed+1..


class DraftModelDrafter(Drafter):
    """Drafts with a smaller model whose KV shares each request's block table."""

    def __init__(self, model_id: str, runner: Runner,
                 ensure_blocks: Callable[[Request, int], None], *,
                 max_batched_tokens: int) -> None:
        """`ensure_blocks(req, n)`: the engine draws req's blocks (from its reservation) until
        its table covers n tokens, so the draft can write its KV there."""
        self.name = f"draft:{model_id}"
        self.runner = runner
        self.ensure_blocks = ensure_blocks
        self.max_batched_tokens = max(1, max_batched_tokens)
        self._seen: dict[str, _Seen] = {}

    def release(self, req: Request) -> None:
        """`req` ended: forget what the draft saw (its KV returns with the request's blocks)."""
        seen = self._seen.get(req.req_id)
        if seen is not None and seen.req is req:
            del self._seen[req.req_id]

    @torch.inference_mode()
    def propose_batch(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Draft]:
        self._forget_finished()
        out = [_NO_DRAFT] * len(reqs)
        todo = [(i, r, k) for i, (r, k) in enumerate(zip(reqs, ks, strict=True)) if k > 0]
        if not todo:
            return out
        qs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in todo}
        seen = {i: self._catch_up_state(r) for i, r, _ in todo}
        for _, r, k in todo:
            # the draft writes positions up to num_tokens + k - 2 (its k-th token is not fed)
            self.ensure_blocks(r, r.num_tokens + k - 1)
        # Every pass's drafts stay on the device, (request indices, tokens [rows]), each pass
        # launched without waiting for the one before; all are read back once, at the end.
        passes: list[tuple[list[int], torch.Tensor]] = []
        # 1. catch up to (and through) the last token: its logits give the first draft
        pending = {i: r.token_slice(seen[i].computed, r.num_tokens) for i, r, _ in todo}
        while pending:
            batch: list[tuple[int, int]] = []  # (request index, tokens this forward)
            room = self.max_batched_tokens
            for i, toks in pending.items():
                if room <= 0:
                    break
                n = min(len(toks), room) if batch else min(len(toks), self.max_batched_tokens)
                batch.append((i, n))
                room -= n
            seqs = []
            for i, n in batch:
                r = reqs[i]
                seqs.append(SeqInput(token_ids=pending[i][:n], num_computed=seen[i].computed,
                                     block_table=r.block_table, need_logits=n == len(pending[i])))
            logits = self.runner.run_step(seqs).logits
            done = []  # the requests this forward caught up: a logits row each, in order
            for (i, n), s in zip(batch, seqs, strict=True):
                seen[i].computed += n
                pending[i] = pending[i][n:]
                if s.need_logits:
                    done.append(i)
                    del pending[i]
            if done:
                passes.append((done, self._pick([reqs[i] for i in done], logits,
                                                [qs[i] for i in done])))
        # 2. chain: feed each draft back until a request has its k
        last = {i: t[row:row + 1] for ids, t in passes for row, i in enumerate(ids)}
        live = [(i, r) for i, r, k in todo if k > 1]
        tokens = torch.cat([last[i] for i, _ in live]) if live else None
        for step in range(1, max(k for _, _, k in todo)):
            # token_ids are placeholders: each row's input is its last draft, on the device
            seqs = [SeqInput(token_ids=[0], num_computed=r.num_tokens + step - 1,
                             block_table=r.block_table, need_logits=True) for _, r in live]
            logits = self.runner.run_step(seqs, tokens=tokens).logits
            ids = [i for i, _ in live]
            picked = self._pick([r for _, r in live], logits, [qs[i] for i in ids])
            passes.append((ids, picked))
            keep = [row for row, i in enumerate(ids) if ks[i] > step + 1]
            live = [live[row] for row in keep]  # those with their k leave the chain
            if not live:
                break
            tokens = picked if len(keep) == len(ids) else \
                picked[to_device(keep, torch.long, picked.device)]
        read = iter(torch.cat([t for _, t in passes]).tolist())  # the one wait for the device
        drafts: dict[int, list[int]] = {i: [] for i, _, _ in todo}
        for ids, _ in passes:
            for i in ids:
                drafts[i].append(next(read))
        for i, _, k in todo:
            seen[i].pending = drafts[i][:k - 1]  # the ones whose KV the draft wrote
            probs = torch.stack(qs[i]) if qs[i] else None
            out[i] = Draft(drafts[i], probs)
        return out

    def _catch_up_state(self, req: Request) -> _Seen:
        """What the draft holds of req: drafts the target accepted since count as seen."""
        seen = self._seen.get(req.req_id)
        if seen is None or seen.req is not req:
            seen = self._seen[req.req_id] = _Seen(req)
        real = req.token_slice(seen.computed, min(req.num_tokens, seen.computed + len(seen.pending)))
        a = 0
        while a < len(real) and real[a] == seen.pending[a]:
            a += 1
        # the last token is always fed again: its logits give the first draft
        seen.computed = min(seen.computed + a, req.num_tokens - 1)
        seen.pending = []
        return seen

    @staticmethod
    def _pick(reqs: Sequence[Request], logits: torch.Tensor,
              qs: Sequence[list[torch.Tensor]]) -> torch.Tensor:
        """Each request's next draft [rows], on the device, from the draft model's logits
        [rows, vocab] at its chain's end: greedy rows' argmax; sampled rows' draw from their
        q (appended to their qs), one row at a time in row order, so each seeded request's
        generator draws as it would alone, and the default generator in a fixed order."""
        picked = logits.argmax(dim=-1)
        for row, (req, q_list) in enumerate(zip(reqs, qs, strict=True)):
            st = req.sampling_state
            if st is None or st.greedy:
                continue
            q = target_probs(logits[row].float().unsqueeze(0), st)[0]
            gen = st.seeded_generator(q.device)
            picked[row:row + 1] = torch.multinomial(q, 1, generator=gen)
            q_list.append(q)
        return picked

    def _forget_finished(self) -> None:
        for rid in [rid for rid, s in self._seen.items() if s.req.is_finished]:
            del self._seen[rid]


# ----------------------------------------------------------------- loading


def tokenizer_vocab(model_dir: str | Path) -> tuple[int, dict[str, int]]:
    """(config.json vocab_size, tokenizer.json's token → id incl. added tokens) of a checkpoint."""
    d = Path(model_dir)
    raw = json.loads((d / "config.json").read_text())
    size = int({**raw, **raw.get("text_config", {})}["vocab_size"])
    tok_path = d / "tokenizer.json"
    vocab: dict[str, int] = {}
    if tok_path.exists():
        from tokenizers import Tokenizer
        vocab = Tokenizer.from_file(str(tok_path)).get_vocab(with_added_tokens=True)
    return size, vocab


def check_same_tokenizer(target_id: str, target_dir: str | Path, draft_id: str,
                         draft_dir: str | Path) -> None:
    """ValueError naming both models unless the draft's token ids mean the target's: the
    same vocab_size and the same tokenizer.json vocabulary (added tokens included)."""
    t_size, t_vocab = tokenizer_vocab(target_dir)
    d_size, d_vocab = tokenizer_vocab(draft_dir)
    why = ""
    if t_size != d_size:
        why = f"vocab_size {d_size} vs {t_size}"
    elif t_vocab != d_vocab:
        diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))
        why = (f"tokenizers differ ({len(d_vocab)} vs {len(t_vocab)} tokens, {len(diff)} "
               f"token ids disagree, e.g. {diff[0][0]!r})")
    if why:
        raise ValueError(f"speculation = \"draft:{draft_id}\": the draft model `{draft_id}` "
                         f"({draft_dir}) does not share the tokenizer of `{target_id}` "
                         f"({target_dir}): {why}; a draft model must use the target's "
                         "tokenizer")


def load_draft(spec: EngineSpec, limits: messages.Limits) -> Runner:
    """The draft model's ModelRunner (spec.draft_model_dir): weights in the target's dtype on
    the target's device, KV in the target's kv_dtype over a one-block pool until the target
    has sized its own (the engine then resets it to the target's block count). Refuses
    another tokenizer, a hybrid draft and tp > 1. CUDA graphs off: the draft's steps are
    catch-up chunks and short chains, not the fixed decode batches a graph replays."""
    from helexa.checkpoint.shape import read_model_shape
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.formats.base import open_checkpoint
    from helexa.neuron.formats.loader import resolve_dtype

    draft = spec.draft_model_id
    if spec.tp > 1:  # the config refuses it first; an engine spec built by hand too
        raise ValueError(f"speculation = \"draft:{draft}\": a draft model runs at tp = 1 only "
                         f"(docs/speculation.md), got tp = {spec.tp}")
    check_same_tokenizer(spec.model_id, spec.model_dir, draft, spec.draft_model_dir)
    if read_model_shape(Path(spec.draft_model_dir) / "config.json").linear_attention_layers:
        raise ValueError(f"speculation = \"draft:{draft}\": `{draft}` is a hybrid "
                         "(linear-attention) model; a draft model must be dense (its own state "
                         "slots and their rollback are not built for drafts)")
    dtype = resolve_dtype(open_checkpoint(spec.model_dir).config, spec.dtype)  # the target's
    return ModelRunner(Path(spec.draft_model_dir), device=spec.device,
                       dtype=str(dtype).removeprefix("torch."),
                       num_blocks=1, block_size=spec.block_size, kv_dtype=spec.kv_dtype,
                       max_num_seqs=limits.max_slots,
                       max_batched_tokens=limits.max_batched_tokens,
                       backend=spec.attention_backend, cuda_graphs=False,
                       plan_bytes_per_block=spec.draft_bytes_per_token * spec.block_size,
                       measure_pool=False)
