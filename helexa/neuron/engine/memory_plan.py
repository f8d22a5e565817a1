"""The KV pool as planned against what the runner really allocates.

Two checks at load (helexa/neuron/engine/model_runner.py):

- bytes per block: ``helexa plan``'s figure (the admission ledger counts with
  it), the bytes this runner's pool really takes per block, and each other
  tensor-parallel rank's must be one number, else the ledger would promise
  memory the pool does not have (or waste what it has). A mismatch fails the
  load naming the three.
- on CUDA (every tensor-parallel rank), the pool is sized from memory measured
  after a worst-case step rather than from arithmetic alone: the step's peak
  temporaries and a margin are kept free, the planned block count
  (kv_budget_mb's) is the ceiling, and a pool too small for one request of the
  configured context refuses to load with the arithmetic; at tp > 1 each rank
  fits its own card and the pool is the least of them (pool_probe.py). On CPU
  the planned budget stands.
"""

from __future__ import annotations

MIB = 2**20
# kept free beside the measured step (whose peak includes the graphs' pool): the caching
# allocator's fragmentation and what the probe step does not reach (the sampler's
# temporaries, for one). At tp > 1 what NCCL allocated for the probe's collectives is held
# when free memory is read (so are the CUDA context and the all-reduce workspace); what it
# allocates later, for a collective first run after load, is this margin's too.
MARGIN_FRACTION = 0.03  # of device memory
MARGIN_MIN_BYTES = 256 * MIB


class KvPlanError(ValueError):
    """The pool as planned and as allocated disagree, or the context no longer fits."""


def check_bytes_per_block(plan: int, runner: int, ranks: list[int]) -> None:
    """KvPlanError unless the plan's (0 = not given: skipped), this runner's and every
    other rank's bytes per block are equal."""
    if any(r != runner for r in ranks) or (plan and runner != plan):
        raise KvPlanError(
            f"KV bytes per block disagree: helexa plan's {plan or 'not given'}, this "
            f"runner's {runner}, tensor-parallel ranks' {ranks or 'none'} (the ledger must "
            "count what the pool holds)")


def fit_blocks(*, planned_blocks: int, bytes_per_block: int, block_size: int, context: int,
               free_bytes: int, total_bytes: int, step_peak: int) -> int:
    """Blocks the device can hold beside the worst step's temporaries and the margin, at
    most the planned count; KvPlanError with the arithmetic when one request of
    ``context`` tokens (0 = unchecked) would no longer fit."""
    margin = max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * total_bytes))
    usable = free_bytes - step_peak - margin
    blocks = min(planned_blocks, max(0, usable // bytes_per_block))
    need = -(-context // block_size) if context else 1
    if blocks < need:
        raise KvPlanError(
            f"KV pool does not fit: {free_bytes / MIB:,.0f} MiB free after loading − "
            f"{step_peak / MIB:,.0f} MiB peak of a worst-case step − {margin / MIB:,.0f} MiB "
            f"margin = {usable / MIB:,.0f} MiB = {blocks} blocks of {bytes_per_block:,} B, "
            f"but one request of the configured context ({context} tokens) needs {need} "
            "blocks: lower the context or kv_budget_mb's share, or use a smaller kv_dtype")
    return blocks
