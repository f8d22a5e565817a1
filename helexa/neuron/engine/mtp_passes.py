"""The MTP head's passes between engine steps (helexa/neuron/models/mtp.py), as the model
runner runs them: over the head's own layer of the pool, under each sequence's block
table, on every tensor-parallel rank. At tp > 1 rank 0 sends the pass's sequences down
the rank pipes (tp_worker.py: TpMtp, TpMtpLogits) and broadcasts the rows' hidden
states over the group; the other ranks replay the pass with None for them. The
drafter that drives these passes: helexa/neuron/engine/speculative/mtp.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from helexa.kernels.backends import Device
    from helexa.kernels.backends.base import StepPlan
    from helexa.neuron.engine.model_runner import SeqInput
    from helexa.neuron.engine.tp_worker import TpWorkers
    from helexa.neuron.models.config import ModelConfig


class MtpPasses:
    """ModelRunner's MTP head passes (it provides the attributes below)."""

    model: Any
    backend: Device
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tp_rank: int
    tp_size: int
    seq_starts: list[int]
    _tp: TpWorkers | None

    # the step's flat layout (decode rows first): ids, positions, plan, logits rows
    _prepare: Callable[[list[SeqInput]],
                       tuple[torch.Tensor, torch.Tensor, StepPlan, torch.Tensor | None]]

    @torch.inference_mode()
    def execute_mtp(self, seqs: list[SeqInput], hidden: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model's MTP head (helexa/neuron/models/mtp.py) over `seqs`: each row's token is
        the one after its position, `hidden` [rows, H] (seqs' rows in order) the target's
        at that position. K/V go to the head's layer of the pool under each block table.
        Returns (fp32 logits of the rows that seqs ask for, the head's output [rows, H] in
        seqs' row order). At tensor parallel > 1 every rank runs the pass (tp_worker.py):
        rank 0 sends the sequences and broadcasts `hidden`; the other ranks pass None and
        get back their own logits slice."""
        input_ids, positions, step, logits_rows = self._prepare(seqs)
        flat = torch.tensor([r for st, s in zip(self.seq_starts, seqs, strict=True)
                             for r in range(st, st + len(s.token_ids))], device=self.device)
        if hidden is not None and hidden.shape[0] != len(flat):
            raise ValueError(f"{hidden.shape[0]} hidden rows for {len(flat)} tokens")
        if self._tp is not None:
            self._tp.send_mtp(seqs)
        try:
            hidden = self._shared_rows(hidden, len(flat))
            x = torch.empty_like(hidden)
            x[flat] = hidden  # to the step's flat layout
            meta = self.backend.attention.plan_side(step)
            logits, y = self.model.mtp_forward(input_ids, positions, x, meta, logits_rows)
        except RuntimeError as e:
            if self._tp is not None:  # a collective failed: a rank died or wedged
                self._tp.fail_step(e)
            raise
        return logits, y.index_select(0, flat)

    @torch.inference_mode()
    def mtp_logits(self, hidden: torch.Tensor | None, rows: int = 0) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the MTP head's outputs `hidden` [rows, H]
        (execute_mtp's second result): the shared lm_head, on every rank at tensor
        parallel > 1 (the other ranks pass None and the row count)."""
        if hidden is not None:
            rows = hidden.shape[0]
            if self._tp is not None:
                self._tp.send_mtp_logits(rows)
        try:
            logits: torch.Tensor = self.model.lm_head(self._shared_rows(hidden, rows)).float()
        except RuntimeError as e:
            if self._tp is not None:
                self._tp.fail_step(e)
            raise
        return logits

    def _shared_rows(self, hidden: torch.Tensor | None, rows: int) -> torch.Tensor:
        """Rank 0's `hidden` [rows, H] on every rank (a broadcast over the group at tensor
        parallel > 1; the other ranks pass None)."""
        if self.tp_size == 1:
            assert hidden is not None
            return hidden
        import torch.distributed as dist

        if self.tp_rank == 0:
            assert hidden is not None
            hidden = hidden.to(self.dtype).contiguous()
        else:
            hidden = torch.empty(rows, self.config.hidden_size, dtype=self.dtype,
                                 device=self.device)
        dist.broadcast(hidden, src=0)
        return hidden
