"""ModelRunner: runs one engine step of the model over the paged KV pool.

The engine hands it a list of SeqInput (each sequence's new tokens, how many
of its tokens are already cached, and its block table). The runner lays the
batch out flat — single-token (decode) rows first, then prefill chunks — as
a StepPlan (token ids, positions, slot mapping, block tables); its device
(helexa/kernels/backends/: torch, cpu or cuda, chosen at load) has an attention backend
that turns the plan into its own metadata and owns the KV pool, and a step executor
that runs the step; hybrid models' Gated DeltaNet state backend
(helexa/kernels/backends/gdn.py) builds the step's state metadata, which the executor
hands to the model's forward. The pools and state slots are allocated as the layers'
memory statements say (helexa/checkpoint/layer_memory.py). The runner returns
next-token logits for the sequences that asked for them, in the order they
were given (`run_step`: as the step output the engine and its drafters read,
runner.py). The MTP head's passes are speculative/mtp_passes.py's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels import backends, kv_quant
from helexa.kernels.backends.base import StepPlan, to_device
from helexa.kernels.backends.gdn import GatedDeltaStates
from helexa.kernels.host_kv import HostKv, block_tensors, state_tensors
from helexa.kernels.paged_kv import PagedKV
from helexa.neuron.engine import memory_plan, pool_probe, tp_kernels
from helexa.neuron.engine.device_memory import MeterFactory, device_meter
from helexa.neuron.engine.host_tier import KvMoves
from helexa.neuron.engine.runner import StepOutput
from helexa.neuron.engine.seq_input import SeqInput, lay_out
from helexa.neuron.engine.speculative import mtp_passes
from helexa.neuron.engine.tp_messages import RunnerArgs
from helexa.neuron.engine.tp_rank import leave_group
from helexa.neuron.engine.tp_worker import TpWorkers
from helexa.neuron.engine.vision_step import VisionStep
from helexa.neuron.formats.base import Checkpoint, open_checkpoint
from helexa.neuron.formats.loader import load_model, resolve_dtype, weight_bytes
from helexa.neuron.formats.quantise import QuantSpec
from helexa.neuron.models.config import parse_dtype
from helexa.neuron.models.layers import linear_sites
from helexa.neuron.vision.processor import ImageProcessor

_KV_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
log = structlog.get_logger(component="engine")


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype | None]:
    """"auto" → the model's dtype: the canonical name, the storage dtype (None: quantised)."""
    if kv_dtype == "auto":
        return _KV_NAMES[model_dtype], model_dtype
    if kv_quant.is_quantized(kv_dtype):
        return kv_dtype, None
    try:
        dt = parse_dtype(kv_dtype)
    except ValueError:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not supported (auto, fp32, fp16, bf16, "
                         f"{', '.join(kv_quant.QUANT_DTYPES)})") from None
    return _KV_NAMES[dt], dt


