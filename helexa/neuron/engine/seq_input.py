"""SeqInput: one sequence's share of an engine step, as the engine hands it to the runner,
and the checks the runner makes of it (helexa/neuron/engine/model_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def logits_count(s: SeqInput) -> int:
    if not 1 <= s.num_logits <= len(s.token_ids):
        raise ValueError(f"num_logits {s.num_logits} for a chunk of {len(s.token_ids)} tokens")
    return s.num_logits


def checked_table(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    if len(block_table) * block_size < num_tokens:
        raise ValueError(f"block table of {len(block_table)} blocks × {block_size} cannot hold "
                         f"{num_tokens} tokens")
    return block_table
