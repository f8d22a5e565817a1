"""The prepared GPU check's ``widen`` stage (bench/gpu_check.py runs it last): a loaded
model rebuilt for more decode rows and a larger step without reloading its weights, as a
wider profile's switch does (the engine's ResetKv with max_slots / max_batched_tokens:
helexa/neuron/engine/pool_probe.py switch_pool, set_width), then a widen the card cannot
hold, which must leave the model serving at the width it had.

On a small bf16 dense checkpoint (the check's ``dense``: a GQA group of 6), one runner
loaded at the old width (``widths``), the re-plans sent through EngineCore as the daemon
sends them, each run's steps driven on the runner (so a batch is exactly as wide as
asked); each run's greedy tokens over 16 steps (the dry run: its ``decode_tokens``):

- (a) the widen to the new rows and step tokens answers "ok" (``widened.answer``), and
  the executor then holds a CUDA graph for every size 1..new rows
  (``widened.captured_after``; the ``kernels.cuda_graph_captured`` events logged
  meanwhile, ``widened.captured_logged``);
- (b) CUDA only: the private memory pools the graphs captured at load hold
  (``graph_pools_load``: the caching allocator's segments by pool id, bytes each) are all
  given back by the widen (none among ``widened.graph_pools_after``), and
  ``torch.cuda.memory_reserved()`` after it (``widened.reserved_after``) is at most that
  at load (``reserved_load``) plus the new graph pool as helexa plan estimates it
  (checkpoint/memory.py graph_pool_bytes: ``graph_pool_estimate``; a loose bound: most of
  the estimate is FlashInfer's graph scratch, which the widen keeps, so only the pool ids
  show the old graphs' pool went);
- (c) a batch of the new rows decodes the same greedy tokens (``tokens.wide``) as a
  runner loaded at that width with graphs off (``tokens.eager``), and its first rows as
  this runner did at the old width before the widen (``tokens.old``), save where they
  part at a bf16 near tie: the old run's top-two logit gap there under NEAR_TIE (its
  matmuls ran 4 rows, the wide ones 12, and cuBLAS may choose otherwise per row count;
  ``old_gap_at_divergence``);
- (d) a widen to a step the card cannot hold (a max_batched_tokens whose probe pool alone
  is twice the card) is refused with the engine's reason (``failure.answer``), the runner
  keeps the new rows and their graphs, the memory reserved is within (b)'s bound, and the
  same batch decodes the same tokens as before the refusal (``tokens.after_failure``).

On CPU (``--dry-run``) no graph is captured (``graphs`` says so); the widen, the token
comparisons and the refusal run the same path, the pool measured through a stand-in card
(StandInCard) whose refusal of a step too large stands in for CUDA's out-of-memory. Each
check is a boolean under ``checks``; those that do not hold are listed in ``failed`` (the
stage then counts as failed; an error part-way: ``error``, the figures before it kept).
Beside the comparisons, ``first_divergence``: the first step where two runs' tokens differ
(a bf16 near tie on random weights flips late, if at all; a wrong graph at the new width
differs from the first steps).
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BLOCK = 16


def widths(dry: bool) -> tuple[int, int, int, int]:
    """The decode rows the runner is loaded for and widened to, and a step's tokens
    likewise: on the GPU 4 -> 12 rows and 512 -> 1024 tokens; in
    the dry run fewer of each (a bf16 step on CPU is slow: the stage takes seconds)."""
    return (2, 5, 64, 128) if dry else (4, 12, 512, 1024)


class StandInCard:
    """The dry run's memory meter (CPU has none: device_memory.py): 1 GiB free of 2, a
    step's peak 1 MiB, and a probe for a step of more than ``max_tokens`` tokens refused
    before it runs, as CUDA's allocator refuses a step too large for the card. ``runner``
    is set once the runner is loaded (its load's probe is within the card)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.runner: Any = None

    def __call__(self, device: torch.device, tp_rank: int) -> StandInCard:
        return self  # the one rank's meter

    def peak_bytes(self, step: Callable[[], object]) -> int:
        tokens = getattr(self.runner, "max_batched_tokens", 0)
        if tokens > self.max_tokens:
            raise RuntimeError(f"out of memory: the dry run's stand-in card holds a step of "
                               f"{self.max_tokens} tokens, not {tokens}")
        step()
        return 2**20

    def free_bytes(self) -> tuple[int, int]:
        return 2**30, 2**31


def reserved(device: torch.device) -> int | None:
    """The bytes the caching allocator holds once what nothing references is given back
    (a graph pool something still holds stays); None off CUDA."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.memory_reserved(device))


def graph_pools(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's private pools (CUDA graphs' memory) and the bytes each
    holds, by pool id; None off CUDA. Read right after `reserved`, which gave back what
    nothing references."""
    if device.type != "cuda":
        return None
    pools: dict[str, int] = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if seg.get("device") == device.index and pool != (0, 0):
            key = f"{pool[0]}:{pool[1]}"
            pools[key] = pools.get(key, 0) + int(seg["total_size"])
    return pools


def captured(runner: Any) -> list[int]:
    """The decode batch sizes the runner's executor holds a CUDA graph of (none on CPU)."""
    return sorted(getattr(runner.backend.executor, "_graphs", {}))


def greedy(runner: Any, prompts: list[list[int]], n: int, per: int, group: int,
           gaps: list[list[float]] | None = None) -> list[list[int]]:
    """The prompts prefilled ``group`` at a time (the old width's rows: every run's prefill
    steps the same, and each within the old step's tokens), then ``n - 1`` decode steps of
    all the rows together: each row's ``n`` greedy tokens (and in ``gaps`` each choice's
    top-two logit gap, row by row)."""
    from helexa.neuron.engine.seq_input import SeqInput

    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    out: list[list[int]] = []
    for first in range(0, len(prompts), group):
        rows = range(first, min(first + group, len(prompts)))
        logits = runner.execute([SeqInput(prompts[i], 0, tables[i], True, i) for i in rows])
        out += [[int(t)] for t in logits.argmax(-1).tolist()]
        _gaps(logits, gaps, first)
    lens = [len(p) for p in prompts]
    for _ in range(n - 1):
        logits = runner.execute([SeqInput([row[-1]], lens[i], tables[i], True, i)
                                 for i, row in enumerate(out)])
        lens = [x + 1 for x in lens]
        for row, tok in zip(out, logits.argmax(-1).tolist(), strict=True):
            row.append(int(tok))
        _gaps(logits, gaps, 0)
    return out


def _gaps(logits: torch.Tensor, gaps: list[list[float]] | None, first: int) -> None:
    if gaps is None:
        return
    top = logits.float().topk(2, dim=-1).values
    for i, gap in enumerate((top[:, 0] - top[:, 1]).tolist()):
        while len(gaps) <= first + i:
            gaps.append([])
        gaps[first + i].append(float(gap))


# A top-two logit gap under this (four bf16 steps at the logits' size here) is a near tie:
# a batch of other width may flip it without anything being wrong.
NEAR_TIE = 0.25


def first_diff_at(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(row, step) of the first decode step at which a row's tokens differ, else None."""
    found = [(step, row) for row, (ra, rb) in enumerate(zip(a, b, strict=True))
             for step, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y]
    return (min(found)[1], min(found)[0]) if found else None


def first_diff(a: list[list[int]], b: list[list[int]]) -> int | None:
    """The first decode step at which any row's tokens differ (None: all the same)."""
    steps = [next((i for i, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), None)
             for ra, rb in zip(a, b, strict=True)]
    found = [s for s in steps if s is not None]
    return min(found) if found else None


class Widen:
    """One run of the stage: its sizes, the checkpoint, and the record so far (``out``,
    put on record after each part by ``record``: a run the time bound kills mid-stage
    keeps what it measured)."""

    def __init__(self, ctx: dict[str, Any], record: Callable[[dict[str, Any]], None]) -> None:
        s = ctx["sizes"]
        self.dev = torch.device(ctx["device"])
        self.dry = self.dev.type != "cuda"
        self.old_rows, self.new_rows, self.old_tokens, self.new_tokens = widths(self.dry)
        self.path: Path = ctx["dense"]
        # few steps on the GPU too: a bf16 near tie flips more often the longer it runs
        self.n = s["decode_tokens"] if self.dry else 16
        self.prompts = [[(13 * i + 7 * j) % 400 + 1 for j in range(s["prompt"])]
                        for i in range(self.new_rows)]
        self.context = s["prompt"] + self.n + 8
        self.per = -(-self.context // BLOCK)
        self.blocks = self.new_rows * self.per + 1  # the ceiling: every row of the widest
        self.record = record
        self.out: dict[str, Any] = {"rows_before": self.old_rows,
                                    "tokens_before": self.old_tokens}
        self.tokens: dict[str, list[list[int]]] = {}
        self.gaps: dict[str, list[list[float]]] = {}  # each run's top-two logit gaps, by row

    def load(self, rows: int, tokens: int, graphs: bool) -> Any:
        from helexa.neuron.engine.model_runner import ModelRunner

        card = StandInCard(max_tokens=4 * self.new_tokens) if self.dry else None
        runner = ModelRunner(self.path, device=str(self.dev), dtype="bfloat16",
                             num_blocks=self.blocks, block_size=BLOCK, max_num_seqs=rows,
                             max_batched_tokens=tokens, cuda_graphs=graphs,
                             context=self.context, memory_meter=card)
        if card is not None:
            card.runner = runner
        return runner

    def decode(self, runner: Any, name: str, rows: int) -> None:
        self.gaps[name] = []
        self.tokens[name] = greedy(runner, self.prompts[:rows], self.n, self.per,
                                   self.old_rows, self.gaps[name])
        self.out["tokens"] = self.tokens
        self.record(self.out)

    def replan(self, core: Any, rows: int, tokens: int) -> dict[str, Any]:
        """The engine's ResetKv for ``rows`` and ``tokens``, as the daemon sends it: its
        answer, the graph sizes captured meanwhile (their log events), its seconds, and
        the runner as it is after."""
        from structlog.testing import capture_logs

        from helexa.neuron.engine import messages as m

        runner, t = core.runner, time.perf_counter()
        with capture_logs() as logs:
            answer = core.step(m.ToEngine(reset_kv=m.ResetKv(
                num_blocks=self.blocks, kv_dtype=runner.kv_dtype,
                bytes_per_token=core.spec.bytes_per_token, context=self.context,
                max_slots=rows, max_batched_tokens=tokens))).kv_reset
        return {"answer": answer, "secs": time.perf_counter() - t,
                "captured_logged": sorted(e["rows"] for e in logs
                                          if e.get("event") == "kernels.cuda_graph_captured"),
                "rows_after": runner.max_num_seqs, "tokens_after": runner.max_batched_tokens,
                "blocks_after": runner.num_blocks, "captured_after": captured(runner),
                "reserved_after": reserved(self.dev), "graph_pools_after": graph_pools(self.dev)}

    def widened(self) -> None:
        """(a), (b), (d) on one runner loaded at the old width, its tokens at each point."""
        from helexa.neuron.engine import messages as m
        from helexa.neuron.engine.engine_core import EngineCore
        from helexa.neuron.engine.spec import EngineSpec

        out, t = self.out, time.perf_counter()
        runner = self.load(self.old_rows, self.old_tokens, True)
        out["load_s"] = time.perf_counter() - t
        core = EngineCore(EngineSpec(
            model_id="gpu-check-widen", num_blocks=runner.num_blocks, block_size=BLOCK,
            devices=[str(self.dev)], context=self.context, prefix_cache=False,
            limits=m.Limits(max_slots=self.old_rows, max_batched_tokens=self.old_tokens)),
            runner)
        try:
            executor = runner.backend.executor
            out["backend"] = runner.attention_backend
            out["graphs"] = (f"captured: {executor.describe()}" if executor.graph_sizes()
                             else f"off on {self.dev.type}: none captured, the steps run "
                                  "eagerly")
            out["captured_before"] = captured(runner)
            out["reserved_load"] = reserved(self.dev)
            out["graph_pools_load"] = graph_pools(self.dev)
            self.decode(runner, "old", self.old_rows)
            out["widened"] = self.replan(core, self.new_rows, self.new_tokens)
            self.record(out)
            self.decode(runner, "wide", self.new_rows)
            # (d): a step whose probe pool alone is twice the card; on CPU the stand-in's
            per_token = runner.kv_bytes_per_block // BLOCK
            huge = 2**16 if self.dry else max(
                2**18, 2 * torch.cuda.get_device_properties(self.dev).total_memory // per_token)
            out["failure"] = {"max_batched_tokens": huge,
                              **self.replan(core, self.new_rows, huge)}
            self.record(out)
            self.decode(runner, "after_failure", self.new_rows)
        finally:
            core.close()  # the runner with it

    def near_tie_at_most(self, got: list[list[int]], ref: list[list[int]], name: str) -> bool:
        """The tokens agree, or part first where the reference run's choice was a near tie
        (its gap recorded as ``<name>_gap_at_divergence``)."""
        at = first_diff_at(got, ref)
        if at is None:
            return True
        row, step = at
        gaps = self.gaps.get(name) or []
        gap = gaps[row][step] if row < len(gaps) and step < len(gaps[row]) else None
        self.out[f"{name}_gap_at_divergence"] = gap
        return gap is not None and gap < NEAR_TIE

    def eager(self) -> None:
        """(c)'s yardstick: a load at the new width with graphs off."""
        t = time.perf_counter()
        runner = self.load(self.new_rows, self.new_tokens, False)
        self.out["eager_load_s"] = time.perf_counter() - t
        try:
            self.decode(runner, "eager", self.new_rows)
        finally:
            runner.close()

    def checks(self) -> dict[str, bool]:
        out, tok = self.out, self.tokens
        widen, failure = out["widened"], out["failure"]
        sizes = [] if self.dry else list(range(1, self.new_rows + 1))  # CUDA: every size
        out["first_divergence"] = {
            "wide_vs_eager": first_diff(tok["wide"], tok["eager"]),
            "wide_vs_old": first_diff(tok["wide"][:self.old_rows], tok["old"]),
            "after_failure_vs_wide": first_diff(tok["after_failure"], tok["wide"])}
        checks = {
            "graphs_at_load": out["captured_before"] == sizes[:self.old_rows],
            "widened": widen["answer"] == "ok" and widen["rows_after"] == self.new_rows
            and widen["tokens_after"] == self.new_tokens,
            "graphs_at_new_rows": widen["captured_after"] == sizes
            and widen["captured_logged"] == sizes,
            "wide_matches_eager": tok["wide"] == tok["eager"],
            "wide_matches_old_rows": self.near_tie_at_most(tok["wide"][:self.old_rows],
                                                           tok["old"], "old"),
            "failure_refused": failure["answer"].startswith("re-planning the pool failed"),
            "failure_kept_width": failure["rows_after"] == self.new_rows
            and failure["tokens_after"] == self.new_tokens and failure["captured_after"] == sizes,
            "after_failure_matches": tok["after_failure"] == tok["wide"]}
        if out["reserved_load"] is not None:  # (b), CUDA only
            from helexa.checkpoint.memory import graph_pool_bytes
            from helexa.checkpoint.shape import read_model_shape

            shape = read_model_shape(self.path / "config.json")
            est = {k: graph_pool_bytes(shape, 1, rows, "bfloat16", self.blocks)
                   for k, rows in (("old", self.old_rows), ("new", self.new_rows))}
            bound = out["reserved_load"] + est["new"]
            out["graph_pool_estimate"] = est
            out["reserved_growth"] = widen["reserved_after"] - out["reserved_load"]
            old_pools = set(out.get("graph_pools_load") or {})
            checks["old_graph_pools_released"] = bool(old_pools) and not (
                old_pools & set(widen.get("graph_pools_after") or {}))
            checks["reserved_within_load_plus_new_pool"] = widen["reserved_after"] <= bound
            checks["reserved_after_failure_within"] = failure["reserved_after"] <= bound
        return checks


def stage_widen(ctx: dict[str, Any],
                record: Callable[[dict[str, Any]], None] = lambda partial: None
                ) -> dict[str, Any]:
    """The stage (the module's docstring): its record, the checks that did not hold in
    ``failed``; an error part-way is recorded beside the figures measured before it."""
    w = Widen(ctx, record)
    try:
        w.widened()
        gc.collect()  # the widened runner's weights and pool go before the next load
        w.eager()
        w.out["checks"] = checks = w.checks()
        if failed := [k for k, ok in checks.items() if not ok]:
            w.out["failed"] = failed
    except Exception as e:  # noqa: BLE001 - reported, not raised: the figures so far stay
        w.out.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=6),
                     failed=["error"])
    return w.out
