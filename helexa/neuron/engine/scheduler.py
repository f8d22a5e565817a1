"""The step scheduler: which tokens of which requests go into the next engine step.

Plain data in (the running requests in batch order, the in-flight requests
waiting for a batch row in admission order, three limits), a plain StepPlan
out; it touches no tensors and no pool, and mutates nothing.

The algorithm, under a token budget of `max_batched_tokens` per step:

0. Vision models: the step's tower work, within `vision_budget` (encoder_steps.py): the
   next blocks of each prefilling request's next image not yet encoded (the one
   part-way first), whose tokens no chunk reaches before the image's last block ran.
1. Decode first: every running request whose prompt is fully in the cache
   gets its one next token, in batch order, while budget lasts.
2. Then the requests resumed after a pause (intake.py `pause`: a paused
   request is in neither list, so it holds no row and takes no budget), in
   admission order while rows are free: promoted with their next decode
   token. They decode as they did before their pause, so a prefill never
   holds them back either.
3. Then drafted tokens (`Request.draft`, speculative/): a running request's
   whole draft where the budget left after every decode token of steps 1
   and 2 has room for it, else none. Running decodes are never stalled by
   prefill, nor by another request's drafts.
4. Then prefill chunks of running requests that are still prefilling (in
   batch order), each at most `prefill_chunk_tokens` and what budget is left.
5. Then, while fewer than `max_slots` requests are running and budget is
   left, promote waiting in-flight requests (admission order: resumed ones
   wait ahead of new prompts) to running and give each its first prefill
   chunk (or, a prompt that starts with an image, that image's first blocks alone).

Before a step is scheduled, `reclaims` names the running requests whose rows
go back to requests that had a row before them (intake.py `reclaim`): a
resumed request, with every row taken, takes one from the decoding request
admitted last, where that one was admitted after it, and only where the budget
holds a decode token for every request that then decodes (step 2 promotes it
in the same step: a row taken back is never left empty). Rows so go to the
requests admitted first among those whose callers read, as vLLM's FCFS
policy preempts the request that arrived last; a pause only lends its row.
Since the order is fixed at admission, a request never takes back a row
that was taken back from it. A request still prefilling keeps its row (its prefill
clock runs at the router: helexa/router/inflight.py).

A prompt longer than the chunk limit is therefore prefilled over several
steps, interleaved with everyone else's decode tokens. A hybrid model with
the prefix cache on (`snapshot_block_tokens` set) also ends a chunk where its
request keeps a prefix snapshot (snapshots.py next_stop). The chunks of
requests asking for their prompt's logprobs, whose every row's logits are
computed, hold at most `scoring_rows` tokens in a step together (the engine
sets it from the model's memory: prompt_logprobs.py `allowance` says why),
shared equally between the requests that score in the step (the running ones
still prefilling and the new prompts a free row would promote), a share one
needs less of going to the others (prompt_logprobs.shares): a short prompt
admitted behind a long one is so not held until the long one is done. One
whose share is none waits for the next step, and a new prompt so held back
keeps the requests admitted after it waiting too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from helexa.neuron.engine.encoder_steps import EncoderBudget, EncodeSlice
from helexa.neuron.engine.prompt_logprobs import ROWS_PER_SLOT, shares, wants
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.snapshots import next_stop


@dataclass(frozen=True)
class ScheduledChunk:
    req_id: str
    num_tokens: int  # tokens to compute this step
    is_prefill: bool  # part of the prompt (else one decode token)
    num_draft: int = 0  # decode rows: drafted tokens verified after the decode token


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    promoted: list[str] = field(default_factory=list)  # in flight -> running this step
    encode: list[EncodeSlice] = field(default_factory=list)  # tower work (encoder_steps.py)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def decode_ids(self) -> list[str]:
        return [c.req_id for c in self.chunks if not c.is_prefill]

    @property
    def prefill(self) -> list[tuple[str, int]]:
        return [(c.req_id, c.num_tokens) for c in self.chunks if c.is_prefill]

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.encode


@dataclass
class Scheduler:
    max_slots: int
    max_batched_tokens: int
    prefill_chunk_tokens: int
    snapshot_block_tokens: int = 0  # hybrids' prefix snapshots: the block size (0: none)
    snapshot_every_tokens: int = 0  # and their checkpoint spacing inside a prompt
    scoring_rows: int = 0  # prompt-logprobs rows a step (0: ROWS_PER_SLOT × max_slots)
    vision_budget: int = 0  # tower work a step, patches × blocks (0: images whole)
    vision_depth: int = 0  # the tower's blocks where steps may split it (encoder_steps.py)

    def schedule(self, running: Sequence[Request], waiting: Sequence[Request]) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batched_tokens
        decoding = [r for r in running if _decodes(r)]
        for req in decoding[:budget]:  # 1. decode
            plan.chunks.append(ScheduledChunk(req.req_id, 1, is_prefill=False))
        budget -= len(plan.chunks)
        num_running = len(running)
        for req in [r for r in waiting if _decodes(r)]:  # 2. resumed: promoted, decoding
            if budget == 0 or num_running >= self.max_slots:
                break
            plan.chunks.append(ScheduledChunk(req.req_id, 1, is_prefill=False))
            plan.promoted.append(req.req_id)
            budget -= 1
            num_running += 1
        for i, req in enumerate(decoding[:len(plan.chunks)]):  # 3. drafts, whole or none
            k = len(req.draft.tokens) if req.draft is not None else 0
            if 0 < k <= budget:
                plan.chunks[i] = ScheduledChunk(req.req_id, 1 + k, is_prefill=False,
                                                num_draft=k)
                budget -= k
        share = self._shares(running, waiting, budget, num_running)  # module doc
        enc = EncoderBudget(self.vision_budget, self.vision_depth)  # 0. tower work
        for req in enc.first_partway([r for r in running if r.is_prefilling]):
            enc.take(req)
        spare = 0  # shares a request took less of (the budget ran short): the next one's
        for req in running:  # 4. prefill already running
            if budget == 0:
                break
            if req.is_prefilling:
                n = self._chunk(req, budget, share.get(req.req_id, 0) + spare, enc)
                if n == 0:
                    continue  # its prompt's logprobs: none left this step
                plan.chunks.append(ScheduledChunk(req.req_id, n, is_prefill=True))
                budget -= n
                if wants(req):
                    spare += share.get(req.req_id, 0) - n
        for req in waiting:  # 5. promote new prompts
            if budget == 0 or num_running >= self.max_slots:
                break
            if not req.is_prefilling:
                continue  # resumed (step 2), or nothing to compute
            encodes = enc.take(req)
            n = self._chunk(req, budget, share.get(req.req_id, 0) + spare, enc)
            if n == 0 and encodes:  # its image's first blocks, no token yet: a row for them
                plan.promoted.append(req.req_id)
                num_running += 1
                continue
            if n == 0:
                break  # its prompt's logprobs or image: none this step, and no one overtakes
            if wants(req):
                spare += share.get(req.req_id, 0) - n
            plan.chunks.append(ScheduledChunk(req.req_id, n, is_prefill=True))
            plan.promoted.append(req.req_id)
            budget -= n
            num_running += 1
        plan.encode = enc.slices
        return plan

    def reclaims(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[Request]:
        """Running requests that give their rows back this step: the resumed requests that
        had a row (at the front of `waiting`, in admission order) beyond the free
        rows each take one from the decoding request admitted last, where it was admitted
        after them. None where the budget cannot give each decoding request and each
        resumed one given a row its token (`schedule`, steps 1 and 2): a row taken back
        would stay empty, its owner no longer decoding and its claimant not yet."""
        free = max(0, self.max_slots - len(running))
        decoding = [r for r in running if _decodes(r)]
        if self.max_batched_tokens - len(decoding) < free:
            return []  # not even the free rows get a decode token this step
        claimants = [r for r in waiting if r.had_row and _decodes(r)][free:]
        if not claimants:
            return []
        latest = sorted(decoding, key=lambda r: -r.seq)
        out: list[Request] = []
        for claimant, holder in zip(claimants, latest, strict=False):
            if holder.seq < claimant.seq:
                break  # those after are admitted earlier still, the claimants later
            out.append(holder)
        return out

    def _shares(self, running: Sequence[Request], waiting: Sequence[Request], budget: int,
                num_running: int) -> dict[str, int]:
        """Each request scoring its prompt this step (running and prefilling; or waiting,
        new, within the free rows): its share of the step's scoring rows."""
        if not any(wants(r) for r in (*running, *waiting)):
            return {}
        taking = [r for r in running if r.is_prefilling]
        taking += [r for r in waiting if r.is_prefilling][:max(0, self.max_slots - num_running)]
        scorers = [r for r in taking if wants(r)]
        need = [self._chunk(r, budget, budget) for r in scorers]
        rows = self.scoring_rows or ROWS_PER_SLOT * self.max_slots
        return {r.req_id: n for r, n in zip(scorers, shares(need, rows), strict=True)}

    def _chunk(self, req: Request, budget: int, scoring: int,
               enc: EncoderBudget | None = None) -> int:
        # Prefill covers the prompt only; the first output token comes from
        # the logits of the chunk that ends the prompt; never an image not yet encoded.
        computed = req.num_computed_tokens
        ready = enc.ready(req) if enc is not None else req.num_prompt_tokens
        n = min(ready - computed, self.prefill_chunk_tokens, budget)
        if wants(req):  # every row's logits: within the step's share (prompt_logprobs.py)
            n = min(n, scoring)
        if self.snapshot_block_tokens:
            stop = next_stop(computed, req.num_prompt_tokens, self.snapshot_block_tokens,
                             self.snapshot_every_tokens)
            if stop:
                n = min(n, stop - computed)
        return n


def _decodes(req: Request) -> bool:
    """Its prompt is in the cache and it has a token to compute: it decodes (a resumed
    request waiting always has; one running only between its steps' tokens never is)."""
    return not req.is_prefilling and req.num_uncomputed_tokens > 0
