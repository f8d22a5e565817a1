"""One request's state inside the engine process: counters plus derived properties.

A request moves QUEUED → IN_FLIGHT (admitted: its whole KV reservation is
held) → RUNNING (it has a row in the batch: prefill chunks, then decode) →
one of the FINISHED_* states. A request whose client named no max_tokens
(`growable`) may grow its reservation and budget while it runs (growth.py).
The status is an ordered enum so that "is it finished?" is one comparison and
"has it been admitted?" another.

Everything else is counters: how many tokens are already in the KV cache
(`num_computed_tokens`), how many of those came from the prefix cache, the
physical blocks it holds (`block_table`), and how many blocks its reservation
covers. The token sequence the model sees is `prompt_token_ids +
output_token_ids`; the scheduler feeds `all_token_ids[num_computed_tokens:]`
in chunks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from helexa.neuron.engine import messages
from helexa.neuron.engine.block_key import BlockKey

if TYPE_CHECKING:
    from helexa.neuron.engine.images import PromptImages
    from helexa.neuron.engine.sampler import SamplingState
    from helexa.neuron.engine.speculative.drafters import Draft


class RequestStatus(enum.IntEnum):
    QUEUED = 0  # holds a place in the admission queue, nothing else
    IN_FLIGHT = 1  # admitted: holds its KV reservation, waits for a batch row
    RUNNING = 2  # holds a batch row: prefilling or decoding
    # Everything from here on is finished; the order among them carries no meaning.
    FINISHED_STOPPED = 3  # eos or a stop token
    FINISHED_LENGTH = 4  # output budget or context reached
    FINISHED_ABORTED = 5  # caller gone, deadline, drain, shutdown
    FINISHED_ERROR = 6  # the engine failed while running it
    FINISHED_REFUSED = 7  # never admitted: queue full, rate limit, KV wait, draining

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> messages.FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: messages.FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: messages.FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: messages.FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: messages.FinishReason.ERROR,
}


@dataclass(eq=False)
class Request:
    """A request as the engine tracks it (identity equality: one object per req_id)."""

    req_id: str
    prompt_token_ids: list[int]
    output_budget: int  # most new tokens it may produce (its reservation covers them)
    growable: bool = False  # its client named no max_tokens: the budget may grow (growth.py)
    ceiling: int | None = None  # its max_tokens a ceiling fitted to the context (intake.refit)
    sampling: messages.SamplingParams = field(default_factory=messages.SamplingParams)
    principal: str = ""  # "" = anonymous
    stop_token_ids: frozenset[int] = frozenset()
    deadline_unix: float = 0.0  # 0 = none
    queued_at: float = 0.0  # monotonic time it entered the queue
    held_secs: float = 0.0  # of its time queued, held by a profile switch (admission.hold)
    seq: int = 0  # admission order (1, 2, ...): its seniority for a batch row (intake.reclaim)
    had_row: bool = False  # it has had a batch row: waiting, it waits for one again

    status: RequestStatus = RequestStatus.QUEUED
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    num_host_tokens: int = 0  # ... of which restored from its host tier
    block_table: list[int] = field(default_factory=list)
    num_reserved_blocks: int = 0  # the whole reservation, set at admission (and growth)
    block_hashes: list[BlockKey] = field(default_factory=list)  # chain keys of its full blocks
    cache_salt: bytes = b""  # its first block's parent (prefix_filing.cache_salt)
    num_filed_blocks: int = 0  # leading blocks already offered to the prefix index
    # Hybrid models' prefix snapshots (snapshots.py): (slot, position) this step copies out,
    # and its latest end-of-generation snapshot (slot, the key it is filed under).
    snapshot_writes: list[tuple[int, int]] = field(default_factory=list)
    gen_snapshot: tuple[int, BlockKey] | None = None
    sampling_state: SamplingState | None = None  # the sampler's per-request state
    matcher: Any = None  # its grammar's llguidance matcher (constrained decoding), or None
    compiling: Any = None  # the Future of its matcher while its grammar compiles (grammar.py)
    thought: Any = None  # its thinking.ThoughtTracker when the model thinks, or None
    # Speculation (engine/speculative/): this step's draft, and how well drafts fare.
    draft: Draft | None = None
    spec_acceptance: float | None = None  # EWMA of accepted / drafted; None before any
    spec_drafted_tokens: int = 0  # drafted tokens verified for it, and of those accepted
    spec_accepted_tokens: int = 0
    images: PromptImages | None = None  # a vision-language prompt's images (images.py)
    # its images' towers run over several steps (encoder_steps.py): the images encoded so
    # far, in prompt order, and the blocks run of the next (its runner state part-way)
    encoded_images: int = 0
    encoded_blocks: int = 0

    # --- derived -----------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV cache: a prompt remainder, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def is_admitted(self) -> bool:
        """Holds (or held) a reservation: in flight, running, or finished after that."""
        return self.status >= RequestStatus.IN_FLIGHT and self.status != RequestStatus.FINISHED_REFUSED

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the whole output budget: what the reservation covers."""
        return self.num_prompt_tokens + self.output_budget

    def count_into(self, upd: messages.RequestUpdate) -> None:
        """Its usage so far on its update: drafted tokens verified, and of those accepted."""
        upd.spec_drafted_tokens = self.spec_drafted_tokens
        upd.spec_accepted_tokens = self.spec_accepted_tokens

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def hash_slice(self, start: int, end: int) -> list[int]:
        """token_slice as the prefix cache keys it: image tokens stand for their image."""
        if self.images is None or start >= self.images.spans[-1].image.end:
            return self.token_slice(start, end)
        return self.images.hash_ids(self.prompt_token_ids, start, end) + \
            self.output_token_ids[max(0, start - self.num_prompt_tokens):
                                  max(0, end - self.num_prompt_tokens)]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids()[start:end] without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

