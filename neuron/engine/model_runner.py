"""ModelRunner: runs one engine step of the model over the paged KV pool.

The engine hands it a list of SeqInput (each sequence's new tokens, how many
of its tokens are already cached, and its block table). The runner lays the
batch out flat — single-token (decode) rows first, then prefill chunks —
builds every index the attention layers need once per step as tensors
(positions, slot mapping, gather indices, masks), runs one forward over all
rows, and returns next-token logits for the sequences that asked for them,
in the order they were given.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from helexa.kernels import cpu_native, kv_quant
from helexa.kernels.attention import AttentionMetadata, DecodeMirror, PagedKV, PrefillChunk
from helexa.neuron.engine.tp_worker import RunnerArgs, TpWorkers, leave_group
from helexa.neuron.models.config import load_model_config, parse_dtype
from helexa.neuron.models.loader import load_model

_KV_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_MIRROR_MAX_BYTES = 256 * 2**20  # all layers' decode mirrors together (CPU), else gather
_MIRROR_STEP = 128  # mirror capacity grows in steps of this many positions


@dataclass
class SeqInput:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens to process this step (prefill chunk, or 1 for decode)
    num_computed: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # physical block ids covering num_computed + len(token_ids)
    need_logits: bool  # produce next-token logits (last chunk of prefill, or decode)


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype | None]:
    """"auto" → the model's dtype; returns the canonical name and the storage dtype
    (None for the quantised kinds, whose storage kernels.kv_quant lays out)."""
    if kv_dtype == "auto":
        return _KV_NAMES[model_dtype], model_dtype
    if kv_quant.is_quantized(kv_dtype):
        return kv_dtype, None
    try:
        dt = parse_dtype(kv_dtype)
    except ValueError:
        raise ValueError(
            f"kv_dtype {kv_dtype!r} is not supported (auto, fp32, fp16, bf16, "
            f"{', '.join(kv_quant.QUANT_DTYPES)})"
        ) from None
    return _KV_NAMES[dt], dt


class ModelRunner:
    """Owns the model's weights and this rank's KV pool; executes steps."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: str = "auto",
                 num_blocks: int, block_size: int, kv_dtype: str = "auto", max_num_seqs: int,
                 max_batched_tokens: int, tp_rank: int = 0, tp_size: int = 1,
                 progress: Callable[[int, int], None] | None = None,
                 devices: list[str] | None = None) -> None:
        """tp_size > 1 on rank 0 starts ranks 1..tp_size-1 itself (tp_worker.py) and drives
        them from execute / reset_kv; ``devices`` lists one device per rank (CUDA), else
        every rank uses ``device``. close() stops them (so does garbage collection or exit)."""
        self.hf_config, self.config = load_model_config(model_dir)
        self.device = torch.device(device)
        self._tp: TpWorkers | None = None
        if tp_size > 1 and tp_rank == 0:
            if self.device.type == "cpu":
                torch.set_num_threads(1)  # one thread per rank: the ranks share the cores
            self._tp_args = RunnerArgs(
                str(model_dir), dtype, num_blocks, block_size, kv_dtype, max_num_seqs,
                max_batched_tokens, devices or [device] * tp_size)
            # The other ranks load while this process loads its own shard.
            self._tp, _ = TpWorkers.start(self._tp_args, tp_size)
            self._finalizer = weakref.finalize(self, _shutdown_tp, self._tp)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model = load_model(model_dir, device=self.device, dtype=dtype, tp_rank=tp_rank,
                                tp_size=tp_size, progress=progress)
        self.dtype: torch.dtype = self.model.model.embed_tokens.weight.dtype
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        pack_max_mb = float(os.environ.get("HELEXA_CPU_PACK_MAX_MB", "2048"))
        # kernels/cpu_native.c: CPU, fp32, one rank (decode steps also need plain fp32 KV).
        self._native = (cpu_native.load() if self.device.type == "cpu"
                        and self.dtype == torch.float32 and tp_size == 1 else None)
        if self.device.type == "cpu" and weight_bytes <= pack_max_mb * 2**20:
            # A second, blocked copy of each matmul weight: batched decode steps run ~1.4x
            # (oneDNN's) or ~2x (hx_gemm's, single-threaded: used when torch runs one thread)
            # faster on CPU. It doubles weight memory, hence the size cap.
            if self._native is not None and torch.get_num_threads() == 1:
                self.model.pack_native(self._native)
            else:
                self.model.pack_for_cpu(batch_hint=max(1, min(max_num_seqs, 16)))
        if self.device.type == "cpu":  # one-row steps stream column-major weights faster
            self.model.relayout_for_cpu()
        self.vocab_size = self.config.vocab_size
        self._attn = self.model.attention_layers
        self.num_kv_heads = self._attn[0].num_kv_heads  # per rank
        self.kv_pools: list[PagedKV] = []
        self._staging: torch.Tensor | None = None  # pinned host buffer for step indices (CUDA)
        self._no_slots = torch.empty(0, dtype=torch.long, device=self.device)
        self._gather_ws: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU decode gathers
        # The decode rows the layers' mirrors hold: (block table objects, positions, cap).
        self._mirror: tuple[list[list[int]], list[int], int] | None = None
        self._next_mirror: tuple[list[list[int]], list[int], int] | None = None
        self._reset_own_kv(num_blocks, kv_dtype)
        if self._tp is not None:
            self._tp.wait_loaded(timeout_secs=3600.0)  # loading a big shard takes what it takes
            self._tp.join(self._tp_args, str(self.device))

    # ---- KV pool -------------------------------------------------------------------------

    def reset_kv(self, num_blocks: int, kv_dtype: str = "auto") -> None:
        """(Re)allocate the KV pool without touching the weights; old contents are dropped."""
        resolve_kv_dtype(kv_dtype, self.dtype)  # refuse a bad kv_dtype before any rank acts
        if self._tp is not None:
            self._tp.reset_kv(num_blocks, kv_dtype)
        self._reset_own_kv(num_blocks, kv_dtype)

    def _reset_own_kv(self, num_blocks: int, kv_dtype: str) -> None:
        self.kv_dtype, storage = resolve_kv_dtype(kv_dtype, self.dtype)
        self._mirror = None
        for attn in self._attn:  # free the old pool before allocating the new one
            attn.kv = None
        self.kv_pools = []
        self.num_blocks = num_blocks
        for attn in self._attn:
            attn.kv = PagedKV(num_blocks, self.block_size, self.num_kv_heads, self.config.head_dim,
                              kv_dtype=self.kv_dtype, storage=storage, compute=self.dtype,
                              device=self.device)
            self.kv_pools.append(attn.kv)
        # Pure-decode steps run kernels/cpu_native.c between the matmuls where it applies:
        # CPU, fp32 weights and plain fp32 KV, one rank.
        self.model.native = self._native if storage == torch.float32 else None
        self.model._native_plan = None  # the new pool's pointers

    @property
    def k_caches(self) -> list[torch.Tensor]:
        return [kv.k_cache for kv in self.kv_pools]

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V (and scales): this rank's share."""
        return sum(kv.nbytes for kv in self.kv_pools) // self.num_blocks

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Run one step; returns fp32 logits [num seqs with need_logits, vocab] in input order."""
        if not seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
        self._next_mirror = None
        input_ids, positions, meta, logits_rows = self._prepare(seqs)
        self._mirror = None  # a step that fails part way leaves the mirrors stale
        if self._tp is None:
            logits = self.model(input_ids, positions, meta, logits_rows)
        else:
            self._tp.send_step(seqs)
            try:
                logits = self.model(input_ids, positions, meta, logits_rows)
            except RuntimeError as e:  # a collective failed: a rank died or wedged
                self._tp.fail_step(e)
                raise
        self._mirror = self._next_mirror
        return logits

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

    def _prepare(self, seqs: list[SeqInput]):
        """Lay the step out flat (decode rows first) and build, once, every index the layers
        use. Token ids, positions, write slots and logits rows reach the device as one
        tensor (one copy, from a preallocated pinned buffer on CUDA)."""
        bs, dev = self.block_size, self.device
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        meta = AttentionMetadata(slot_mapping=self._no_slots, num_decode=len(decode))
        ids = [seqs[i].token_ids[0] for i in decode]
        positions = [seqs[i].num_computed for i in decode]
        native = self.model.native is not None and len(decode) == len(seqs)
        slots = (self._decode_plan(meta, [seqs[i] for i in decode], positions, native)
                 if decode else [])
        last_row = {i: r for r, i in enumerate(decode)}  # seq index -> flat row of its last token
        for i, s in enumerate(seqs):
            n, c = len(s.token_ids), s.num_computed
            if n == 1:
                continue
            if n == 0:
                raise ValueError("SeqInput with no tokens")
            table = _checked_table(s.block_table, c + n, bs)
            start = len(ids)
            ids.extend(s.token_ids)
            positions.extend(range(c, c + n))
            slots.extend(_token_slots(table, c, c + n, bs))
            chunk = PrefillChunk(start=start, end=start + n)
            if c > 0:  # attends over cached context too: a view when its blocks are consecutive
                blocks = table[: (c + n - 1) // bs + 1]
                if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                    chunk.context_start = blocks[0] * bs
                    chunk.context_len = c + n
                else:
                    chunk.context_slots = torch.tensor(_token_slots(table, 0, c + n, bs),
                                                       device=dev)
                ctx = torch.arange(c + n, device=dev)
                chunk.mask = ctx[None, :] <= ctx[c:, None]
            meta.prefills.append(chunk)
            last_row[i] = start + n - 1
        n_tok = len(ids)
        want = [last_row[i] for i, s in enumerate(seqs) if s.need_logits]
        flat = self._to_device(ids + positions + slots + want)
        meta.slot_mapping = flat[2 * n_tok : 3 * n_tok]
        self.model.rotary.ensure(max(positions) + 1)
        # All rows in order (pure decode where every row wants logits): skip the gather.
        logits_rows = None if want == list(range(n_tok)) else flat[3 * n_tok :]
        return flat[:n_tok], flat[n_tok : 2 * n_tok], meta, logits_rows

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        # Safe to reuse the staging buffer: every step ends in a sync (logits to the sampler).
        if self._staging is None or self._staging.numel() < host.numel():
            self._staging = torch.empty(max(host.numel(), 4 * self.max_batched_tokens),
                                        dtype=torch.long).pin_memory()
        staged = self._staging[: host.numel()]
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def _decode_plan(self, meta: AttentionMetadata, rows: list[SeqInput],
                     pos_list: list[int], native: bool = False) -> list[int]:
        """How decode rows read their context — their block tables (native kernels), a view
        of one row's consecutive blocks, else gather indices [B*T] with a padding mask — and
        the slots their new tokens go to."""
        bs = self.block_size
        b = len(rows)
        t = max(pos_list) + 1
        nblk = -(-t // bs)
        tables, write = [], []
        for s, pos in zip(rows, pos_list, strict=True):
            used = pos // bs + 1
            if len(s.block_table) < used:
                raise ValueError(f"block table of {len(s.block_table)} blocks × {bs} cannot "
                                 f"hold {pos + 1} tokens")
            blocks = s.block_table[:used]
            write.append(blocks[-1] * bs + pos % bs)
            tables.append(blocks + [0] * (nblk - used))
        meta.decode_len = t
        if native:  # C indexes the pool with these ids unchecked: a bad one must not get there
            if any(not 0 <= blk < self.num_blocks for tab in tables for blk in tab):
                raise ValueError(f"block table holds a block outside the pool of "
                                 f"{self.num_blocks} blocks: {tables}")
            meta.decode_tables = torch.tensor(tables, dtype=torch.long)
            return write
        if b == 1:
            first = tables[0][0]
            if tables[0] == list(range(first, first + nblk)):  # the usual case: a reservation
                meta.decode_start = first * bs  # is drawn in order, so no gather is needed
                return write
        ar = torch.arange(t)
        mirrored = self._plan_mirror(meta, rows, pos_list, tables)
        if not mirrored or meta.decode_mirror.fill:
            span = torch.arange(self._next_mirror[2]) if mirrored else ar
            table = torch.tensor([tab + [0] * (-(-len(span) // bs) - len(tab)) for tab in tables],
                                 dtype=torch.long)
            meta.decode_slots = (table[:, span // bs] * bs + span % bs).view(-1).to(self.device)
        if self.device.type == "cpu" and not mirrored:
            meta.decode_buffers = self._gather_buffers(b * t)
        if b > 1 and min(pos_list) != t - 1:  # rows shorter than the longest are padded
            pos = torch.tensor(pos_list, dtype=torch.long)
            meta.decode_mask = (ar[None, :] <= pos[:, None]).view(b, 1, 1, t).to(self.device)
        return write

    def _plan_mirror(self, meta: AttentionMetadata, rows: list[SeqInput], pos_list: list[int],
                     tables: list[list[int]]) -> bool:
        """CPU, plain KV, several rows: keep each layer's rows' context across steps
        (DecodeMirror). Reused while the rows are the same requests (the same block table
        objects, which the engine keeps per request, held here so none is recycled) in the
        same order, each one token further, within capacity; else refilled from the pool."""
        kv0 = self.kv_pools[0]
        if self.device.type != "cpu" or kv0.quantized or kv0.k_heads.dtype != self.dtype:
            return False
        b, t = len(rows), max(pos_list) + 1
        keys = [s.block_table for s in rows]
        m = self._mirror
        same = (m is not None and len(m[0]) == b and t <= m[2]
                and all(x is y for x, y in zip(keys, m[0], strict=True))
                and all(p == q + 1 for p, q in zip(pos_list, m[1], strict=True)))
        cap = m[2] if same else (t // _MIRROR_STEP + 2) * _MIRROR_STEP
        per_layer = 2 * kv0.k_heads.shape[1] * b * cap * kv0.head_dim * kv0.k_heads.element_size()
        if per_layer * len(self.kv_pools) > _MIRROR_MAX_BYTES:
            return False
        if not same:
            shape = (kv0.k_heads.shape[1], b, cap, kv0.head_dim)
            for kv in self.kv_pools:
                if kv.mirror is None or kv.mirror[0].shape != shape:
                    kv.mirror = (torch.empty(shape, dtype=self.dtype),
                                 torch.empty(shape, dtype=self.dtype))
        index = torch.tensor([i * cap + p for i, p in enumerate(pos_list)], dtype=torch.long)
        meta.decode_mirror = DecodeMirror(fill=not same, write_index=index)
        self._next_mirror = (keys, list(pos_list), cap)
        return True

    def _gather_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers (flat) of at least n slots for decode gathers, kept across steps (CPU only: there
        a fresh tensor of this size per layer costs more in page faults than the gather; a
        GPU's caching allocator has no such cost and its memory is planned to the byte)."""
        ws = self._gather_ws
        per_slot = self.num_kv_heads * self.config.head_dim
        if ws is None or ws[0].numel() < n * per_slot:
            size = max(n, 2 * ws[0].numel() // per_slot if ws is not None else n)
            shape = (size * self.num_kv_heads * self.config.head_dim,)
            ws = self._gather_ws = (torch.empty(shape, dtype=self.dtype, device=self.device),
                                    torch.empty(shape, dtype=self.dtype, device=self.device))
        return ws


def _shutdown_tp(tp: TpWorkers) -> None:
    tp.close()
    leave_group()


def _checked_table(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    if len(block_table) * block_size < num_tokens:
        raise ValueError(f"block table of {len(block_table)} blocks × {block_size} cannot hold "
                         f"{num_tokens} tokens")
    return block_table


def _token_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence, a block run at a time."""
    out: list[int] = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = table[block] * block_size + offset
        out.extend(range(base, base + take))
        pos += take
    return out
