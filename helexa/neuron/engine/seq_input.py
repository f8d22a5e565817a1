"""SeqInput: one sequence's share of an engine step, as the engine hands it to the runner,
the checks the runner makes of it, and the step laid out flat (helexa/neuron/engine/
model_runner.py copies that to the device)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helexa.kernels.backends.base import PrefillRow, StepPlan, token_slots
from helexa.neuron.engine.images import ImageSpan


@dataclass
class SeqInput:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens to process this step (prefill chunk, or 1 for decode)
    num_computed: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # physical block ids covering num_computed + len(token_ids)
    need_logits: bool  # produce next-token logits (last chunk of prefill, or decode)
    state_slot: int = -1  # hybrid models: the request's linear-attention state slot
    # Logits rows for the last this-many tokens of the chunk (need_logits only): a
    # speculative verification row [last token, k drafts] asks for k + 1.
    num_logits: int = 1
    # Hybrid models' prefix snapshots (absolute state slots, -1: none): the state starts from
    # this snapshot (a prefix-cache hit's first chunk), or is copied to it after the step.
    restore_from: int = -1
    save_to: int = -1
    # Vision-language prompts (engine/images.py): the M-RoPE shift of the chunk's leading
    # text (and of every decode token), and the images the chunk's tokens touch.
    rope_delta: int = 0
    images: list[ImageSpan] = field(default_factory=list)
    # A prefill chunk whose every row wants logits (need_logits; num_logits not read): a
    # request's prompt logprobs (engine/prompt_logprobs.py). Not a verification row.
    all_logits: bool = False


def logits_count(s: SeqInput) -> int:
    if s.all_logits:
        return len(s.token_ids)
    if not 1 <= s.num_logits <= len(s.token_ids):
        raise ValueError(f"num_logits {s.num_logits} for a chunk of {len(s.token_ids)} tokens")
    return s.num_logits


def checked_table(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    if len(block_table) * block_size < num_tokens:
        raise ValueError(f"block table of {len(block_table)} blocks × {block_size} cannot hold "
                         f"{num_tokens} tokens")
    return block_table


@dataclass
class StepLayout:
    """A step laid out flat, decode rows first: each token's id, position and write slot,
    the flat rows that want logits, each sequence's first flat row, and the StepPlan the
    attention backend plans from (its slot_mapping filled on the device)."""

    step: StepPlan
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    seq_starts: list[int] = field(default_factory=list)


def lay_out(seqs: list[SeqInput], block_size: int, num_blocks: int) -> StepLayout:
    """``seqs`` as one flat step of a pool of ``num_blocks`` blocks: one-token rows (decode)
    first, then each longer chunk's tokens in order (a prefill, or a verification row: its
    last token and drafts, ``num_logits`` of them wanting logits); ValueError naming a
    sequence with no tokens, a table too short for its tokens or bad num_logits."""
    bs = block_size
    decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    lay = StepLayout(StepPlan(slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs,
                              num_blocks=num_blocks))
    step = lay.step
    lay.ids = [seqs[i].token_ids[0] for i in decode]
    lay.positions = [seqs[i].num_computed for i in decode]
    for i in decode:
        s = seqs[i]
        table = checked_table(s.block_table, s.num_computed + 1, bs)
        lay.slots.append(table[s.num_computed // bs] * bs + s.num_computed % bs)
        step.decode_positions.append(s.num_computed)
        step.decode_tables.append(s.block_table)
        step.decode_state_slots.append(s.state_slot)
    last_row = {i: r for r, i in enumerate(decode)}  # seq index -> flat row of its last token
    for i, s in enumerate(seqs):
        n, c = len(s.token_ids), s.num_computed
        if n == 1:
            continue
        if n == 0:
            raise ValueError("SeqInput with no tokens")
        table = checked_table(s.block_table, c + n, bs)
        start = len(lay.ids)
        lay.ids.extend(s.token_ids)
        lay.positions.extend(range(c, c + n))
        lay.slots.extend(token_slots(table, c, c + n, bs))
        step.prefills.append(PrefillRow(start, start + n, c, table, s.state_slot,
                                        verify=s.need_logits and s.num_logits > 1
                                        and not s.all_logits))
        last_row[i] = start + n - 1
    step.state_restores = [(s.restore_from, s.state_slot) for s in seqs if s.restore_from >= 0]
    step.state_saves = [(s.state_slot, s.save_to) for s in seqs if s.save_to >= 0]
    # each seq's first flat row (its rows are consecutive; decode rows were laid out first)
    lay.seq_starts = [last_row[i] - len(s.token_ids) + 1 for i, s in enumerate(seqs)]
    lay.want = [r for i, s in enumerate(seqs) if s.need_logits
                for r in range(last_row[i] - logits_count(s) + 1, last_row[i] + 1)]
    return lay
