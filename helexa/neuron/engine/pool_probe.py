"""The CUDA pool sized by measurement (memory_plan.py says why): the model runner's probe of
a worst-case step, on a probe pool, before its real pool is allocated; at tp > 1 the same
probe on every rank, in lockstep, and the least rank's fit for all; and a pool switch (a
kv_dtype profile) sized the same way, or undone where it fails. The device's memory is read
through the runner's meter (device_memory.py)."""

from __future__ import annotations

import functools
from typing import Any

import structlog
import torch

from helexa.checkpoint.memory import FI_WRAPPER_INT_BYTES
from helexa.checkpoint.vision_shape import read_vision_shape
from helexa.neuron.engine import memory_plan, tp_measure
from helexa.neuron.engine.seq_input import SeqInput
from helexa.neuron.engine.tp_messages import TpMeasure, TpMeasured

log = structlog.get_logger(component="engine")


def measured_blocks(runner: Any, planned: int, kv_dtype: str, context: int) -> int:
    """This rank's card: on a probe pool, the peaks of a worst-case step and (graphs hold a
    pool of their own) a max_num_seqs-row decode; the pool is what is left (fit_blocks).
    At tp > 1 every rank runs it at once (the steps' collectives): measure_group."""
    meter, bs, (prefill, rows) = runner.meter, runner.block_size, _probe_shape(runner)
    runner._reset_own_kv(probe_blocks(runner), kv_dtype)
    bytes_per_block = runner.kv_bytes_per_block + runner.extra_bytes_per_block
    slots = max(1, runner.num_state_slots)  # hybrids: any slots will do for a probe
    # a step's peak: the worst of its shapes - one long prefill beside rows - 1 decode rows;
    # two prefills (a hybrid's varlen path copies q, k, v); and a step of at most
    # SYNC_FREE_MAX_ROWS rows (a MoE block's masked form holds every expert's outputs)
    peak = max(meter.peak_bytes(functools.partial(runner.execute, s))
               for s in probe_steps(prefill, rows, bs, slots))
    held = 0  # what stays allocated beside any step's activations
    decoded, sampled = decode_peaks(runner, *probe_rows(runner, -(-prefill // bs), rows, slots))
    if runner.tp_rank == 0:  # the rank that schedules (and samples)
        runner.scoring_room = scoring_room(runner, peak, sampled)
    peak = max(peak, sampled)
    if graphs := runner.backend.executor.graph_sizes():  # captured at load, a pool apart
        held += decoded  # the graphs' pool: the largest decode step's activations
        # each graph's FlashInfer wrapper (its int workspace), made at capture after the
        # pool (none where a quantised pool's graphs run the torch path's kernels); their
        # one page-index buffer grows with the pool (graph_pool_bytes says so)
        if not getattr(runner.backend.attention, "torch_path", ""):
            held += len(graphs) * FI_WRAPPER_INT_BYTES
        bytes_per_block += 4 * max(graphs)
    # the tower's activations or the text step's; beside either the embedding cache and the
    # graphs' pool (an image step runs eagerly while the captured graphs hold theirs)
    vision = getattr(runner, "vision", None)
    peak = max(peak, encoder_peak(runner)) + held + (vision.max_cached_bytes if vision else 0)
    if runner.tp_size > 1:  # the lookahead's broadcast of rank 0's tokens, the one collective
        # serving runs that the probe's steps do not: what NCCL makes for it on first use
        # is then held when free memory is read
        runner._device_tokens(torch.zeros(rows, dtype=torch.long))
    runner._allocate_kv([], 0, None)  # free the probe pool
    free, total = meter.free_bytes()
    blocks = memory_plan.fit_blocks(planned_blocks=planned, bytes_per_block=bytes_per_block,
                                    block_size=bs, context=context, free_bytes=free,
                                    total_bytes=total, step_peak=peak)
    log.info("engine.kv_pool_measured", planned_blocks=planned, blocks=blocks,
             free_mib=free // 2**20, step_peak_mib=peak // 2**20, tp_rank=runner.tp_rank)
    return blocks


def _probe_shape(runner: Any) -> tuple[int, int]:
    """The probe's prefill tokens and decode rows: a step of max_batched_tokens over
    max_num_seqs rows."""
    rows = max(1, runner.max_num_seqs)
    return max(2, runner.max_batched_tokens - (rows - 1)), rows


def probe_blocks(runner: Any) -> int:
    """The probe pool's blocks: the long prefill's, a verification row's for each decode
    row (probe_rows), and one spare."""
    prefill, rows = _probe_shape(runner)
    bs: int = runner.block_size
    return -(-prefill // bs) + rows * _row_blocks(runner) + 1


def _row_blocks(runner: Any) -> int:
    """Blocks of one decode row of the probe: those of a verification row of spec_k drafts
    after one token already computed (one block without speculation)."""
    return -(-(2 + runner.spec_k) // runner.block_size) if runner.spec_k else 1


def probe_rows(runner: Any, first: int, rows: int, slots: int
               ) -> tuple[list[SeqInput], list[SeqInput]]:
    """A max_num_seqs-row decode step on blocks from ``first``, and where the model may
    speculate (spec_k, the most of any speculation it runs) the same rows verifying spec_k
    drafts each: one token computed, the last and its drafts scored (spec_k + 1 logits a
    row, as engine/step_inputs.py lays a verification out); [] where it does not."""
    per = _row_blocks(runner)
    tables = [list(range(first + i * per, first + (i + 1) * per)) for i in range(rows)]
    decode = [SeqInput([0], 0, t[:1], True, i % slots) for i, t in enumerate(tables)]
    n = runner.spec_k + 1
    verify = [SeqInput([0] * n, 1, t, True, i % slots, num_logits=n)
              for i, t in enumerate(tables)] if runner.spec_k else []
    return decode, verify


def load_blocks(runner: Any, planned: int, kv_dtype: str, context: int) -> int:
    """The pool a runner allocates at load: measured (one rank), the probe's until the
    group has formed and measures (tp > 1: pool_at_load; so a plan that over-counts its
    card cannot fail the load before the measurement), or the plan's (nothing measures)."""
    if not runner.measure_pool:
        runner.scoring_room = scoring_room(runner, *estimated_peaks(runner))
        return planned
    if runner.tp_size == 1:
        return measured_blocks(runner, planned, kv_dtype, context)
    return probe_blocks(runner)


def pool_at_load(runner: Any, planned: int, kv_dtype: str, context: int) -> None:
    """Rank 0, once the group has formed: at tp > 1 measured, every rank's pool of the
    group's measured blocks; then the graphs captured over it (every rank's)."""
    if runner._tp is not None and runner.measure_pool:
        _make_pool(runner, planned, kv_dtype, context)
    else:
        runner._capture_graphs()


def measure_group(runner: Any, planned: int, kv_dtype: str, context: int) -> int:
    """Rank 0 at tp > 1: every rank measures its own card (tp_measure.measure; this rank's
    steps are not sent, each rank runs them itself); the fewest blocks any rank holds."""
    msg = TpMeasure(planned, kv_dtype, context, runner.num_state_slots, runner.max_num_seqs,
                    runner.max_batched_tokens)
    ranks = tp_measure.measure(runner._tp, msg,
                               lambda: measured_blocks(runner, planned, kv_dtype, context))
    log.info("engine.kv_pool_group", planned_blocks=planned, blocks=min(ranks), ranks=ranks)
    return min(ranks)


def measure_as_rank(runner: Any, msg: TpMeasure) -> TpMeasured:
    """A worker rank's TpMeasure: the probe's steps its own and eager, as rank 0 runs them
    (each rank's executor decides: no graph is captured outside the capture steps), its
    fit or why not; its pool follows as TpResetKv."""
    runner.num_state_slots = msg.num_state_slots or runner.num_state_slots
    set_width(runner, msg.max_num_seqs, msg.max_batched_tokens)
    try:
        return TpMeasured(measured_blocks(runner, msg.num_blocks, msg.kv_dtype, msg.context))
    except memory_plan.KvPlanError as e:  # after every collective: the group is in step
        return TpMeasured(error=str(e))
    except Exception as e:  # noqa: BLE001 - rank 0 names it; this rank leaves the group
        return TpMeasured(error=f"{type(e).__name__}: {e}", broken=True)


def probe_steps(prefill: int, rows: int, bs: int, slots: int) -> list[list[SeqInput]]:
    """The probe's steps of ``prefill + rows - 1`` tokens (blocks from 0, decode rows' after
    the prefill's): one prefill beside rows - 1 decode rows, two prefills beside rows - 2
    (where both fit), and one of at most SYNC_FREE_MAX_ROWS tokens (moe_experts)."""
    from helexa.kernels.moe_experts import SYNC_FREE_MAX_ROWS

    end = -(-prefill // bs)

    def decodes(n: int, first_slot: int) -> list[SeqInput]:
        return [SeqInput([0], 0, [end + 1 + i], True, (first_slot + i) % slots)
                for i in range(n)]

    steps = [[SeqInput([0] * prefill, 0, list(range(end)), True, 0)] + decodes(rows - 1, 1)]
    half = prefill // 2
    if rows >= 2 and half >= 1:
        steps.append([SeqInput([0] * half, 0, list(range(-(-half // bs))), True, 0),
                      SeqInput([0] * (prefill - half), 0,
                               list(range(-(-half // bs), -(-half // bs)
                                          + -(-(prefill - half) // bs))), True, 1 % slots)]
                     + decodes(rows - 2, 2))
    few = min(prefill, SYNC_FREE_MAX_ROWS)
    if few < prefill:
        steps.append([SeqInput([0] * few, 0, list(range(-(-few // bs))), True, 0)])
    return steps


def decode_peaks(runner: Any, decode: list[SeqInput], verify: list[SeqInput] | None = None
                 ) -> tuple[int, int]:
    """A decode step of ``decode``'s rows, run once: its forward's peak, and the bytes held
    at the peak of any step of those rows: the larger of that; its logits with what
    sampling them takes beyond (fp32 copies, a sort for top-p, logprobs; ~50 B a logit with
    CUDA's sort) for rows that ask for all of it; and, given ``verify`` (probe_rows), a
    verification step's forward, or its logits, the drafter's distributions beside them and
    what verifying sampled drafts takes (speculative/verify.py)."""
    from helexa.neuron.engine.messages import SamplingParams
    from helexa.neuron.engine.sampler import Sampler, SamplingState
    from helexa.neuron.engine.speculative.verify import Row, verify_rows

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.01,
                            presence_penalty=0.5, repetition_penalty=1.1, logprobs=True,
                            top_logprobs=20)
    held: dict[str, Any] = {}

    def step(seqs: list[SeqInput]) -> None:
        held["logits"] = runner.execute(seqs)

    peak = runner.meter.peak_bytes(lambda: step(decode))
    logits = held.pop("logits")
    if runner.tp_rank > 0:  # only rank 0 samples (the LM head gathers the logits there)
        return peak, max(peak, runner.meter.peak_bytes(lambda: step(verify)) if verify else 0)
    states = [SamplingState.for_request(params, [0], []) for _ in decode]
    sampling = runner.meter.peak_bytes(lambda: Sampler()(logits, states))
    most = max(peak, int(logits.nbytes) + sampling)
    if not verify:
        return peak, most
    del logits
    forward = runner.meter.peak_bytes(lambda: step(verify))
    logits, k = held.pop("logits"), runner.spec_k  # [rows * (k + 1), vocab]
    # penalties and logprobs are never speculated (verify.py): the drafts sampled as such
    drafted = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.01)
    q = torch.full((len(verify), k, logits.shape[1]), 1.0 / logits.shape[1],
                   device=logits.device)  # a drafter's distributions, held by it meanwhile
    rows = [Row(logits[i * (k + 1):(i + 1) * (k + 1)], [0] * k, q[i],
                SamplingState.for_request(drafted, [0], [])) for i in range(len(verify))]
    checking = runner.meter.peak_bytes(lambda: verify_rows(rows))
    return peak, max(most, forward, int(logits.nbytes + q.nbytes) + checking)


def scoring_room(runner: Any, forward: int, sampled: int) -> int:
    """The bytes a step's prompt-logprobs rows may take (prompt_logprobs.py says why): the
    prefill step's peak ``forward`` less the stream its layers pass on and the sampled
    rows' peak ``sampled``."""
    stream: int = runner.max_batched_tokens * 3 * runner.config.hidden_size * runner.dtype.itemsize
    return max(0, forward - stream - sampled)


def estimated_peaks(runner: Any) -> tuple[int, int]:
    """Where nothing measures (CPU): the probe's prefill step's activations and its sampled
    rows', as step_memory estimates them for `helexa plan`."""
    from helexa.checkpoint.shape import read_model_shape
    from helexa.checkpoint.step_memory import SAMPLING_BYTES_PER_LOGIT, step_activations

    prefill, rows = _probe_shape(runner)
    try:
        shape = read_model_shape(runner.hf_config)
    except Exception:  # noqa: BLE001 - a config it cannot read: 4 rows a slot (no room)
        return 0, 0
    step = step_activations(shape, runner.tp_size, prefill, runner.dtype.itemsize, rows,
                            cuda=False)
    return step.tokens * step.per_token, rows * runner.vocab_size * (4 + SAMPLING_BYTES_PER_LOGIT)


def encoder_peak(runner: Any) -> int:
    """A model with a vision tower: the tower's activations over the largest image its
    processor makes (the plan's estimate, checkpoint/vision_shape.py), which the probe's
    text-only steps never reach. The tower runs before the text model in its step and its
    activations are freed first, so a step peaks at the larger of the two (as helexa plan
    counts it); 0 for a model that takes no images."""
    vision = getattr(runner, "vision", None)
    if vision is None or not vision.takes_images:
        return 0
    shape = read_vision_shape(runner.hf_config)
    if shape is None:
        return 0
    return shape.encoder_activation_bytes(vision.processor.max_patches, runner.tp_size,
                                          runner.dtype.itemsize)


def switch_pool(runner: Any, num_blocks: int, kv_dtype: str, context: int = 0,
                num_state_slots: int = 0, max_num_seqs: int = 0,
                max_batched_tokens: int = 0) -> None:
    """A new pool of ``kv_dtype`` without touching the weights (old contents dropped), every
    rank's; on CUDA measured again as at load, on every rank (``num_blocks`` the ceiling,
    ``context`` the one request it must hold), the graphs captured over it; a hybrid's
    ``num_state_slots`` (one a request in flight) carved anew where given, and the runner
    rebuilt for ``max_num_seqs`` decode rows and ``max_batched_tokens`` a step where given
    (a wider profile: set_width; the pool measured beside such a step). If any part
    fails (the device's memory, a kernel, a rank's fit), the pool it had is made again with
    its graphs, slots and width on every rank, so the engine serves on as before, and the
    error is raised; unless the tensor-parallel group failed (a rank lost mid-probe): the
    model must restart."""
    previous = (runner.num_blocks, runner.kv_dtype, runner.num_state_slots,
                runner.max_num_seqs, runner.max_batched_tokens)
    try:
        runner.num_state_slots = num_state_slots or runner.num_state_slots
        set_width(runner, max_num_seqs, max_batched_tokens)
        _make_pool(runner, num_blocks, kv_dtype, context if runner.measure_pool else None)
    except Exception:
        if runner.failed:  # the group is gone: no pool to make again
            raise
        runner._allocate_kv([], 0, None)  # whatever was half made goes first
        if runner.device.type == "cuda":
            torch.cuda.empty_cache()
        runner.num_state_slots = previous[2]
        set_width(runner, *previous[3:])
        _make_pool(runner, *previous[:2], None)  # its size was measured when it was made
        raise


def set_width(runner: Any, max_num_seqs: int, max_batched_tokens: int) -> None:
    """The runner's decode rows and step tokens from its next pool on (0: as they are),
    with no request running: what depends on them follows (the executor's graphs, dropped
    with their memory and captured again at the new width over the next pool; a hybrid's
    decode-row state buffers, made with it; the probe's step, measured beside it)."""
    rows = max_num_seqs or runner.max_num_seqs
    runner.max_batched_tokens = max_batched_tokens or runner.max_batched_tokens
    if rows == runner.max_num_seqs:
        return
    if runner.device.type == "cuda":  # the old graphs' last replays done before they go
        torch.cuda.synchronize(runner.device)
    runner.max_num_seqs = rows
    runner.backend.executor.set_graph_rows(rows)


def _make_pool(runner: Any, num_blocks: int, kv_dtype: str, measure: int | None) -> None:
    """Every rank's pool of ``num_blocks`` (measured on every rank for one request of
    ``measure`` tokens where not None) and the graphs over it."""
    if measure is not None:
        num_blocks = (measured_blocks(runner, num_blocks, kv_dtype, measure) if runner._tp is None
                      else measure_group(runner, num_blocks, kv_dtype, measure))
    if runner._tp is not None:  # every rank at rank 0's width (set_width), restored ones too
        runner._tp.reset_kv(num_blocks, kv_dtype, runner.num_state_slots, runner.max_num_seqs,
                            runner.max_batched_tokens)
    runner._reset_own_kv(num_blocks, kv_dtype)
    runner._capture_graphs()  # the old graphs held the old pools
