"""EngineCore: one model's step loop — take in, schedule, run, postprocess — and the one
place requests end.

`step(inbound)` takes everything the daemon sent since the last step (new
requests, aborts, limits) and returns one FromEngine: every request's new
tokens, admissions, refusals and completions, and the model's status. It is
plain synchronous code, used in the engine process (process.py), in-process
by tests, benchmarks and `helexa generate`.

One step:
1. take in (intake.py): limits, new requests (queued or refused at once),
   aborts; expiry and deadlines; admission (fair order, whole reservation or
   nothing);
2. schedule (scheduler.py: decode first, then prefill chunks; speculative/ first
   leaves a decoding request the tokens its row verifies);
3. run: the step's rows (step_inputs.py) through the model runner (runner.py),
   then a token for each sampled row and the accepted tokens of each
   verification row;
4. postprocess: count the kept positions as computed, file full blocks
   (prefix_filing.py) and a hybrid's prefix snapshots (snapshots.py), append the tokens and stop requests on eos / stop ids /
   output budget (a growable one grows first where it may: growth.py) / context, measure
   the rates.

On a GPU a pure-decode step may be held: launched, its tokens left on the device, and
read in the next step after the step that follows it is launched (lookahead.py).

Blocks go back to the pool in one place, `finish`, whatever ended the request
(finish, abort, refusal, error). An exception in step 3 fails the requests of
that step (their blocks return) and the engine goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from helexa.budget import blocks_for_tokens
from helexa.neuron.engine import encoder_steps as enc
from helexa.neuron.engine import growth, intake, lookahead, messages, prompt_logprobs, snapshots
from helexa.neuron.engine.admission import Admission
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.grammar import Grammars, advance
from helexa.neuron.engine.host_tier import HostTier, host_tier_size
from helexa.neuron.engine.messages import TokenLogprob
from helexa.neuron.engine.prefix_filing import file_full_blocks
from helexa.neuron.engine.request import Request, RequestStatus
from helexa.neuron.engine.runner import Runner, Runners, load_runners
from helexa.neuron.engine.sampler import Sampler
from helexa.neuron.engine.scheduler import Scheduler, StepPlan
from helexa.neuron.engine.spec import EngineSpec, check_pool
from helexa.neuron.engine.speculative.speculator import Speculator
from helexa.neuron.engine.step_inputs import StepResult, lay_out, pick_tokens
from helexa.neuron.engine.vision_pace import load as load_vision_pace
from helexa.refusal import Refusal

_EWMA_ALPHA = 0.2


class EngineCore:
    def __init__(self, spec: EngineSpec, runner: Runner | None = None, *,
                 sampler: Sampler | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, logger: Any = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        """`runner` None loads the model `spec` names (runner.py load_runners)."""
        self.limits = spec.limits
        self.log = logger
        runners = Runners(runner) if runner is not None else load_runners(spec, self.limits,
                                                                          progress)
        self.runner = runners.target
        self._runners = runners
        self.spec = spec = check_pool(spec, self.runner)
        self.prefix_cache, self.prefix_sharing = spec.prefix_cache, spec.prefix_sharing
        self.attention_backend = self.runner.attention_backend
        self.sampler = sampler or Sampler()
        # first: a draft model's layers take the target's block count here, before the host
        # tier (new_pool) makes host twins of every runner's pool
        self.speculator = Speculator(runners, self.ensure_blocks, spec, self.limits, log=logger)
        # the runner's own count: on CUDA it sizes the pool by measurement, the plan's as ceiling
        self.pool = self.new_pool(self.runner.num_blocks)
        self.admission = Admission(self.pool, self.limits, prefix_cache=spec.prefix_cache,
                                   clock=clock, wall_clock=wall_clock)
        self.scheduler = Scheduler(self.limits.max_slots, self.limits.max_batched_tokens,
                                   self.limits.prefill_chunk_tokens, scoring_rows=prompt_logprobs
                                   .allowance(self.runner, self.limits.max_slots))
        self.vision_pace = load_vision_pace(self, logger)  # the tower's budget a step
        if self.pool.snapshots is not None:  # hybrids: chunks end where snapshots are kept
            self.scheduler.snapshot_block_tokens = spec.block_size
            self.scheduler.snapshot_every_tokens = spec.snapshot_every_tokens
        self.clock = clock
        self.requests: dict[str, Request] = {}  # queued, in flight or running
        self.running: list[Request] = []  # batch rows, in order
        self.waiting: list[Request] = []  # in flight, no batch row yet (admission order)
        self.paused: dict[str, Request] = {}  # in flight, left out of steps (intake.pause)
        self.decode_tokens_per_sec = self.prefill_tokens_per_sec = 0.0
        self.num_failed_steps = self.consecutive_failed_steps = 0  # too many in a row: exit
        self.last_error = ""
        self.growth = growth.GrowthCounts()  # growable reservations' growths (growth.py)
        self.prefix_query_tokens = self.prefix_hit_tokens = self.prefix_host_hit_tokens = 0
        self._last_step_end = clock()
        self._updates: dict[str, messages.RequestUpdate] = {}
        self.kv_reset_answer = ""  # to this step's ResetKv (intake.reset_kv)
        self.grammars = Grammars(spec.model_dir, self.runner.vocab_size)
        self.lookahead, why = lookahead.wanted(self.runner)
        self.ahead: lookahead.Ahead | None = None  # a step launched, its tokens not yet read
        if logger is not None:
            logger.info("engine.lookahead", on=self.lookahead, reason=why)
        if spec.model_dir:  # a real checkpoint (the fake runner's tests have none)
            self.grammars.warm()

    # --- the step ----------------------------------------------------------

    def step(self, inbound: messages.ToEngine | None = None) -> messages.FromEngine:
        started = time.perf_counter()
        intake.take(self, inbound)
        self.move_kv()  # admission's host-tier copies, before any pass reads or writes them
        if self.ahead is None or not lookahead.step(self):
            self.speculator.draft(self.running, self.limits.max_slots)
            plan = self.scheduler.schedule(self.running, self.waiting)
            if not plan.is_empty:
                ran = self._run(plan)
                if ran is not None:  # None: the step failed or is held (lookahead.py)
                    self.postprocess(plan, ran)
        out = messages.FromEngine(updates=list(self._updates.values()), status=self.status(),
                                  step_ms=(time.perf_counter() - started) * 1000,
                                  kv_reset=self.kv_reset_answer)
        self._updates, self.kv_reset_answer = {}, ""
        return out

    def fail(self, reqs: list[Request], e: BaseException) -> None:
        """A step raised: its requests end with the error and the engine goes on."""
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        self.last_error = f"{type(e).__name__}: {e}"
        if self.log is not None:
            self.log.exception("engine.step_failed", requests=len(reqs),
                               req_ids=[r.req_id for r in reqs])
        for req in reqs:
            self.finish(req, RequestStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}")

    def _run(self, plan: StepPlan) -> StepResult | None:
        """The plan's rows through the model, and each request's new tokens; None when the
        step failed (its requests are finished with the error) or is held (lookahead.py:
        read in the next step)."""
        for req_id in plan.promoted:
            req = self.requests[req_id]
            self.waiting.remove(req)
            req.status, req.had_row = RequestStatus.RUNNING, True
            self.running.append(req)
            upd = self.update(req)
            upd.started, upd.waiting_for_row = True, False
        reqs = [self.requests[c.req_id] for c in plan.chunks]
        try:
            enc.run(self, plan.encode)  # its images' tower work, before its rows
            inputs = lay_out(plan, reqs, self.pool, self.ensure_blocks)
            snapshots.take_slots(self.pool, inputs.reqs, inputs.chunks, inputs.seqs,
                                 self.spec.snapshot_every_tokens)
            self.move_kv()  # a snapshot slot taken above may have evicted one to the host
            masked = inputs.masked  # their masks are computed while the model runs
            masks = self.grammars.start([inputs.sampled[j][0].matcher for j in masked]) \
                if masked else None
            if lookahead.holdable(self, inputs):
                self.ahead = lookahead.launch(self, plan, inputs, masks=masks)
                self.consecutive_failed_steps = 0
                return None
            out = self.runner.run_step(inputs.seqs, keep_hidden=self.speculator.follows_target)
            out, scored = prompt_logprobs.split(out, inputs)  # rows scoring prompt tokens
            new_tokens, logprobs = pick_tokens(inputs, out.logits, self.sampler, masks,
                                               self.speculator.accept)
            saves = snapshots.take_held(self.pool, inputs, inputs.kept(new_tokens))
            if saves:  # verification rows' snapshots, their drafts judged
                self.move_kv()  # a slot taken may have evicted a snapshot: out before reuse
                self.runner.save_held(saves)
        except Exception as e:  # the step's requests fail; the engine goes on
            self.fail(reqs + enc.only(self, plan.encode, reqs), e)
            return None
        self.consecutive_failed_steps = 0
        return StepResult(inputs, out, new_tokens, logprobs, scored)

    def postprocess(self, plan: StepPlan, ran: StepResult) -> None:
        """What the step computed becomes each request's: kept positions, filed blocks, new
        tokens and the stops they reach."""
        inputs, new_tokens, logprobs = ran.inputs, ran.new_tokens, ran.logprobs
        kept = inputs.kept(new_tokens)
        num_prefill = num_decode = 0
        for req, chunk, n in zip(inputs.reqs, inputs.chunks, kept, strict=True):
            if req.is_finished:  # aborted while its step was held: its blocks are back
                continue
            req.num_computed_tokens += n
            num_prefill += chunk.num_tokens if chunk.is_prefill else 0
            if req.req_id in ran.prompt_logprobs:
                self.update(req).prompt_logprobs = ran.prompt_logprobs[req.req_id]
            if self.prefix_cache:
                file_full_blocks(self.pool, req, new_tokens.get(req.req_id, ()))
                snapshots.file_saves(self.pool, req)  # hybrids: after the blocks they follow
        for req, chunk in zip(inputs.reqs, inputs.chunks, strict=True):
            for token_id in new_tokens.get(req.req_id, []):
                if req.is_finished:  # a stop token in a verified row ends it there
                    break
                self._append_token(req, token_id, logprobs.get(req.req_id))
                num_decode += not chunk.is_prefill
        self.speculator.observe(ran.out, [(req, i, n) for i, (req, n)
                                          in enumerate(zip(inputs.reqs, kept, strict=True))
                                          if not req.is_finished])
        self._measure(num_decode, num_prefill)
        if len(plan.decode_ids) < sum(1 for r in self.running if not r.is_prefilling):
            # The budget cut decodes short: rotate so the skipped ones go first next step.
            done = set(plan.decode_ids)
            self.running.sort(key=lambda r: r.req_id in done)

    def ensure_blocks(self, req: Request, num_tokens: int) -> None:
        """Draw req's reserved blocks until its table holds num_tokens (a step's, or a pass
        of another model over the same table): never beyond its reservation."""
        need = blocks_for_tokens(num_tokens, self.pool.block_size)
        while len(req.block_table) < need:
            req.block_table.append(self.pool.draw(req.req_id))

    def _append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None) -> None:
        if not req.output_budget:  # max_tokens 0: the prompt alone (its logprobs), no token
            self.finish(req, RequestStatus.FINISHED_LENGTH)
            return
        answering = req.thought is None or req.thought.answering  # a grammar follows answers
        if req.thought is not None:
            if not answering and req.matcher is not None and token_id in req.stop_token_ids:
                req.thought.close()  # its answer is owed: the thought ends, not the request
            forced = req.thought.forced()
            if forced is not None and forced != token_id:  # the budget is spent: close it
                token_id, logprob = forced, None
            req.thought.observe(token_id)
        req.output_token_ids.append(token_id)
        upd = self.update(req)
        upd.new_token_ids.append(token_id)
        if logprob is not None:
            if upd.logprobs is None:
                upd.logprobs = []
            upd.logprobs.append(logprob)
        if req.matcher is not None and answering:
            error = advance(req.matcher, token_id)
            if error:
                self.finish(req, RequestStatus.FINISHED_ERROR, f"grammar: {error}")
                return
        # a constrained answer ends where its grammar does (its eos), never at another stop
        # token inside it: a half call or half JSON (docs/api.md, "JSON Schema keywords
        # under constrained decoding")
        if req.matcher.is_stopped() if req.matcher is not None and answering \
                else token_id in req.stop_token_ids:
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif req.num_tokens >= self.spec.context or (
                req.num_output_tokens >= req.output_budget and not growth.grow(self, req)):
            self.finish(req, RequestStatus.FINISHED_LENGTH)  # its budget, grown or not

    def _measure(self, num_decode: int, num_prefill: int) -> None:
        now = self.clock()
        dt = max(min(now - self._last_step_end, 1.0), 1e-6)  # idle gaps beyond 1 s don't count
        self._last_step_end = now
        a = _EWMA_ALPHA
        self.decode_tokens_per_sec += a * (num_decode / dt - self.decode_tokens_per_sec)
        self.prefill_tokens_per_sec += a * (num_prefill / dt - self.prefill_tokens_per_sec)

    # --- what comes in, what the model holds --------------------------------

    def apply(self, inbound: messages.ToEngine) -> None:
        """Take `inbound` in without stepping (intake.apply)."""
        intake.apply(self, inbound)

    def reset_kv(self, r: messages.ResetKv) -> str:
        """Re-plan the pool while nothing is in flight; "ok" or why not (intake.reset_kv)."""
        return intake.reset_kv(self, r)

    def new_pool(self, num_blocks: int) -> BlockPool:
        """KV blocks, and for hybrid models one linear-attention state slot per request and
        the prefix snapshots' slots; with kv.host_cache_mb the host tier behind them, its
        buffers allocated by the runners."""
        s = self.spec
        return BlockPool(num_blocks, s.block_size, s.bytes_per_block,
                         num_state_slots=s.num_state_slots, fixed_bytes=s.fixed_bytes,
                         num_snapshot_slots=s.num_snapshot_slots or 0,
                         host=self._host_tier(num_blocks))

    def _host_tier(self, num_blocks: int) -> HostTier | None:
        s = self.spec
        if not (s.host_cache_mb and s.prefix_cache):
            return None
        runners = [r for r in (self._runners.target, self._runners.draft) if r is not None]
        if not all(hasattr(r, "move_kv") for r in runners):
            if self.log is not None:
                self.log.warning("engine.host_tier_off", reason="the runner cannot copy KV")
            return None
        # per card: each rank keeps its own shard, as the ledger counts
        per_card = s.host_cache_mb * 2**20 // max(1, s.tp)
        block_bytes = sum(r.kv_bytes_per_block for r in runners) or s.bytes_per_block or 1
        blocks, snaps = host_tier_size(per_card, num_blocks, block_bytes,
                                       s.num_snapshot_slots or 0, s.fixed_bytes)
        for r in runners:
            r.allocate_host(blocks, snaps)  # type: ignore[attr-defined]
        if self.log is not None:
            self.log.info("engine.host_tier", host_blocks=blocks, host_snapshots=snaps,
                          mib=s.host_cache_mb)
        return HostTier(blocks, s.bytes_per_block or block_bytes, snaps, s.fixed_bytes) \
            if blocks else None

    def move_kv(self) -> None:
        """Make the host tier's queued copies (host_tier.py) on every runner now. If they
        fail, the tier is emptied (what it holds is not known), the blocks it was to
        restore leave the prefix index, and the requests restoring them fail with the error
        (copies in are queued only by admission, so none of them has run a step yet)."""
        host = self.pool.host
        if host is None:
            return
        moves = host.take_moves()
        if not moves:
            return
        try:
            for r in (self._runners.target, self._runners.draft):
                if r is not None:
                    r.move_kv(moves)  # type: ignore[attr-defined]
        except Exception as e:
            self.last_error = f"host tier: {type(e).__name__}: {e}"
            if self.log is not None:
                self.log.exception("engine.host_copy_failed")
            host.clear()
            blocks = {d for _, d in moves.blocks_in}
            slots = {d for _, d in moves.states_in}
            self.pool.unfile(sorted(blocks))
            snaps = self.pool.snapshots
            for req in list(self.waiting):
                if blocks.intersection(req.block_table) or (
                        snaps is not None and snaps.restoring(req.req_id) in slots):
                    self.finish(req, RequestStatus.FINISHED_ERROR, self.last_error)
            if snaps is not None:
                snaps.forget(sorted(slots))

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def status(self) -> messages.EngineStatus:
        return messages.EngineStatus(
            kv=self.pool.ledger(),
            in_flight=self.admission.num_in_flight,
            queued=self.admission.num_queued,
            running=len(self.running),
            paused=len(self.paused),
            decode_tokens_per_sec=round(self.decode_tokens_per_sec, 1),
            prefill_tokens_per_sec=round(self.prefill_tokens_per_sec, 1),
            admitting=self.admission.admitting,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_host_hit_tokens=self.prefix_host_hit_tokens,
            host_offloaded_blocks=self.pool.host.num_offloaded_blocks if self.pool.host else 0,
            host_restored_blocks=self.pool.host.num_restored_blocks if self.pool.host else 0,
            attention_backend=self.attention_backend,
            **self.speculator.figures(), **self.growth.figures(),
        )

    def close(self) -> None:
        """Stop what the runner started (tensor-parallel rank processes)."""
        self.grammars.close()
        self.runner.close()

    # --- the one place requests end ----------------------------------------

    def finish(self, req: Request, status: RequestStatus, reason: str = "") -> None:
        if req.is_finished:
            return
        req.status = status
        if self.requests.get(req.req_id) is req:  # not a refused duplicate of a live req_id
            del self.requests[req.req_id]
            self.admission.remove(req)
            self.speculator.release(req)
            self.pool.release(req.req_id)
            self.grammars.forget(req)  # it may have been waiting for its grammar to compile
            enc.forget(self, req)  # an image's tower part-way
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.paused.pop(req.req_id, None)
        upd = self.update(req)
        upd.finished = status.finish_reason
        upd.error = reason if status != RequestStatus.FINISHED_STOPPED else ""
        if req.thought is not None:
            upd.reasoning_tokens = req.thought.reasoning_tokens

    def refuse(self, req: Request, refusal: Refusal) -> None:
        self.finish(req, RequestStatus.FINISHED_REFUSED)
        upd = self.update(req)
        upd.refused_code = refusal.code
        upd.refused_message = refusal.message
        upd.retry_after_ms = refusal.retry_after_ms

    def update(self, req: Request) -> messages.RequestUpdate:
        """This step's update of `req`, with its usage counts so far (the daemon may end
        it first: a stop string)."""
        upd = self._updates.get(req.req_id)
        if upd is None:
            upd = self._updates[req.req_id] = messages.RequestUpdate(req_id=req.req_id)
        req.count_into(upd)
        return upd
