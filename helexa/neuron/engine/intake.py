"""Intake: what reaches the engine from the daemon, taken in before a step is scheduled.

`take(core, inbound)` is the first part of every step (engine_core.py):
1. the limits in force (the whole set: admission's, the scheduler's and the
   speculation's knobs; the pool is not touched);
2. admitting on or off; a drain refuses what is queued (shutting_down) at once,
   and what comes until admission resumes; a switch's stop holds it queued;
3. new requests: checked (duplicate id, images against their tokens, context:
   helexa/budget.py), then queued (admission.py) or refused, each admitted as far
   as it fits before the next arrives, so the queue depth a newcomer meets is the
   real one; a request with a grammar is queued while its grammar compiles off
   the step loop (grammar.py), not admitted until its matcher is ready, and
   refused with llguidance's message where the grammar does not compile
   (`compiled`, each step);
4. pauses and resumes (flow control: `pause`), aborts, a re-planned pool (`reset_kv`,
   only while nothing is in flight), shutdown;
5. queued requests that waited too long for KV are refused, those past their
   deadline aborted, and admission admits what now fits (fair order, whole
   reservation or nothing);
6. rows given back (`reclaim`): a request that lost its row (paused, then
   resumed behind a full batch) takes one back from the running request
   admitted last, where that one was admitted after it.

Every refusal and abort ends in the core's one place requests end (`finish`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import msgspec

from helexa.budget import check_request, fitted_max_tokens, output_budget
from helexa.neuron.engine import encoder_steps, messages
from helexa.neuron.engine.admission import DrainMeter
from helexa.neuron.engine.grammar import GrammarUnavailable
from helexa.neuron.engine.images import PromptImages, check_images
from helexa.neuron.engine.prefix_filing import cache_salt, prompt_block_hashes
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.sampler import SamplingState
from helexa.neuron.engine.thinking import ThoughtTracker
from helexa.refusal import Refusal

if TYPE_CHECKING:
    from helexa.neuron.engine.engine_core import EngineCore

_ADMITTED = itertools.count(1)  # Request.seq: admission order, the seniority for a row


def take(core: EngineCore, inbound: messages.ToEngine | None) -> None:
    """Everything the daemon sent since the last step, then expiry and admission."""
    if inbound is not None:
        apply(core, inbound)
    compiled(core)
    core.admission.observe_pool()
    timed_out, late = core.admission.expire()
    for req, refusal in timed_out:
        core.refuse(req, refusal)
    for req in late:
        core.finish(req, RequestStatus.FINISHED_ABORTED, "deadline")
    admit(core)
    reclaim(core)


def apply(core: EngineCore, inbound: messages.ToEngine) -> None:
    """One inbound message: limits, admitting, new requests, aborts, re-plan, shutdown."""
    if inbound.limits is not None:
        set_limits(core, inbound.limits)
    adm = core.admission
    # a drain refuses newcomers as long as admission stays stopped; a profile switch only
    # stops admitting: what comes meanwhile is held queued and admitted when it ends
    adm.hold(not inbound.stop_admitting, inbound.stop_admitting and inbound.refuse_new)
    if inbound.refuse_queued:  # draining: what waits is refused now, so callers go elsewhere
        for req in adm.queued():
            core.refuse(req, Refusal("shutting_down", "This model is shutting down.",
                                     adm.retry_after_ms(adm.reservation_blocks(req))))
    for new in inbound.new:  # new before aborts: an abort may follow its request at once
        add_request(core, new)
        admit(core)  # so the queue depth a newcomer meets is the real one
    for req_id, paused in inbound.paused.items():
        (pause if paused else resume)(core, req_id)
    for abort in inbound.aborts:
        aborted = core.requests.get(abort.req_id)
        if aborted is not None:
            core.finish(aborted, RequestStatus.FINISHED_ABORTED, abort.reason)
    if inbound.reset_kv is not None:
        core.kv_reset_answer = reset_kv(core, inbound.reset_kv)
    if inbound.shutdown:
        for req in list(core.requests.values()):
            core.finish(req, RequestStatus.FINISHED_ABORTED, "shutdown")


def pause(core: EngineCore, req_id: str) -> None:
    """Leave a request out of steps: its caller stopped taking its tokens (the daemon's
    flow control, client.py). It gives up its batch row, so it holds no decode width, and
    keeps everything else (reservation, blocks, state slot, sampler and grammar state), as
    in flight; a deadline or an abort still ends it (`finish`). Not a preemption: nothing is
    freed or recomputed, and `resume` puts it back where it stopped. The row is lent, not
    lost: resumed, it takes one back from a request admitted after it (`reclaim`)."""
    req = core.requests.get(req_id)
    if req is None or req_id in core.paused:
        return
    if req in core.running:
        core.running.remove(req)
    elif req in core.waiting:
        core.waiting.remove(req)
    else:
        return  # queued: it has made no token a caller could leave unread
    req.status = RequestStatus.IN_FLIGHT
    req.draft = None  # drafted for this step; the scheduler gives a resumed row none
    encoder_steps.forget(core, req)  # an image part-way starts over once it has a row
    core.paused[req_id] = req
    core.update(req).waiting_for_row = False  # resumed and paused again before a step


def resume(core: EngineCore, req_id: str) -> None:
    """Its caller reads again: the request waits for a batch row (`wait_again`), which the
    scheduler gives it as it promotes (scheduler.py, step 3): at once where one is free,
    else one taken back from a request admitted after it (`reclaim`, this step), else when
    a row frees."""
    req = core.paused.pop(req_id, None)
    if req is not None:
        wait_again(core, req)


def wait_again(core: EngineCore, req: Request) -> None:
    """A request that had a batch row waits for one again: ahead of the prompts waiting
    for their first, among those like it in admission order. Its update says so
    (`waiting_for_row`, so that its caller's clock of the engine's silence stops); the step
    that gives it the row unsets it, so a caller hears of a wait only where one happens."""
    req.status = RequestStatus.IN_FLIGHT
    req.draft = None  # drafted for a step it has no row in
    at = next((i for i, r in enumerate(core.waiting) if not r.had_row or r.seq > req.seq),
              len(core.waiting))
    core.waiting.insert(at, req)
    core.update(req).waiting_for_row = True


def reclaim(core: EngineCore) -> None:
    """Rows back to requests that had one, from running requests admitted after them
    (scheduler.py `reclaims`): a request's row is lent while it is paused, not lost. The
    row's owner until now waits for one again (`wait_again`), its reservation and state
    kept: nothing is freed or recomputed, and it goes on where it stopped."""
    for req in core.scheduler.reclaims(core.running, core.waiting):
        core.running.remove(req)
        wait_again(core, req)


def set_limits(core: EngineCore, limits: messages.Limits) -> None:
    """Runtime knobs, the whole set; the pool is not touched."""
    core.limits = core.admission.limits = limits
    sched = core.scheduler
    sched.max_slots, sched.max_batched_tokens = limits.max_slots, limits.max_batched_tokens
    sched.prefill_chunk_tokens = limits.prefill_chunk_tokens
    if core.vision_pace is not None:  # images split over steps: the new target or override
        core.vision_pace.configure(limits)
        sched.vision_budget = core.vision_pace.budget
    core.speculator.configure(limits)
    refit(core)  # a queued request without max_tokens takes the new default_output_tokens


def admit(core: EngineCore) -> None:
    """Queued requests into flight as far as they fit (admission.py decides)."""
    for req in core.admission.admit():
        req.seq = next(_ADMITTED)
        upd = core.update(req)
        upd.admitted = True
        upd.prompt_tokens = req.num_prompt_tokens
        upd.output_budget = req.output_budget
        upd.cached_tokens = req.num_cached_tokens
        core.waiting.append(req)
        if core.prefix_cache:
            core.prefix_query_tokens += req.num_prompt_tokens
            core.prefix_hit_tokens += req.num_cached_tokens
            core.prefix_host_hit_tokens += req.num_host_tokens


def add_request(core: EngineCore, new: messages.NewRequest) -> None:
    """Queue a new request, or refuse it at once saying why."""
    prompt = list(new.prompt_token_ids)
    context, max_output = core.spec.context, core.spec.max_output_tokens
    budget = output_budget(len(prompt), new.max_tokens, context=context,
                           default_output_tokens=core.limits.default_output_tokens,
                           max_output_tokens=max_output)
    req = Request(req_id=new.req_id, prompt_token_ids=prompt, output_budget=budget,
                  growable=new.max_tokens is None, ceiling=new.max_tokens_ceiling,
                  sampling=new.sampling, principal=new.principal,
                  stop_token_ids=frozenset(new.stop_token_ids),
                  deadline_unix=new.deadline_unix)
    if new.req_id in core.requests:
        core.refuse(req, Refusal("invalid_request_error", f"req_id {new.req_id} is in use"))
        return
    if new.images:  # a vision-language prompt (images.py): checked against its tokens
        problem_text = check_images(new.images, prompt, core.runner)
        if problem_text:
            core.refuse(req, Refusal("invalid_request_error", problem_text))
            return
        req.images = PromptImages.of(new.images)
    problem = check_request(len(prompt), new.max_tokens, context=context,
                            max_output_tokens=max_output)
    if problem is not None:
        core.refuse(req, Refusal(problem.code, problem.message))
        return
    if new.thinking is not None:
        req.thought = ThoughtTracker(new.thinking)
    if core.prefix_cache:
        req.cache_salt = cache_salt(core.prefix_sharing, new.principal)
        req.block_hashes = prompt_block_hashes(
            prompt if req.images is None else req.images.hash_ids(prompt), core.pool.block_size,
            req.cache_salt)
    refusal = core.admission.submit(req)
    if refusal is not None:
        core.refuse(req, refusal)
        return
    # shares the request's output list: the sampler sees every appended token
    req.sampling_state = SamplingState.for_request(req.sampling, req.prompt_token_ids,
                                                   req.output_token_ids)
    core.requests[req.req_id] = req
    if new.grammar is not None:  # queued, it waits for its matcher (`compiled`)
        try:  # the cache's salt is the prefix cache's: no key learns what another compiled
            core.grammars.compile(req, new.grammar, cache_salt(core.prefix_sharing,
                                                               new.principal))
        except GrammarUnavailable as e:
            core.refuse(req, Refusal("invalid_request_error", f"response_format: {e}"))


def compiled(core: EngineCore) -> None:
    """Queued requests whose grammar compiled (off the step loop: grammar.py) take their
    matchers and may be admitted; a grammar llguidance refused refuses its request."""
    for req, matcher, error in core.grammars.ready():
        if error:
            core.refuse(req, Refusal("invalid_request_error", f"response_format: {error}"))
        else:
            req.matcher = matcher


def reset_kv(core: EngineCore, r: messages.ResetKv) -> str:
    """Re-plan the pool (a kv_dtype switch, a hybrid's state slots, a wider batch) while
    nothing is in flight; "ok" or why not."""
    adm = core.admission
    if adm.num_in_flight:  # BUSY: the caller may wait for them and ask again
        return (f"{messages.RESET_BUSY}{adm.num_in_flight} requests in flight;"
                " stop admitting and let them finish first")
    failed = ""
    try:  # on CUDA measured as at load: the runner's count is the pool's, the plan's a ceiling
        core.runner.reset_kv(r.num_blocks, r.kv_dtype, r.context, r.num_state_slots,
                             r.max_slots, r.max_batched_tokens)
    except Exception as e:  # the runner made its old pool again, empty
        failed = f"re-planning the pool failed: {type(e).__name__}: {e}"
    blocks = core.runner.num_blocks
    if not failed:
        core.spec = msgspec.structs.replace(
            core.spec, num_blocks=blocks, kv_dtype=r.kv_dtype,
            bytes_per_token=r.bytes_per_token, context=r.context,
            max_output_tokens=r.max_output_tokens,
            num_state_slots=r.num_state_slots or core.spec.num_state_slots,
            max_slots_ceiling=r.max_slots or core.spec.max_slots_ceiling,
            max_batched_tokens_ceiling=(r.max_batched_tokens
                                        or core.spec.max_batched_tokens_ceiling))
        core.speculator.drafters.reset_kv(blocks, r.kv_dtype)  # a draft model's layers
    # a new, empty pool either way: the old one's prefix cache named blocks whose contents
    # went with the runner's old pool, and its release counter means nothing now
    core.pool = adm.pool = core.new_pool(blocks)
    adm.drain = DrainMeter()
    if failed:
        return failed
    refit(core)  # queued (held by the switch) under the old pool and context
    return "ok"


def refit(core: EngineCore) -> None:
    """Queued requests sized again, as `add_request` sizes a new one, for the context, the
    output limit and the pool in force now (a profile switch re-planned them) and the
    limits (its default_output_tokens): one that no longer fits is refused as a new one
    would be, with the arithmetic; one that asked no max_tokens takes the budget a new
    one would, and one whose max_tokens is a ceiling is fitted to the context again (the
    daemon's prepare.prompt_of). Queued, they hold nothing: there is nothing to give back."""
    context, max_output = core.spec.context, core.spec.max_output_tokens
    for req in core.admission.queued():
        asked = None if req.growable else req.output_budget
        if req.ceiling is not None:
            asked = req.output_budget = fitted_max_tokens(
                req.num_prompt_tokens, req.ceiling, context=context,
                max_output_tokens=max_output)
        problem = check_request(req.num_prompt_tokens, asked, context=context,
                                max_output_tokens=max_output)
        if problem is None and asked is None:
            req.output_budget = output_budget(
                req.num_prompt_tokens, None, context=context, max_output_tokens=max_output,
                default_output_tokens=core.limits.default_output_tokens)
        problem = problem or core.admission.too_big(req)
        if problem is not None:
            core.refuse(req, problem)