class ModelRunner:
    """Owns the model's weights and this rank's KV pool (through its backend); executes steps."""

    def __init__(self, model_dir: str | Path | Checkpoint, *, device: str = "cpu",
                 dtype: str = "auto", num_blocks: int, block_size: int, kv_dtype: str = "auto",
                 max_num_seqs: int, max_batched_tokens: int, tp_rank: int = 0, tp_size: int = 1,
                 progress: Callable[[int, int], None] | None = None,
                 devices: list[str] | None = None, backend: str = "auto",
                 cuda_graphs: bool = True, plan_bytes_per_block: int = 0,
                 context: int = 0, quantize: str = "none",
                 quant_group_size: int = 128, num_state_slots: int = 0,
                 extra_bytes_per_block: int = 0, measure_pool: bool = True,
                 mtp_kv_layers: int | None = None, num_snapshot_slots: int = 0,
                 memory_meter: MeterFactory | None = None, spec_k: int = 0) -> None:
        """tp_size > 1 on rank 0 starts ranks 1..tp_size-1 itself (tp_worker.py) and drives
        them from execute / reset_kv; ``devices`` lists one device per rank (CUDA), else every
        rank uses ``device``. close() stops them (so does garbage collection or exit).
        ``backend`` names the attention backend (helexa/kernels/backends/__init__.py: auto,
        torch, cpu, cuda); ``cuda_graphs`` lets the cuda backend capture decode steps.
        ``plan_bytes_per_block`` (helexa plan's, 0 = unknown) must equal what the pool really
        takes, on every rank; on CUDA the pool is sized by measurement on every rank,
        ``num_blocks`` its ceiling, refusing a pool that cannot hold ``context`` tokens
        (pool_probe.py; ``memory_meter`` reads the device's memory: device_memory.py's, or a
        test's on CPU). ``quantize`` (none, int8, int4; int4 in groups of ``quant_group_size``)
        quantises the weights at load (helexa/neuron/formats/quantise.py). Hybrid models hold
        ``num_state_slots`` linear-attention states, one per request (SeqInput.state_slot),
        and ``num_snapshot_slots`` more for prefix-cache snapshots (restore_from / save_to).
        ``extra_bytes_per_block``: bytes of each block that layers sharing its ids take (a
        draft model's), counted when CUDA measures the pool; ``measure_pool`` False keeps
        ``num_blocks`` as given (a draft model's pool follows its target's). ``mtp_kv_layers``
        pool layers are set aside for the MTP head after the target's (as the plan counted
        them; None: as config.json says); the probe verifies ``spec_k`` drafts a row too."""
        quant = QuantSpec(quantize, quant_group_size)
        # config.json read once for this load (or a Checkpoint opened by the caller)
        ckpt = model_dir if isinstance(model_dir, Checkpoint) else open_checkpoint(model_dir)
        model_dir = ckpt.path
        self.hf_config, self.config = ckpt.raw, ckpt.config
        self.device = torch.device(device)
        self._tp: TpWorkers | None = None
        shape = backends.AttentionShape(self.config.num_heads, self.config.num_kv_heads,
                                        self.config.head_dim, resolve_dtype(self.config, dtype))
        self.backend = backends.select(backend, self.device, cuda_graphs=cuda_graphs,
                                       max_num_seqs=max_num_seqs, tp_size=tp_size, shape=shape)
        if tp_size > 1 and tp_rank == 0:
            if self.device.type == "cpu":
                torch.set_num_threads(1)  # one thread per rank: the ranks share the cores
            self._tp_args = RunnerArgs(
                str(model_dir), dtype, num_blocks, block_size, kv_dtype, max_num_seqs,
                max_batched_tokens, devices or [device] * tp_size, backend=backend,
                cuda_graphs=cuda_graphs, quantize=quantize, quant_group_size=quant_group_size,
                num_state_slots=num_state_slots, mtp_kv_layers=mtp_kv_layers,
                num_snapshot_slots=num_snapshot_slots, measure_pool=measure_pool,
                memory_meter=memory_meter, spec_k=spec_k)
            # The other ranks load while this process loads its own shard.
            self._tp, _ = TpWorkers.start(self._tp_args, tp_size)
            self._finalizer = weakref.finalize(self, _shutdown_tp, self._tp)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_batched_tokens, self.tp_rank, self.tp_size = max_batched_tokens, tp_rank, tp_size
        self.num_state_slots, self.spec_k = num_state_slots, spec_k
        self.num_snapshot_slots = num_snapshot_slots if num_state_slots else 0
        self.mtp_kv_layers = self.config.mtp_num_layers if mtp_kv_layers is None else mtp_kv_layers
        # Any: the model families share no typed base class yet (helexa/neuron/models/).
        self.model: Any = cast(Any, load_model(ckpt, device=self.device, dtype=dtype,
                                               tp_rank=tp_rank, tp_size=tp_size,
                                               progress=progress, quantize=quant))
        self.weight_bytes = weight_bytes(self.model)  # this rank's, as held (plan compares)
        self.dtype: torch.dtype = self.model.model.embed_tokens.weight.dtype
        self.backend.executor.prepare(self.model, linear_sites(self.model),
                                      max_num_seqs=max_num_seqs,
                                      max_batched_tokens=max_batched_tokens, tp_size=tp_size)
        self.vocab_size = self.config.vocab_size
        self.vision = VisionStep(self.model, ImageProcessor.from_dir(model_dir)
                                 if getattr(self.model, "visual", None) is not None else None,
                                 self.device, ranks=self._tp)
        self._attn = self.model.attention_layers
        self._linear = list(getattr(self.model, "linear_layers", []))
        if self._linear and num_state_slots < 1:
            raise ValueError("a hybrid model needs num_state_slots >= 1 (one per request)")
        self.linear_states = GatedDeltaStates(self.device) if self._linear else None
        self.num_kv_heads = self._attn[0].num_kv_heads  # per rank
        self.kv_pools: list[PagedKV] = []
        self.host_kv: HostKv | None = None  # the prefix cache's host tier (allocate_host)
        self.extra_bytes_per_block = extra_bytes_per_block
        self.meter = (memory_meter or device_meter)(self.device, tp_rank)  # None: CPU's
        self.measure_pool = measure_pool and self.meter is not None
        self._reset_own_kv(pool_probe.load_blocks(self, num_blocks, kv_dtype, context), kv_dtype)
        log.info("engine.attention_backend", backend=self.attention_backend,
                 device=str(self.device), tp_rank=tp_rank)
        if self._tp is not None:
            self._tp.wait_loaded(timeout_secs=3600.0)  # loading a big shard takes what it takes
            self._tp.join(self._tp_args, str(self.device))
            tp_kernels.agree(self._tp, self, self._tp.refused)  # one kernel a kind, all ranks
            self.backend.executor.grouped(self.model)  # the workers' after their TpReady
        if tp_rank == 0:  # a worker rank captures as rank 0's capture steps (below) say
            try:
                memory_plan.check_bytes_per_block(
                    plan_bytes_per_block, self.kv_bytes_per_block,
                    self._tp.kv_bytes_per_block if self._tp is not None else [])
                pool_probe.pool_at_load(self, num_blocks, kv_dtype, context)  # and graphs
            except Exception:  # the ranks' processes end with the load
                self.close()
                raise

    @property
    def attention_backend(self) -> str:
        """The attention backend and what it chose, and a hybrid's linear-attention kernels,
        as status shows it."""
        if self.linear_states is None:
            return self.backend.describe()
        return f"{self.backend.describe()}; {self.linear_states.describe()}"

    # ---- KV pool -------------------------------------------------------------------------

    def reset_kv(self, num_blocks: int, kv_dtype: str = "auto", context: int = 0,
                 num_state_slots: int = 0, max_num_seqs: int = 0,
                 max_batched_tokens: int = 0) -> None:
        """A new KV pool (``num_blocks`` the result; a hybrid's ``num_state_slots`` anew, 0:
        as they are) without touching the weights, the runner rebuilt for ``max_num_seqs``
        decode rows and ``max_batched_tokens`` a step where given: pool_probe.switch_pool."""
        resolve_kv_dtype(kv_dtype, self.dtype)  # refuse a bad kv_dtype before any rank acts
        pool_probe.switch_pool(self, num_blocks, kv_dtype, context, num_state_slots,
                               max_num_seqs, max_batched_tokens)

    def _reset_own_kv(self, num_blocks: int, kv_dtype: str) -> None:
        self.kv_dtype, storage = resolve_kv_dtype(kv_dtype, self.dtype)
        self.num_blocks, self.host_kv = num_blocks, None  # its twins hold the old pool
        # The MTP head's KV is in the pool too, after the target's layers, as helexa plan
        # counts it (whether or not its weights loaded: plan reads config.json alone)
        layers = [AttentionSpec(a.num_kv_heads, a.head_dim, self.kv_dtype) for a in self._attn]
        self._allocate_kv(layers + layers[-1:] * self.mtp_kv_layers, num_blocks, storage)
        if self.linear_states is not None:
            self.linear_states.allocate([x.state_spec for x in self._linear], self.num_state_slots
                                        + self.num_snapshot_slots, self.max_num_seqs)

    def _allocate_kv(self, layers: list[AttentionSpec], num_blocks: int,
                     storage: torch.dtype | None) -> None:
        self.kv_pools = []  # the old pools go first
        self.kv_pools = self.backend.attention.allocate_kv(
            layers, num_blocks, self.block_size, storage=storage, compute=self.dtype)
        self.backend.executor.kv_allocated(self.kv_pools)

    def _capture_graphs(self) -> None:
        """At load (the pool empty): a b-row decode step per graph size while capturing."""
        executor = self.backend.executor
        if self._tp is not None and executor.graph_sizes():  # every rank's graphs, or none
            executor.group_graphs(self._tp.graphs_refused())
        sizes, slots = executor.graph_sizes(), max(1, self.num_state_slots)
        if not sizes:
            return
        with self.backend.executor.capturing():
            for b in sizes:
                self.execute([SeqInput([0], 0, [0], True, i % slots) for i in range(b)])

    def allocate_host(self, num_blocks: int, num_snapshots: int) -> None:
        """The prefix cache's host tier on every rank: host twins of `num_blocks` blocks of
        this rank's pool and `num_snapshots` linear-attention states (helexa/kernels/host_kv.py)."""
        if self._tp is not None:
            self._tp.allocate_host(num_blocks, num_snapshots)
        self._allocate_own_host(num_blocks, num_snapshots)

    def _allocate_own_host(self, num_blocks: int, num_snapshots: int) -> None:
        self.host_kv = None  # the old twins go first
        self.host_kv = HostKv([t for kv in self.kv_pools for t in block_tensors(kv)],
                              state_tensors(self.linear_states), num_blocks, num_snapshots)
        log.info("engine.host_tier_allocated", blocks=num_blocks, snapshots=num_snapshots,
                 mib=self.host_kv.nbytes // 2**20, tp_rank=self.tp_rank)

    def move_kv(self, moves: KvMoves) -> None:
        """This step's copies between the pool and the host tier, on every rank (a failure
        on any raises once every rank has answered: TpWorkers.move_kv)."""
        if self._tp is None:
            return self._move_own_kv(moves)
        self._tp.move_kv(moves, self._move_own_kv)

    def _move_own_kv(self, moves: KvMoves) -> None:
        if self.host_kv is None:
            raise RuntimeError("no host tier allocated")
        self.host_kv.apply(moves)

    @property
    def k_caches(self) -> list[torch.Tensor]:
        return [kv.k_cache for kv in self.kv_pools]

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (and scales): this rank's share."""
        return sum(kv.nbytes for kv in self.kv_pools) // self.num_blocks

    @property
    def fixed_bytes_per_request(self) -> int:
        """Linear-attention state of one request across all layers: this rank's share
        (0 for dense models)."""
        return self.linear_states.bytes_per_slot if self.linear_states is not None else 0

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput], tokens: torch.Tensor | None = None,
                graph: str | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits [sum of num_logits of the seqs with need_logits,
        vocab] in input order. ``tokens``: the decode rows' input tokens, on the device
        (runner.py run_step). ``graph``: how the executor runs it, rank 0's decision on a
        worker rank (TpStep.graph); None: this runner's executor decides (and at tp > 1
        sends its decision with the step)."""
        if not seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
        input_ids, positions, step, logits_rows = self._prepare(seqs, tokens)
        # which state slot each row reads and writes: fresh slots cleared, held drafts settled
        state = self.linear_states.plan(step) if self.linear_states is not None else None
        attention, run = self.backend.attention, self.backend.executor.run
        try:
            meta = attention.plan(step)
            if graph is None:
                images = self.vision.takes_images and any(s.images for s in seqs)
                graph = self.backend.executor.decide(self.model, meta, logits_rows, images)
            if self._tp is not None:
                self._tp.send_step(seqs, device_tokens=tokens is not None, graph=graph)
            try:  # the tower's collectives, too, once every rank has the step
                if tokens is not None:
                    input_ids = self._device_tokens(tokens)
                positions = self.vision.attach(seqs, self.seq_starts, positions)
                logits = run(self.model, input_ids, positions, meta, logits_rows, state, graph)
            except (RuntimeError, ValueError) as e:  # ValueError: the group was aborted
                if self._tp is not None and (isinstance(e, RuntimeError) or self._tp.failed):
                    self._tp.fail_step(e)  # a collective failed: a rank died or wedged
                raise
            if state is not None:
                state.backend.end_step(state)  # the step's prefix snapshots
            return logits
        except BaseException:
            attention.step_failed()
            raise

    def save_held(self, saves: list[tuple[int, int, int]]) -> None:
        """Verification rows' prefix snapshots once their drafts are judged, on every rank:
        (state slot, snapshot slot, positions), GatedDeltaStates.save_held."""
        if self._tp is not None:
            self._tp.save_held(saves)
        self._save_own_held(saves)

    def _save_own_held(self, saves: list[tuple[int, int, int]]) -> None:
        if self.linear_states is None:
            raise ValueError("a held row's snapshot needs a hybrid model's linear states")
        self.linear_states.save_held(saves)

    def run_step(self, seqs: list[SeqInput], *, keep_hidden: bool = False,
                 tokens: torch.Tensor | None = None) -> StepOutput:
        """`execute`, with what a drafter reads of the step: each sequence's first flat row,
        and with `keep_hidden` (a drafter that follows the target) every row's final normed
        hidden state."""
        if keep_hidden:
            self.model.keep_hidden = True
        try:
            logits = self.execute(seqs, tokens)
            hidden = self.model.last_hidden if keep_hidden else None
        finally:
            if keep_hidden:
                self.model.keep_hidden, self.model.last_hidden = False, None
        return StepOutput(logits, list(self.seq_starts) if seqs else [], hidden)

    # ---- the MTP head (speculative/mtp_passes.py; the rank loop calls these too) ---------

    @property
    def has_mtp_head(self) -> bool:
        return getattr(self.model, "mtp", None) is not None  # only hybrid families have one

    def execute_mtp(self, seqs: list[SeqInput], hidden: torch.Tensor | None,
                    tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return mtp_passes.execute_mtp(self, seqs, hidden, tokens)

    def mtp_logits(self, hidden: torch.Tensor | None, rows: int = 0) -> torch.Tensor:
        return mtp_passes.mtp_logits(self, hidden, rows)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (no-op at tp = 1)."""
        if self._tp is not None:
            self._finalizer()  # runs once, here or at garbage collection / exit

    @property
    def failed(self) -> str:
        """Why this runner can no longer step ("" while healthy): a tensor-parallel rank
        died or a collective failed. Every later execute raises TpError; restart the model."""
        return self._tp.failed if self._tp is not None else ""

    @property
    def tp_pids(self) -> list[int]:
        return self._tp.pids if self._tp is not None else []

    def _prepare(self, seqs: list[SeqInput], tokens: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, StepPlan, torch.Tensor | None]:
        """Lay the step out flat (decode rows first) as a StepPlan. Token ids, positions,
        write slots and logits rows reach the device as one tensor (one copy, from pinned
        memory on CUDA). Device ``tokens`` are refused unless one token a row (execute's)."""
        if tokens is not None and (tokens.shape != (len(seqs),)
                                   or any(len(s.token_ids) != 1 for s in seqs)):
            raise ValueError(f"device tokens {tuple(tokens.shape)} for a step of {len(seqs)} "
                             "sequences: they are for pure decode steps, one token a row")
        lay = lay_out(seqs, self.block_size, self.num_blocks)
        ids, positions, want, step = lay.ids, lay.positions, lay.want, lay.step
        self.seq_starts, n_tok = lay.seq_starts, len(ids)
        # A fresh pinned buffer a step, not one reused: the engine's lookahead prepares a
        # step while the one before runs, whose copy from its buffer may not have run yet.
        flat = to_device(ids + positions + lay.slots + want, torch.long, self.device)
        step.slot_mapping = flat[2 * n_tok : 3 * n_tok]
        self.model.rotary.ensure(max(positions) + 1)
        # All rows in order (pure decode where every row wants logits): skip the gather.
        logits_rows = None if want == list(range(n_tok)) else flat[3 * n_tok :]
        return flat[:n_tok], flat[n_tok : 2 * n_tok], step, logits_rows

    def _device_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """A lookahead step's input ids: rank 0's ``tokens`` on every rank (others: a buffer)."""
        tokens = tokens.to(self.device, torch.long).contiguous()
        if self.tp_size > 1:
            torch.distributed.broadcast(tokens, src=0)
        return tokens


def _shutdown_tp(tp: TpWorkers) -> None:
    tp.close()
    leave_group(abort=bool(tp.failed))
