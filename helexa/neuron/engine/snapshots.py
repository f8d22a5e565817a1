"""Where a hybrid model's requests keep prefix snapshots, and what becomes of them: the
policy beside snapshot_pool.py's mechanism.

A prefix-cache hit on a hybrid model must land where a snapshot of the linear-attention
state is filed (admission.py), so snapshots are taken where an agent's next turn will hit:

- inside a prompt, at every `every_tokens` (a multiple of the block size) and at the last
  two full block boundaries of the prompt: the next turn repeats this prompt and appends to
  it, but a chat template may render the generation prompt that ends it (`<think>` and the
  like) otherwise in the history, so the one before the last block survives that;
  the scheduler ends prefill chunks there (`next_stop`), since a state exists only at the
  end of a step's row;
- while generating, at each block boundary a decode row reaches, keeping only the
  request's latest (the end of generation: the next turn repeats the reply too).

A speculative verification row leaves its slot as it was before the row (its positions are
settled only at the next step, helexa/kernels/linear_state.py) and holds its inputs. Once the
engine has judged its drafts (take_held, after the step's tokens are picked), where the
accepted positions reach a block boundary inside the row (the furthest, where they cross
two), a snapshot slot is taken and the runner computes the state after the row's positions
before the boundary from what the slot holds (LinearState.save_held): a snapshot only ever holds accepted positions, a row whose
drafts fall short takes no slot (taking one may evict a cached snapshot), and a request that
drafts every step is snapshotted at the same boundaries as one that does not. Each snapshot
is filed, after its step, under the chain key of the block that ends at its position
(prefix_filing.py files those blocks first); a request restoring one copies it in its first
step, then unpins it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports next_stop: no cycle, and no torch here
    from helexa.neuron.engine.block_pool import BlockPool
    from helexa.neuron.engine.request import Request
    from helexa.neuron.engine.scheduler import ScheduledChunk
    from helexa.neuron.engine.seq_input import SeqInput
    from helexa.neuron.engine.step_inputs import StepInputs


def next_stop(computed: int, prompt_tokens: int, block_size: int, every_tokens: int) -> int:
    """The next prompt position after `computed` that keeps a snapshot (0: none)."""
    last = prompt_tokens // block_size * block_size
    stops = [last, last - block_size]
    if every_tokens:
        stops.append((computed // every_tokens + 1) * every_tokens)
    return min((s for s in stops if computed < s <= last), default=0)


def take_slots(pool: BlockPool, reqs: list[Request], chunks: list[ScheduledChunk],
               seqs: list[SeqInput], every_tokens: int,
               later: list[tuple[Request, int, int]] | None = None) -> None:
    """Set each sequence's restore (a hit's first step) and save (a snapshot position it
    reaches), taking a snapshot slot for each save; a save with no slot free is skipped.
    Each save joins its request's snapshot_writes, for file_saves after the step; with
    ``later`` it goes there as (request, slot, position) instead, for the caller to add
    when the step is read (a lookahead step, launched before the step before it is read:
    lookahead.py)."""
    snaps, bs = pool.snapshots, pool.block_size
    if snaps is None:
        return
    for req, chunk, seq in zip(reqs, chunks, seqs, strict=True):
        seq.restore_from = snaps.restoring(req.req_id)
        if chunk.num_draft:  # a verification row: once its drafts are judged (take_held)
            continue
        end = seq.num_computed + chunk.num_tokens
        if chunk.is_prefill:
            wanted = next_stop(seq.num_computed, req.num_prompt_tokens, bs, every_tokens) == end
        else:
            wanted = end % bs == 0
        if wanted:
            slot = snaps.take(req.req_id)
            if slot >= 0:
                seq.save_to = slot
                if later is None:
                    req.snapshot_writes.append((slot, end))
                else:
                    later.append((req, slot, end))


def take_held(pool: BlockPool, inputs: StepInputs, kept: list[int]
              ) -> list[tuple[int, int, int]]:
    """After a step's tokens are picked: for each verification row whose kept positions
    (``kept``, StepInputs.kept's) reach a block boundary inside the row, a snapshot slot at
    the furthest such boundary, joined to its request's snapshot_writes; returns (state
    slot, snapshot slot, positions) for the runner's save_held. The slot is taken only once
    the drafts are judged, since taking one may evict a cached snapshot: a row whose drafts
    fall short of its boundary evicts nothing. A row of more positions than a block
    (spec_k + 1 > block size) may cross two boundaries: a request keeps only its latest
    generation snapshot (file_saves), so the earlier one, filed, would be superseded at
    once, its slot perhaps taken from a cached snapshot; plain decoding too leaves only
    the later."""
    snaps, bs = pool.snapshots, pool.block_size
    saves: list[tuple[int, int, int]] = []
    if snaps is None:
        return saves
    for req, chunk, seq, n in zip(inputs.reqs, inputs.chunks, inputs.seqs, kept, strict=True):
        start = seq.num_computed
        end = (start + n) // bs * bs  # the furthest boundary the kept positions reach
        if not chunk.num_draft or end <= start:
            continue
        slot = snaps.take(req.req_id)
        if slot >= 0:
            req.snapshot_writes.append((slot, end))
            saves.append((seq.state_slot, slot, end - start))
    return saves


def file_saves(pool: BlockPool, req: Request) -> None:
    """After the step (its full blocks filed): file what req's sequence saved (every write
    is at a position the step kept: take_held's are taken after the drafts are judged),
    supersede its older end-of-generation snapshot, and unpin what it restored."""
    snaps, bs = pool.snapshots, pool.block_size
    if snaps is None:
        return
    snaps.unpin(req.req_id)
    for slot, end in req.snapshot_writes:
        key = req.block_hashes[end // bs - 1]
        if snaps.file(req.req_id, slot, key) and end > req.num_prompt_tokens:
            if req.gen_snapshot is not None:
                snaps.discard(*req.gen_snapshot)
            req.gen_snapshot = (slot, key)
    req.snapshot_writes = []
