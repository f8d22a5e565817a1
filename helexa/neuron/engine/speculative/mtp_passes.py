"""The MTP head's passes between engine steps (helexa/neuron/models/mtp.py), over the head's
own layer of the pool, under each sequence's block table, on every tensor-parallel rank.

ModelRunner.execute_mtp / mtp_logits run them (the rank loop of tp_worker.py calls
the same two on ranks 1..tp-1); they lay a pass out as the runner lays out a step
(its `_prepare`) and drive its rank pipes (its `_tp`). At tp > 1 rank 0 sends the pass's sequences down the
rank pipes (tp_messages.py: TpMtp, TpMtpLogits) and broadcasts the rows' hidden states
over the group; the other ranks replay the pass with None for them. The drafter that
drives these passes: mtp.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from helexa.kernels.backends.base import to_device

if TYPE_CHECKING:
    from helexa.neuron.engine.model_runner import ModelRunner, SeqInput


@torch.inference_mode()
def execute_mtp(runner: ModelRunner, seqs: list[SeqInput], hidden: torch.Tensor | None,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model's MTP head over `seqs`: each row's token is the one after its
    position, `hidden` [rows, H] (seqs' rows in order) the target's at that position.
    K/V go to the head's layer of the pool under each block table. Returns (fp32 logits
    of the rows that seqs ask for, the head's output [rows, H] in seqs' row order). At
    tensor parallel > 1 every rank runs the pass: rank 0 sends the sequences and
    broadcasts `hidden`; the other ranks pass None and get back their own logits slice.
    ``tokens``: one-token rows' input tokens on the device (the drafter's previous pass's
    argmax, never read back), rank 0's broadcast first at tensor parallel > 1; the rows'
    own token_ids are then placeholders."""
    # the step's own layout (device tokens checked there, as for a step)
    input_ids, positions, step, logits_rows = runner._prepare(seqs, tokens)
    flat = to_device([r for st, s in zip(runner.seq_starts, seqs, strict=True)
                      for r in range(st, st + len(s.token_ids))], torch.long, runner.device)
    if hidden is not None and hidden.shape[0] != len(flat):
        raise ValueError(f"{hidden.shape[0]} hidden rows for {len(flat)} tokens")
    tp = runner._tp
    if tp is not None:
        tp.send_mtp(seqs, device_tokens=tokens is not None)
    try:
        if tokens is not None:
            input_ids = runner._device_tokens(tokens)
        hidden = _shared_rows(runner, hidden, len(flat))
        x = torch.empty_like(hidden)
        x[flat] = hidden  # to the step's flat layout
        meta = runner.backend.attention.plan_side(step)
        logits, y = runner.model.mtp_forward(input_ids, positions, x, meta, logits_rows)
    except (RuntimeError, ValueError) as e:  # ValueError: the group was aborted
        if tp is not None and (isinstance(e, RuntimeError) or tp.failed):
            tp.fail_step(e)  # a collective failed: a rank died or wedged
        raise
    return logits, y.index_select(0, flat)


@torch.inference_mode()
def mtp_logits(runner: ModelRunner, hidden: torch.Tensor | None, rows: int = 0) -> torch.Tensor:
    """fp32 logits [rows, vocab] of the MTP head's outputs `hidden` [rows, H]
    (execute_mtp's second result): the shared lm_head, on every rank at tensor parallel
    > 1 (the other ranks pass None and the row count)."""
    tp = runner._tp
    if hidden is not None:
        rows = hidden.shape[0]
        if tp is not None:
            tp.send_mtp_logits(rows)
    try:
        logits: torch.Tensor = runner.model.lm_head(_shared_rows(runner, hidden, rows)).float()
    except (RuntimeError, ValueError) as e:  # ValueError: the group was aborted
        if tp is not None and (isinstance(e, RuntimeError) or tp.failed):
            tp.fail_step(e)
        raise
    return logits


def _shared_rows(runner: ModelRunner, hidden: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Rank 0's `hidden` [rows, H] on every rank (a broadcast over the group at tensor
    parallel > 1; the other ranks pass None)."""
    if runner.tp_size == 1:
        assert hidden is not None
        return hidden
    import torch.distributed as dist

    if runner.tp_rank == 0:
        assert hidden is not None
        hidden = hidden.to(runner.dtype).contiguous()
    else:
        hidden = torch.empty(rows, runner.config.hidden_size, dtype=runner.dtype,
                             device=runner.device)
    dist.broadcast(hidden, src=0)
    return hidden
