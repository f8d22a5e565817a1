"""Growing a reservation: a request whose client named no max_tokens goes on past its budget.

Such a request (`Request.growable`) is admitted with the reservation of helexa/budget.py's
rule, `kv.default_output_tokens` of output. When its output reaches the end of that budget,
`grow` gives it one more step (budget.grown_budget: `kv.default_output_tokens` more tokens,
prompt and output rounded up to whole blocks, never past the context nor the model's
max_output_tokens) and sets aside the blocks it needs (BlockPool.extend), and the request
decodes on in the same step loop: its client sees no pause. A request whose client named
max_tokens never grows: that is the client's exact ceiling. `kv.grow_output = false`
(reload) turns growth off, and every request ends at its admission budget.

The rule (docs/architecture.md, "The KV pool and its ledger"): a growth takes its blocks
only when the free blocks left after it still cover the whole reservation of every request
queued (admission.py queued_blocks: prefix hits not subtracted, so the figure is an upper
bound). Admission's order is then untouched: every queue's head still fits as it did, so
growth never delays an admission, and the no-bypass FIFO and the round-robin between
principals mean what they meant. The simpler "only while nothing is queued" would let one
request waiting for an in-flight place (not for KV) stop every growth on the model; this
rule only refuses what a queued request could need. Nor does a request grow while the engine
admits nothing (`stop_admitting`: a drain, a profile switch waiting for in-flight work to
end within server.drain_secs): its reply ends at its budget with "length" rather than
growing toward the context and outlasting the drain (aborted then) or the switch (refused
model_busy). Nor does a growth keep a batch row from
an admitted request that waits for one: while more requests wait for a row
(`EngineCore.waiting`: never had one, or resumed behind a full batch) than rows are free, no
request grows, and the grower's end gives its row to the first of them. Where the rule
refuses, or the pool has no room, the request ends with finish_reason "length" at the
budget it had, as without growth, and its usage counts what it produced. So a growth never
delays a queued request's admission, and a request waiting for a row waits at most for the
budget a running request had before its next growth (`kv.default_output_tokens`), as
without growth.

Every path that decides "this request is done at its budget" asks here first:
EngineCore._append_token (the end of the budget reached: a refusal there is final and
counted) and lookahead.follow (the held token would be the last: a successful growth gives
the request its following row; a refused one leaves it out, and the postprocess asks again
when the held token is read). Speculation needs no hook: its room
(Speculator._asks: the budget less the output, less one) reads the current budget, so
drafts stay inside the reservation and shrink to none in the last `spec_k` tokens before
a growth, and come back after it. A draft model's and an MTP head's KV live in the target's
blocks (speculative/draft_model.py, mtp.py), so a growth covers them too; no drafter has a
pool or a reservation of its own. A hybrid's state slot is per request and unaffected:
growth takes blocks only. At tensor parallel > 1 admission and growth run on rank 0 alone,
and the other ranks see only each step's block tables (tp_worker.py): nothing there holds a
budget. The blocks a growth set aside return with the request's others in the one
`release` (EngineCore.finish), however it ends; the ledger (Watch's free and reserved
blocks) counts them as reserved until drawn, as any reservation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from helexa.budget import grown_budget, reservation_blocks
from helexa.neuron.engine.request import Request

if TYPE_CHECKING:
    from helexa.neuron.engine.engine_core import EngineCore


# Why a growth was refused (helexa_kv_growths_refused_total's `reason`): the pool had fewer
# free blocks than it needs; it had them, but requests queued for KV need them; admitted
# requests wait for a batch row (the grower's end frees one); a drain or a switch waits for
# in-flight work to end.
REASONS = ("no_room", "queued", "waiting", "not_admitting")


class GrowthCounts:
    """Growths since the engine started, and the growths refused by reason (EngineStatus,
    metrics)."""

    def __init__(self) -> None:
        self.grown = 0
        self.refused = dict.fromkeys(REASONS, 0)

    def figures(self) -> dict[str, Any]:
        return {"kv_growths": self.grown,
                **{f"kv_growths_refused_{r}": n for r, n in self.refused.items()}}


def grow(core: EngineCore, req: Request, *, final: bool = True) -> bool:
    """Grow req's budget and reservation by one step where the rule allows; True when it
    grew. False, changing nothing, for a request its client gave max_tokens, with growth
    off, at the context or output limit, while the engine admits nothing, while admitted
    requests wait for a row none is free for, or where the blocks are not to be had; `final`:
    the request ends if it does not grow, so a refusal is counted (lookahead.follow's try
    is not: the postprocess asks again)."""
    if not (req.growable and core.limits.grow_output):
        return False
    pool, spec = core.pool, core.spec
    budget = grown_budget(req.num_prompt_tokens, req.output_budget,
                          core.limits.default_output_tokens, context=spec.context,
                          block_size=pool.block_size, max_output_tokens=spec.max_output_tokens)
    if budget <= req.output_budget:
        return False  # at the context or the output limit: its end, not a refusal
    if not core.admission.admitting:  # a drain or a switch waits for in flight to end
        return _refused(core, "not_admitting", final)
    if len(core.waiting) > core.scheduler.max_slots - len(core.running):
        return _refused(core, "waiting", final)  # a row none is free for: this one's end gives it
    need = reservation_blocks(req.num_prompt_tokens, budget, pool.block_size) \
        - req.num_reserved_blocks
    free = pool.num_free_blocks
    if need > free:
        return _refused(core, "no_room", final)
    if need > free - core.admission.queued_blocks() or not pool.extend(req.req_id, need):
        return _refused(core, "queued", final)
    req.num_reserved_blocks += need
    req.output_budget = budget
    core.growth.grown += 1
    return True


def _refused(core: EngineCore, reason: str, final: bool) -> bool:
    """False, the growth refused; counted where the request ends for it (`final`)."""
    if final:
        core.growth.refused[reason] += 1
    return False
