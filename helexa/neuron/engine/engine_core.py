"""EngineCore: one model's step loop — admit, schedule, execute, sample, stop, release.

`step(inbound)` takes everything the daemon sent since the last step (new
requests, aborts, limits) and returns one FromEngine: every request's new
tokens, admissions, refusals and completions, and the model's status. It is
plain synchronous code, used in the engine process (process.py), in-process
by tests, benchmarks and `helexa generate`.

One step:
1. apply limits, new requests (queued or refused at once), aborts;
2. expire queued requests that waited too long for KV, abort those past
   their deadline;
3. admit queued requests in flight (admission.py: fair order, whole
   reservation or nothing);
4. schedule the step (scheduler.py: decode first, then prefill chunks);
5. draw the blocks the step writes, run the model, sample the next tokens;
6. stop requests on eos / stop ids / output budget / context.

Blocks go back to the pool in one place, `_finish`, whatever ended the
request (finish, abort, refusal, error). An exception in step 5 fails the
requests of that step (their blocks return) and the engine goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from helexa.budget import Problem, blocks_for_tokens, check_request, output_budget
from helexa.neuron.engine import messages
from helexa.neuron.engine.admission import Admission, DrainMeter, Refusal
from helexa.neuron.engine.block_pool import BlockKey, BlockPool, hash_block_tokens
from helexa.neuron.engine.grammar import Grammars, GrammarUnavailable, advance, eos_ids_from
from helexa.neuron.engine.images import PromptImages, check_images
from helexa.neuron.engine.model_runner import SeqInput
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.sampler import Sampler, SamplingState
from helexa.neuron.engine.scheduler import Scheduler, StepPlan
from helexa.neuron.engine.spec import EngineSpec, check_pool, full_limits, merge_limits
from helexa.neuron.engine.speculative.draft_model import DraftModelDrafter, load_draft
from helexa.neuron.engine.speculative.drafters import Drafter, make_drafter
from helexa.neuron.engine.speculative.policy import SpecPolicy
from helexa.neuron.engine.speculative.speculator import Speculator
from helexa.neuron.engine.thinking import ThoughtTracker

if TYPE_CHECKING:
    import torch

_EWMA_ALPHA = 0.2


class Runner(Protocol):
    """What a step needs of a model runner: ModelRunner, or a stand-in without a model."""

    def execute(self, seqs: list[SeqInput]) -> torch.Tensor: ...


class EngineCore:
    def __init__(self, spec: EngineSpec, runner: Runner | None = None, *,
                 sampler: Sampler | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, logger: Any = None,
                 progress: Callable[[int, int], None] | None = None,
                 drafter: Drafter | None = None) -> None:
        self.spec = spec
        self.limits = full_limits(spec.limits)
        self.log = logger
        # A draft model loads before the target, so a CUDA target sizes its pool after it.
        draft_runner = (load_draft(spec, self.limits) if runner is None and spec.draft_model_dir
                        else None)
        self.runner = runner if runner is not None else make_runner(
            spec, self.limits, progress,
            draft_bytes_per_block=draft_runner.kv_bytes_per_block if draft_runner else 0)
        self.spec = spec = check_pool(spec, self.runner)
        # The draft model's drafter, kept while speculation switches away and back.
        self.draft_drafter: DraftModelDrafter | None = None
        if draft_runner is not None:  # its layers over the target's blocks (draft_model.py)
            draft_runner.reset_kv(int(getattr(self.runner, "num_blocks", spec.num_blocks)),
                                  spec.kv_dtype)
            self.draft_drafter = DraftModelDrafter(
                spec.draft_model_id, draft_runner, self._ensure_blocks,
                max_batched_tokens=self.limits.max_batched_tokens)
        # A drafter handed in (tests) stays; else limits.speculation names it (reloadable).
        self._own_drafter = drafter is None
        self.speculator = Speculator(drafter if drafter is not None
                                     else self._drafter_for(self.limits.speculation),
                                     spec_policy(self.limits))
        backend = getattr(self.runner, "backend", None)  # the fake runner has none
        self.attention_backend = backend.describe() if backend is not None else ""
        self.sampler = sampler or Sampler()
        # the runner's own count: on CUDA it sizes the pool by measurement, the plan's as ceiling
        blocks = getattr(self.runner, "num_blocks", None)
        self.pool = self._new_pool(blocks if isinstance(blocks, int) else spec.num_blocks)
        self.admission = Admission(self.pool, self.limits, prefix_cache=spec.prefix_cache,
                                   clock=clock, wall_clock=wall_clock)
        self.scheduler = Scheduler(self.limits.max_slots, self.limits.max_batched_tokens,
                                   self.limits.prefill_chunk_tokens)
        self.clock = clock
        self.requests: dict[str, Request] = {}  # queued, in flight or running
        self.running: list[Request] = []  # batch rows, in order
        self.waiting: list[Request] = []  # in flight, no batch row yet (admission order)
        self.decode_tokens_per_sec = 0.0
        self.prefill_tokens_per_sec = 0.0
        self.num_failed_steps = 0
        self.consecutive_failed_steps = 0  # the engine process gives up past a bound
        self.last_error = ""
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._last_step_end = clock()
        self._updates: dict[str, messages.RequestUpdate] = {}
        self._kv_reset_answer = ""
        self.grammars = Grammars(spec.model_dir,
                                 int(getattr(self.runner, "vocab_size", 0)),
                                 eos_ids_from(spec.model_dir) if spec.model_dir else [])

    # --- the step ----------------------------------------------------------

    def step(self, inbound: messages.ToEngine | None = None) -> messages.FromEngine:
        started = time.perf_counter()
        self._updates = {}
        if inbound is not None:
            self.apply(inbound)
        self.admission.observe_pool()
        timed_out, late = self.admission.expire()
        for req, refusal in timed_out:
            self._refuse(req, refusal)
        for req in late:
            self._finish(req, RequestStatus.FINISHED_ABORTED, "deadline")
        self._admit()
        try:
            self.speculator.draft(self.running, self.limits.max_slots)
        except Exception:  # a drafter that fails (a draft model's forward, the MTP head's pass) costs only drafts
            for req in self.running:
                req.draft = None
            if self.log is not None:
                self.log.exception("engine.draft_failed", drafter=self.speculator.name)
        plan = self.scheduler.schedule(self.running, self.waiting)
        if not plan.is_empty:
            self._execute(plan)
        out = messages.FromEngine(updates=list(self._updates.values()), status=self.status(),
                                  step_ms=(time.perf_counter() - started) * 1000,
                                  kv_reset=self._kv_reset_answer)
        self._updates, self._kv_reset_answer = {}, ""
        return out

    def _admit(self) -> None:
        for req in self.admission.admit():
            upd = self._update(req)
            upd.admitted = True
            upd.prompt_tokens = req.num_prompt_tokens
            upd.cached_tokens = req.num_cached_tokens
            self.waiting.append(req)
            if self.spec.prefix_cache:
                self.prefix_query_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += req.num_cached_tokens

    def close(self) -> None:
        """Stop what the runner started (tensor-parallel rank processes)."""
        self.grammars.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def apply(self, inbound: messages.ToEngine) -> None:
        if inbound.limits is not None:
            self.set_limits(inbound.limits)
        self.admission.admitting = not inbound.stop_admitting
        if inbound.refuse_queued:  # draining: what waits is refused now, so callers go elsewhere
            for req in self.admission.queued():
                self._refuse(req, Refusal("shutting_down", "This model is shutting down.",
                                          self.admission.retry_after_ms(
                                              self.admission.reservation_blocks(req))))
        for new in inbound.new:  # new before aborts: an abort may follow its request at once
            self.add_request(new)
            self._admit()  # so the queue depth a newcomer meets is the real one
        for abort in inbound.aborts:
            aborted = self.requests.get(abort.req_id)
            if aborted is not None:
                self._finish(aborted, RequestStatus.FINISHED_ABORTED, abort.reason)
        if inbound.reset_kv is not None:
            self._kv_reset_answer = self.reset_kv(inbound.reset_kv)
        if inbound.shutdown:
            for req in list(self.requests.values()):
                self._finish(req, RequestStatus.FINISHED_ABORTED, "shutdown")

    def set_limits(self, update: messages.SetLimits) -> None:
        """Runtime knobs; the pool is not touched."""
        self.limits = merge_limits(self.limits, update)
        self.admission.limits = self.limits
        self.scheduler.max_slots = self.limits.max_slots
        self.scheduler.max_batched_tokens = self.limits.max_batched_tokens
        self.scheduler.prefill_chunk_tokens = self.limits.prefill_chunk_tokens
        self.speculator.policy = spec_policy(self.limits)
        if self._own_drafter and self.limits.speculation != self.speculator.name:
            self.speculator.drafter = self._drafter_for(self.limits.speculation)

    def _drafter_for(self, speculation: str) -> Drafter | None:
        """The drafter `speculation` names for this model, or None (logged) where it cannot run
        here: a draft model not loaded with it, an MTP head the model lacks (mtp.py)."""
        try:
            return make_drafter(speculation, self.draft_drafter, runner=self.runner,
                                ensure_blocks=self._ensure_blocks)
        except ValueError as e:
            if self.log is not None:
                self.log.warning("engine.speculation_refused", model=self.spec.model_id,
                                 speculation=speculation, reason=str(e))
            return None

    def reset_kv(self, r: messages.ResetKv) -> str:
        """Re-plan the pool (a kv_dtype switch) while nothing is in flight; "ok" or why not."""
        if self.admission.num_in_flight:
            return (f"{self.admission.num_in_flight} requests in flight;"
                    " stop admitting and let them finish first")
        reset = getattr(self.runner, "reset_kv", None)
        if reset is None:
            return "this model runner cannot re-plan its pool"
        try:
            reset(r.num_blocks, r.kv_dtype)
        except Exception as e:
            return f"re-planning the pool failed: {type(e).__name__}: {e}"
        self.spec = msgspec.structs.replace(
            self.spec, num_blocks=r.num_blocks, kv_dtype=r.kv_dtype,
            bytes_per_token=r.bytes_per_token, context=r.context,
            max_output_tokens=r.max_output_tokens)
        if self.draft_drafter is not None:  # the draft's layers follow the target's blocks
            reset_draft = getattr(self.draft_drafter.runner, "reset_kv", None)
            if reset_draft is not None:
                reset_draft(r.num_blocks, r.kv_dtype)
        self.pool = self._new_pool(r.num_blocks)
        self.admission.pool = self.pool
        self.admission.drain = DrainMeter()  # the old pool's release counter means nothing now
        for req in self.admission.queued():  # queued under the old context, refused if too long now
            problem = check_request(req.num_prompt_tokens, req.output_budget, context=r.context,
                                    max_output_tokens=r.max_output_tokens)
            if problem is None and self.admission.reservation_blocks(req) > r.num_blocks:
                problem = Problem("context_length_exceeded",
                                  f"{req.max_total_tokens} tokens do not fit the re-planned pool")
            if problem is not None:
                self._refuse(req, Refusal(problem.code, problem.message))
        return "ok"

    def _new_pool(self, num_blocks: int) -> BlockPool:
        """KV blocks, and for hybrid models one linear-attention state slot per request."""
        s = self.spec
        return BlockPool(num_blocks, s.block_size, s.bytes_per_block,
                         num_state_slots=s.num_state_slots, fixed_bytes=s.fixed_bytes)

    def add_request(self, new: messages.NewRequest) -> None:
        prompt = list(new.prompt_token_ids)
        context = self.spec.context
        budget = output_budget(len(prompt), new.max_tokens, context=context,
                               default_output_tokens=self.limits.default_output_tokens,
                               max_output_tokens=self.spec.max_output_tokens)
        req = Request(req_id=new.req_id, prompt_token_ids=prompt, output_budget=budget,
                      sampling=new.sampling, principal=new.principal,
                      stop_token_ids=frozenset(new.stop_token_ids),
                      deadline_unix=new.deadline_unix)
        if new.req_id in self.requests:
            self._refuse(req, Refusal("invalid_request_error", f"req_id {new.req_id} is in use"))
            return
        if new.images:  # a vision-language prompt (images.py): checked against its tokens
            problem_text = check_images(new.images, prompt, self.runner)
            if problem_text:
                self._refuse(req, Refusal("invalid_request_error", problem_text))
                return
            req.images = PromptImages.of(new.images)
        problem = check_request(len(prompt), new.max_tokens, context=context,
                                max_output_tokens=self.spec.max_output_tokens)
        if problem is not None:
            self._refuse(req, Refusal(problem.code, problem.message))
            return
        if new.grammar is not None:
            try:
                req.matcher = self.grammars.matcher(new.grammar)
            except (ValueError, GrammarUnavailable) as e:
                self._refuse(req, Refusal("invalid_request_error", f"response_format: {e}"))
                return
        if new.thinking is not None:
            req.thought = ThoughtTracker(new.thinking)
        if self.spec.prefix_cache:
            req.block_hashes = self._prompt_block_hashes(
                prompt if req.images is None else req.images.hash_ids(prompt))
        refusal = self.admission.submit(req)
        if refusal is not None:
            self._refuse(req, refusal)
            return
        # shares the request's output list: the sampler sees every appended token
        req.sampling_state = SamplingState.for_request(req.sampling, req.prompt_token_ids,
                                                       req.output_token_ids)
        self.requests[req.req_id] = req

    def status(self) -> messages.EngineStatus:
        return messages.EngineStatus(
            kv=self.pool.ledger(),
            in_flight=self.admission.num_in_flight,
            queued=self.admission.num_queued,
            running=len(self.running),
            decode_tokens_per_sec=round(self.decode_tokens_per_sec, 1),
            prefill_tokens_per_sec=round(self.prefill_tokens_per_sec, 1),
            admitting=self.admission.admitting,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            attention_backend=self.attention_backend,
            drafter=self.speculator.name,
            spec_drafted_tokens=self.speculator.drafted_tokens,
            spec_accepted_tokens=self.speculator.accepted_tokens,
        )

    # --- execution ---------------------------------------------------------

    def _execute(self, plan: StepPlan) -> None:
        for req_id in plan.promoted:
            req = self.requests[req_id]
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        reqs = [self.requests[c.req_id] for c in plan.chunks]
        try:
            seqs: list[SeqInput] = []
            sampled: list[tuple[Request, int]] = []  # (request, its logits row)
            verified: list[tuple[Request, int, int]] = []  # (request, first row, num drafts)
            rows = 0  # logits rows so far: a verification row has num_draft + 1
            for req, chunk in zip(reqs, plan.chunks, strict=True):
                start = req.num_computed_tokens
                end = start + chunk.num_tokens
                self._ensure_blocks(req, end)
                tokens = req.token_slice(start, end - chunk.num_draft)
                if chunk.num_draft:
                    assert req.draft is not None
                    tokens += req.draft.tokens[:chunk.num_draft]
                need_logits = end - chunk.num_draft == req.num_tokens
                seq = SeqInput(token_ids=tokens, num_computed=start, block_table=req.block_table,
                               need_logits=need_logits, state_slot=self.pool.state_slot(req.req_id),
                               num_logits=chunk.num_draft + 1)
                if req.images is not None:  # its chunk's M-RoPE shift and images
                    seq.rope_delta, seq.images = req.images.chunk(start, end)
                seqs.append(seq)
                if chunk.num_draft:
                    verified.append((req, rows, chunk.num_draft))
                elif need_logits:
                    sampled.append((req, rows))
                rows += chunk.num_draft + 1 if need_logits else 0
            # Grammar masks are computed in a worker thread while the model runs the step.
            # Their indices are positions in `sampled`, which are the rows handed to the
            # sampler below; a constrained request is never drafted (speculator.py), so it
            # always has exactly one row there.
            masked = [j for j, (r, _) in enumerate(sampled) if r.matcher is not None
                      and (r.thought is None or r.thought.answering)]
            masks = self.grammars.start([sampled[j][0].matcher for j in masked]) if masked else None
            logits = self.runner.execute(seqs)
            sample_logits = logits[[r for _, r in sampled]] if verified else logits
            states = [_sampling_state(r) for r, _ in sampled]
            if masks is not None:
                picks = self.sampler(sample_logits, states, bitmask=(masked, masks.result()))
            else:
                picks = self.sampler(sample_logits, states) if sampled else []
            new_tokens = {req.req_id: [pick[0]] for (req, _), pick
                          in zip(sampled, picks, strict=True)}
            for req, row, k in verified:
                new_tokens[req.req_id] = self.speculator.accept(req, logits[row:row + k + 1], k)
                upd = self._update(req)  # so far: the daemon may end it first (a stop string)
                upd.spec_drafted_tokens = req.spec_drafted_tokens
                upd.spec_accepted_tokens = req.spec_accepted_tokens
        except Exception as e:  # the step's requests fail; the engine goes on
            self.num_failed_steps += 1
            self.consecutive_failed_steps += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.log is not None:
                self.log.exception("engine.step_failed", requests=len(reqs))
            for req in reqs:
                self._finish(req, RequestStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}")
            return
        self.consecutive_failed_steps = 0
        num_prefill = num_decode = 0
        kept: list[int] = []  # positions each request computed and kept this step
        for req, chunk in zip(reqs, plan.chunks, strict=True):
            # a verification row keeps the KV of its decode token and the accepted drafts
            accepted = len(new_tokens[req.req_id]) - 1 if chunk.num_draft else chunk.num_draft
            kept.append(chunk.num_tokens - chunk.num_draft + accepted)
            req.num_computed_tokens += kept[-1]
            num_prefill += chunk.num_tokens if chunk.is_prefill else 0
            if self.spec.prefix_cache:
                self._file_full_blocks(req)
        lp = {req.req_id: logprob for (req, _), (_, logprob) in zip(sampled, picks, strict=True)}
        for req, chunk in zip(reqs, plan.chunks, strict=True):
            for token_id in new_tokens.get(req.req_id, []):
                if req.is_finished:  # a stop token among the accepted drafts ends it there
                    break
                self._append_token(req, token_id, lp.get(req.req_id))
                num_decode += not chunk.is_prefill
        try:  # a drafter that follows the target (MTP); its failure costs drafts, not output
            self.speculator.observe([(req, i, n) for i, (req, n)
                                     in enumerate(zip(reqs, kept, strict=True))
                                     if not req.is_finished])
        except Exception:
            if self.log is not None:
                self.log.exception("engine.draft_failed", drafter=self.speculator.name)
        self._measure(num_decode, num_prefill)
        if len(plan.decode_ids) < sum(1 for r in self.running if not r.is_prefilling):
            # The budget cut decodes short: rotate so the skipped ones go first next step.
            done = set(plan.decode_ids)
            self.running.sort(key=lambda r: r.req_id in done)

    def _ensure_blocks(self, req: Request, num_tokens: int) -> None:
        """Draw req's reserved blocks until its table holds num_tokens: always within its
        reservation (speculator.py caps drafts so), for the target's step or a draft model's."""
        need = blocks_for_tokens(num_tokens, self.pool.block_size)
        while len(req.block_table) < need:
            req.block_table.append(self.pool.draw(req.req_id))

    def _append_token(self, req: Request, token_id: int, logprob: Any) -> None:
        answering = req.thought is None or req.thought.answering  # a grammar follows answers
        if req.thought is not None:
            forced = req.thought.forced()
            if forced is not None and forced != token_id:  # the budget is spent: close it
                token_id, logprob = forced, None
            req.thought.observe(token_id)
        req.output_token_ids.append(token_id)
        upd = self._update(req)
        upd.new_token_ids.append(token_id)
        if logprob is not None:
            if upd.logprobs is None:
                upd.logprobs = []
            upd.logprobs.append(logprob)
        if req.matcher is not None and answering:
            error = advance(req.matcher, token_id)
            if error:
                self._finish(req, RequestStatus.FINISHED_ERROR, f"grammar: {error}")
                return
        if token_id in req.stop_token_ids or (req.matcher is not None
                                               and req.matcher.is_stopped()):
            self._finish(req, RequestStatus.FINISHED_STOPPED)
        elif req.num_output_tokens >= req.output_budget or req.num_tokens >= self.spec.context:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _measure(self, num_decode: int, num_prefill: int) -> None:
        now = self.clock()
        dt = max(min(now - self._last_step_end, 1.0), 1e-6)  # idle gaps beyond 1 s don't count
        self._last_step_end = now
        a = _EWMA_ALPHA
        self.decode_tokens_per_sec += a * (num_decode / dt - self.decode_tokens_per_sec)
        self.prefill_tokens_per_sec += a * (num_prefill / dt - self.prefill_tokens_per_sec)

    # --- prefix cache ------------------------------------------------------

    def _prompt_block_hashes(self, prompt: list[int]) -> list[BlockKey]:
        bs, hashes, parent = self.pool.block_size, [], None
        for i in range(len(prompt) // bs):
            parent = hash_block_tokens(parent, prompt[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _file_full_blocks(self, req: Request) -> None:
        """File every newly completed block of `req` under its chain hash."""
        bs = self.pool.block_size
        start = max(req.num_filed_blocks, req.num_cached_tokens // bs)
        for i in range(start, req.num_computed_tokens // bs):
            if i >= len(req.block_hashes):
                parent = req.block_hashes[i - 1] if i else None
                req.block_hashes.append(hash_block_tokens(parent, req.hash_slice(i * bs, (i + 1) * bs)))
            self.pool.register(req.block_table[i], req.block_hashes[i])
            req.num_filed_blocks = i + 1

    # --- the one place requests end ----------------------------------------

    def _finish(self, req: Request, status: RequestStatus, reason: str = "") -> None:
        if req.is_finished:
            return
        req.status = status
        if self.requests.get(req.req_id) is req:  # not a refused duplicate of a live req_id
            del self.requests[req.req_id]
            self.admission.remove(req)
            self.speculator.release(req)
            self.pool.release(req.req_id)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
        upd = self._update(req)
        upd.finished = status.finish_reason
        upd.error = reason if status != RequestStatus.FINISHED_STOPPED else ""
        upd.spec_drafted_tokens = req.spec_drafted_tokens
        upd.spec_accepted_tokens = req.spec_accepted_tokens
        if req.thought is not None:
            upd.reasoning_tokens = req.thought.reasoning_tokens

    def _refuse(self, req: Request, refusal: Refusal) -> None:
        self._finish(req, RequestStatus.FINISHED_REFUSED)
        upd = self._update(req)
        upd.refused_code = refusal.code
        upd.refused_message = refusal.message
        upd.retry_after_ms = refusal.retry_after_ms

    def _update(self, req: Request) -> messages.RequestUpdate:
        upd = self._updates.get(req.req_id)
        if upd is None:
            upd = self._updates[req.req_id] = messages.RequestUpdate(req_id=req.req_id)
        return upd


def _sampling_state(req: Request) -> SamplingState:
    assert req.sampling_state is not None, "set when the request was queued"
    return req.sampling_state


def spec_policy(limits: messages.Limits) -> SpecPolicy:
    """The adaptive speculation policy that `limits` (every knob set) describe."""
    return SpecPolicy(k_max=limits.spec_k, full_below=limits.spec_full_below,
                      off_above=limits.spec_off_above, min_acceptance=limits.spec_min_acceptance,
                      keep_acceptance=limits.spec_keep_acceptance)


def make_runner(spec: EngineSpec, limits: messages.Limits,
                progress: Callable[[int, int], None] | None = None, *,
                draft_bytes_per_block: int = 0) -> Runner:
    """The model runner for a spec: its checkpoint, on its devices. A draft model's layers
    share its pool's blocks: `draft_bytes_per_block` of each block are theirs."""
    from helexa.neuron.engine.model_runner import ModelRunner  # loads the model code
    return ModelRunner(Path(spec.model_dir), device=spec.device, dtype=spec.dtype,
                       num_blocks=spec.num_blocks, block_size=spec.block_size,
                       kv_dtype=spec.kv_dtype, max_num_seqs=limits.max_slots,
                       max_batched_tokens=limits.max_batched_tokens, progress=progress,
                       tp_size=spec.tp, backend=spec.attention_backend,
                       cuda_graphs=spec.cuda_graphs,
                       plan_bytes_per_block=(spec.bytes_per_token - spec.draft_bytes_per_token)
                       * spec.block_size, extra_bytes_per_block=draft_bytes_per_block,
                       context=spec.context, quantize=spec.quantize,
                       quant_group_size=spec.quant_group_size, mtp_kv_layers=spec.mtp_kv_layers,
                       # hybrid models: a state slot per request in flight (dense: unused)
                       num_state_slots=spec.num_state_slots or limits.max_in_flight or 1,
                       devices=list(spec.devices) if len(spec.devices) == spec.tp > 1 else None)
