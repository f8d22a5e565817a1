"""Lookahead decode: launch step N + 1 before reading step N's tokens back, so that the
host's work between two steps runs while the device computes.

A synchronous engine step leaves the device idle while the host reads the step's tokens,
appends them, checks stops, schedules and lays out the next step, plans its attention and
launches it: at batch 1 on a GPU that is hundreds of µs against a few ms of weight
streaming (docs/operating.md, the GPU check's ``host_us_per_step``). vLLM's async
scheduling and SGLang's overlap scheduler hide it the same way.

How (EngineCore.step):

1. A pure-decode step whose requests all qualify (`holdable`) is launched with its tokens
   chosen on the device (Sampler.choose) and copied back without waiting; the step is
   held (`Ahead`), not read.
2. The next EngineCore.step launches the step after it at once (`follow`): each request's
   row one position further, its input token the held step's sampled token, still on the
   device (ModelRunner takes it as ``tokens``). Only then does it read the held step's
   tokens and postprocess them as a synchronous step would (`step`). A following step
   with a constrained request is sampled after that (`sample`): its grammar masks need
   the matchers past the held tokens, and are computed while its forward runs.
3. The chain ends where a following step could not be the one the synchronous engine
   would run, and the engine then schedules as usual.

What keeps the tokens identical to the synchronous engine's:

- A request qualifies only if the host never changes its sampled token or the
  distribution of its next one in a way the device cannot follow: no forced
  thinking-budget close (ThoughtTracker.forced), no draft in the step, no thought
  that a grammar's answer follows (a stop token sampled in it is replaced by the
  closing marker: ThoughtTracker.close). A grammar in the answer qualifies, since its
  mask is applied on the device before the tokens are chosen.
  A model with a drafter chains its steps without drafts (a full batch, poor
  acceptance: the speculation policy's), and the chain ends where the drafter would be
  asked for one (Speculator.quiet), since it reads the tokens the held step has not yet
  given; requests kept from drafting probe on the same steps (speculative/policy.py) so
  that the steps between can chain. The MTP head observes each held step's hidden states
  when the step is read, as it would.
  Logprobs are computed on the device with the tokens and copied back with them;
  penalties count the held token on the device before the following step samples
  (SamplingState.count_ahead). At tensor parallel > 1 the other
  ranks get the device tokens as a broadcast from rank 0 (TpStep.device_tokens).
- A request whose held token ends it by length or context is left out of the following
  step (one whose budget may grow grows first where it can: growth.py, and keeps its
  row); one whose held token is a stop token ends when it is read, and the row the
  following step computed for it is dropped. That row writes one position the request's
  reservation covers (it has not reached its budget), and its blocks go back only after
  the row was launched, so a later owner's writes come after it on the device's stream.
- A hybrid's prefix snapshot at a following row's position is taken as the synchronous
  layout takes it (snapshots.take_slots), and joins its request's writes when that step is
  read, for the postprocess to file.
- A step that would promote a waiting request, or leave a running request out, ends the
  chain: the scheduler does those.

A request aborted while its step is held is finished at once (its blocks return); the
held step's row for it is discarded when read. One paused while its step is held
(intake.pause), or whose row goes back to a request admitted before it (intake.reclaim),
keeps the held token, and the following step has no row for it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from helexa.kernels.backends.base import to_device
from helexa.neuron.engine import growth, snapshots
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.runner import Runner, StepOutput
from helexa.neuron.engine.sampler import Logprobs, copy_back, logprobs, read_back
from helexa.neuron.engine.scheduler import ScheduledChunk, StepPlan
from helexa.neuron.engine.seq_input import SeqInput
from helexa.neuron.engine.step_inputs import StepInputs, StepResult

if TYPE_CHECKING:
    from helexa.neuron.engine.engine_core import EngineCore

ENV = "HELEXA_LOOKAHEAD"  # "0" off, "1" on (CPU too), unset: on CUDA


def wanted(runner: Runner) -> tuple[bool, str]:
    """Whether the engine launches lookahead steps with this runner, and why (logged)."""
    device = getattr(runner, "device", None)
    setting = os.environ.get(ENV, "")
    if setting == "0":
        return False, f"{ENV}=0"
    if setting == "1":
        return True, f"{ENV}=1"
    if device is not None and torch.device(device).type == "cuda":
        return True, "cuda"
    return False, "not a CUDA device (a CPU step leaves no device idle to overlap with)"


@dataclass
class Ahead:
    """A launched pure-decode step whose tokens have not been read back."""

    plan: StepPlan
    inputs: StepInputs
    out: StepOutput
    tokens: torch.Tensor | None = None  # [rows] sampled on the device (None until `sample`)
    host: torch.Tensor | None = None  # their copy on the host (pinned on CUDA) once `ready`
    ready: Any = None  # a CUDA event recorded after the copy, or None (a CPU step is done)
    logprobs: Logprobs | None = None  # the rows that want them (on the host once `ready`)
    # a hybrid's prefix snapshots the step saves (request, slot, position): they join the
    # request's snapshot_writes when the step is read, not before, since the step before it
    # files that request's writes when it is read
    saves: list[tuple[Request, int, int]] = field(default_factory=list)


def qualifies(req: Request) -> bool:
    """Whether the host leaves req's sampled tokens as they are (the module's list)."""
    s = req.sampling_state
    thought = req.thought
    return (req.draft is None and s is not None
            and (thought is None or thought.forced() is None)
            # a stop token sampled in a thought a grammar follows becomes the close
            and (thought is None or req.matcher is None or thought.answering))


def holdable(core: EngineCore, inputs: StepInputs) -> bool:
    """Whether this laid-out step may be launched and held: every row a plain decode row
    of a qualifying request."""
    return (core.lookahead and bool(inputs.reqs)
            and all(not c.is_prefill and not c.num_draft for c in inputs.chunks)
            and all(qualifies(r) for r in inputs.reqs)
            and len(inputs.sampled) == len(inputs.reqs))


def launch(core: EngineCore, plan: StepPlan, inputs: StepInputs,
           tokens: torch.Tensor | None = None, *, masks: Future[torch.Tensor] | None = None,
           defer: bool = False) -> Ahead:
    """Run the step and, unless `defer`, choose its tokens on the device (`sample`, under
    `masks`: the bitmasks of inputs.masked); nothing is read back."""
    out = core.runner.run_step(inputs.seqs, tokens=tokens,
                               keep_hidden=core.speculator.follows_target)
    ahead = Ahead(plan, inputs, out)
    if not defer:
        sample(core, ahead, masks)
    return ahead


def sample(core: EngineCore, ahead: Ahead, masks: Future[torch.Tensor] | None = None) -> None:
    """Choose a launched step's tokens on the device and copy them back without waiting.
    Its grammar masks: ``masks`` (of inputs.masked, started with the step), else, where
    the step's sampling waited for the held step before it to be read, those of its
    constrained rows now, their matchers having consumed the held tokens."""
    sampled = ahead.inputs.sampled
    states: list[Any] = [r.sampling_state for r, _ in sampled]
    rows = ahead.inputs.masked
    if masks is None:
        rows = [j for j in rows if not sampled[j][0].is_finished]  # ended as the held was read
        masks = core.grammars.start([sampled[j][0].matcher for j in rows]) if rows else None
    logits = core.sampler.prepare(ahead.out.logits, states,
                                  (rows, masks.result()) if masks is not None else None)
    chosen = core.sampler.choose(logits, states)
    ahead.tokens = chosen
    ahead.host, ahead.logprobs, ahead.ready = copy_back(chosen, logprobs(logits, chosen, states))


def step(core: EngineCore) -> bool:
    """EngineCore.step with a step held: launch the one after it (`follow`), read and
    postprocess the held one, then sample the following one where it waited for that (a
    grammar's masks). False where none followed: the scheduler's turn."""
    held, core.ahead = core.ahead, None
    assert held is not None
    failed: Exception | None = None
    try:
        core.ahead = follow(core, held)
    except Exception as e:  # noqa: BLE001 - its requests fail once the held step is read
        failed = e
    try:
        ran = read(held)
    except Exception as e:  # the device failed: the held step's requests with it
        core.fail([r for r, _ in held.inputs.sampled], e)
        core.ahead = None
        return True
    core.postprocess(held.plan, ran)
    core.consecutive_failed_steps = 0  # the held step ran
    if failed is None and core.ahead is not None and core.ahead.tokens is None:
        try:
            sample(core, core.ahead)
        except Exception as e:  # noqa: BLE001 - its requests are the held step's
            failed = e
    if failed is not None:  # the following step's requests: the held step's live ones but
        core.ahead = None  # those paused or reclaimed from as it launched (no row in it)
        core.fail([r for r, _ in held.inputs.sampled
                   if r.status == RequestStatus.RUNNING], failed)
    return core.ahead is not None or failed is not None


def follow(core: EngineCore, held: Ahead) -> Ahead | None:
    """Launch the step after `held` from its device tokens, or None where the synchronous
    engine would run another step (the module's list)."""
    if not core.lookahead:
        return None
    decoding = [r for r in core.running if not r.is_finished]
    if any(r.is_prefilling for r in decoding):
        return None
    pool = core.pool
    rows: list[int] = []  # held rows that go on, in order
    reqs: list[Request] = []
    ending = 0  # requests the held token ends by length or context
    for j, (req, _) in enumerate(held.inputs.sampled):
        if req.status != RequestStatus.RUNNING:  # finished, paused or its row reclaimed:
            continue  # a live one's held token is still read; it gets no following row
        if not qualifies(req):
            return None
        after = req.num_tokens + 1  # its tokens once the held one is appended
        if after >= core.spec.context or (req.num_output_tokens + 1 >= req.output_budget
                                          and not growth.grow(core, req, final=False)):
            ending += 1
            continue  # the held token is its last (unless the postprocess grows it)
        rows.append(j)
        reqs.append(req)
    if core.waiting and len(decoding) - ending < core.limits.max_slots:
        return None  # a promotion is due (a free slot, or one the held token frees)
    held_ids = {r.req_id for r, _ in held.inputs.sampled}
    if not reqs or any(r.req_id not in held_ids for r in decoding):
        return None  # a running request the held step left out: the scheduler rotates
    if len(reqs) > core.limits.max_batched_tokens:
        return None
    # running as the synchronous engine would draft: less those the held token ends
    if not core.speculator.quiet(reqs, len(decoding) - ending, core.limits.max_slots):
        return None  # a draft is due: the drafter needs the held step's tokens
    inputs = StepInputs(reqs, [ScheduledChunk(r.req_id, 1, is_prefill=False) for r in reqs])
    for i, req in enumerate(reqs):
        start = req.num_computed_tokens + 1  # the held row's position is computed
        core.ensure_blocks(req, start + 1)
        seq = SeqInput(token_ids=[0], num_computed=start, block_table=req.block_table,
                       need_logits=True, state_slot=pool.state_slot(req.req_id))
        if req.images is not None:
            seq.rope_delta, seq.images = req.images.chunk(start, start + 1)
        inputs.seqs.append(seq)
        inputs.sampled.append((req, i))
    saves: list[tuple[Request, int, int]] = []  # filed when this step is read
    snapshots.take_slots(pool, reqs, inputs.chunks, inputs.seqs,
                         core.spec.snapshot_every_tokens, later=saves)
    core.move_kv()  # a snapshot slot taken above may have evicted one to the host
    assert held.tokens is not None
    vocab = held.out.logits.shape[1]
    for req, j in zip(reqs, rows, strict=True):
        st = req.sampling_state
        if st is not None and st.has_penalties:  # the held token counts for this step's
            st.count_ahead(held.tokens[j:j + 1], vocab)
    tokens = held.tokens if len(rows) == len(held.inputs.sampled) else \
        held.tokens[to_device(rows, torch.long, held.tokens.device)]
    # a constrained row's mask needs its matcher past the held token: sample once it is read
    defer = any(r.matcher is not None for r in reqs)
    ahead = launch(core, StepPlan(chunks=list(inputs.chunks)), inputs, tokens, defer=defer)
    ahead.saves = saves
    return ahead


def read(held: Ahead) -> StepResult:
    """The held step's tokens, read back (waiting for the device only as long as it is
    still computing that step), as the synchronous path's StepResult; its snapshot saves
    join their requests' writes, for the postprocess to file."""
    assert held.host is not None, "a held step is sampled before it is read"
    sampled = held.inputs.sampled
    picked, entries = read_back(held.host, held.logprobs, held.ready,
                                [r.sampling_state for r, _ in sampled])  # type: ignore[misc]
    for req, slot, end in held.saves:
        if not req.is_finished:  # a finished one gave its writing slots back
            req.snapshot_writes.append((slot, end))
    new_tokens = {req.req_id: [t] for (req, _), t in zip(sampled, picked, strict=True)}
    return StepResult(held.inputs, held.out, new_tokens,
                      {sampled[i][0].req_id: e for i, e in entries.items()})
