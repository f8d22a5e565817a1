"""What the engine needs of a model runner, and what one step of it gives back.

`Runner` is every member the engine core and its drafters use: ModelRunner
(model_runner.py) is the real one, tests/support/fake_runner.py's FakeRunner a
model-free stand-in (tests/typecheck.py holds both to it). `StepOutput` is what a
step returns: the logits the engine samples and verifies, and, for a drafter that
follows the target (the MTP head, speculative/mtp.py), the step's hidden states and
where each sequence's rows start in them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from helexa.neuron.engine import messages
    from helexa.neuron.engine.seq_input import SeqInput
    from helexa.neuron.engine.spec import EngineSpec


@dataclass
class StepOutput:
    """One step's results, in the order of the step's sequences."""

    logits: torch.Tensor  # [sum of num_logits of the seqs with need_logits, vocab] fp32
    # Each sequence's first row in the step's flat layout; its rows are consecutive
    # (decode rows are laid out first, so this is not the input order's running sum).
    row_starts: list[int]
    # [tokens, hidden] the target's final normed hidden state of every flat row, where the
    # step was asked to keep them (a drafter that follows the target); else None.
    hidden: torch.Tensor | None = None


class Runner(Protocol):
    """A model over the paged KV pool: runs steps, re-plans its pool, says what it holds.

    A runner that also has ``allocate_host(num_blocks, num_snapshots)`` and
    ``move_kv(moves)`` (ModelRunner) can back the prefix cache's host tier
    (host_tier.py); the engine runs without one where a runner has not.
    """

    vocab_size: int
    num_blocks: int  # the pool's blocks (on CUDA measured at load: the plan's is the ceiling)
    num_state_slots: int  # hybrid models: linear-attention state slots (dense: unused)
    num_snapshot_slots: int  # hybrid models: prefix snapshot slots after them (0: none)
    mtp_kv_layers: int  # pool layers set aside for an MTP head (0: none)

    @property
    def kv_bytes_per_block(self) -> int: ...

    @property
    def fixed_bytes_per_request(self) -> int:
        """Linear-attention state of one request (0 for dense models)."""
        ...

    @property
    def attention_backend(self) -> str:
        """The attention backend and what it chose, as status shows it ("" for fakes)."""
        ...

    @property
    def failed(self) -> str:
        """Why it can no longer step ("" while healthy: a tensor-parallel rank died)."""
        ...

    @property
    def has_mtp_head(self) -> bool:
        """Whether the model loaded a multi-token-prediction head (helexa/neuron/models/mtp.py)."""
        ...

    def run_step(self, seqs: list[SeqInput], *, keep_hidden: bool = False,
                 tokens: torch.Tensor | None = None) -> StepOutput:
        """One step. ``tokens`` (a lookahead step, engine/lookahead.py): every sequence is a
        decode row, and its input token is ``tokens[i]``, a tensor on the runner's device
        that the previous step's sampling wrote and nobody has read back yet; the rows'
        own ``token_ids`` are placeholders."""
        ...

    def save_held(self, saves: list[tuple[int, int, int]]) -> None:
        """Hybrid models: after a step whose verification rows' accepted positions reach a
        block boundary, each (state slot, snapshot slot, positions) snapshot of the state
        after that many of its row's positions (snapshots.take_held)."""
        ...

    def execute_mtp(self, seqs: list[SeqInput], hidden: torch.Tensor | None,
                    tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head's pass (speculative/mtp_passes.py): (logits, the head's output);
        ``tokens``: one-token rows' input tokens on the device, as execute's."""
        ...

    def mtp_logits(self, hidden: torch.Tensor | None, rows: int = 0) -> torch.Tensor: ...

    def reset_kv(self, num_blocks: int, kv_dtype: str = "auto", context: int = 0,
                 num_state_slots: int = 0, max_num_seqs: int = 0,
                 max_batched_tokens: int = 0) -> None:
        """A new pool (its contents dropped), its state slots and the decode rows and step
        tokens it is built for where given (0: as they are); the pool it had where not."""
        ...

    def close(self) -> None: ...


@dataclass
class Runners:
    """A model's runner, and its draft model's where speculation = "draft:<id>" loaded one
    (its layers share the target's pool: speculative/draft_model.py)."""

    target: Runner
    draft: Runner | None = None


def load_runners(spec: EngineSpec, limits: messages.Limits,
                 progress: Callable[[int, int], None] | None = None) -> Runners:
    """The model runner for a spec, its checkpoint on its devices, and a draft model's
    first: a CUDA target sizes its pool counting the draft's share of every block."""
    from helexa.neuron.engine.model_runner import ModelRunner  # loads the model code
    from helexa.neuron.engine.speculative.draft_model import load_draft

    draft = load_draft(spec, limits) if spec.draft_model_dir else None
    slots = spec.num_state_slots or limits.max_in_flight or 1
    target = ModelRunner(
        Path(spec.model_dir), device=spec.device, dtype=spec.dtype,
        num_blocks=spec.num_blocks, block_size=spec.block_size,
        kv_dtype=spec.kv_dtype, max_num_seqs=max(limits.max_slots, spec.max_slots_ceiling),
        max_batched_tokens=max(limits.max_batched_tokens, spec.max_batched_tokens_ceiling),
        progress=progress,
        tp_size=spec.tp, backend=spec.attention_backend, cuda_graphs=spec.cuda_graphs,
        plan_bytes_per_block=(spec.bytes_per_token - spec.draft_bytes_per_token)
        * spec.block_size,
        extra_bytes_per_block=draft.kv_bytes_per_block if draft is not None else 0,
        context=spec.context, quantize=spec.quantize,
        quant_group_size=spec.quant_group_size, mtp_kv_layers=spec.mtp_kv_layers,
        spec_k=spec.spec_k_ceiling,
        # hybrid models: a state slot per request in flight (dense: unused), and snapshots
        num_state_slots=slots,
        num_snapshot_slots=spec.snapshot_slots(slots),
        devices=list(spec.devices) if len(spec.devices) == spec.tp > 1 else None)
    return Runners(target, draft)
