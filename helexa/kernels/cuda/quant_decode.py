"""Attention over a quantised KV pool on CUDA (Triton): a step's decode rows in two kernels
a layer, a prefill chunk over its cached context in one.

FlashInfer reads no quantised pool of helexa's (kernels/kv_quant.py: int8, fp8 e4m3 and
int4 data with per-token-head fp32 scales), so on CUDA those pools run the torch path,
whose decode gathers each length group's K and V, dequantises them to the queries'
dtype and calls SDPA: tens of kernels a layer a step at short context, hundreds at long
(a chunk of 8,192 row-tokens at a time), and every gathered byte written and read again.
Here one kernel (helexa/kernels/cuda/_quant_decode_triton.py ``split_kernel``) reads the
pages in place through each row's block table, dequantises in registers and keeps the
softmax online, each program a split of one row's context for one kv head and its GQA
group (flash-decoding: enough programs to fill the card at batch 1), and a second merges
the splits. A prefill chunk over cached context (``prefill``: ``prefill_kernel``) reads the
same pages the same way, a block of its queries with their GQA heads (64 rows) a program,
causally, where the torch path gathered and dequantised the context a few hundred keys at
a time past 8,192 tokens. The new tokens' K and V are written before, by
kernels/cuda/quant_write.py's kernel where it serves (else the torch form).

:func:`choose` sets all three on the cuda backend's torch backend for a quantised pool,
each where its probe agreed on the device at load (decode rows of several lengths and
prefill chunks over scattered and consecutive pages, against the torch path), else the
torch path, the reason logged as ``kernels.quant_decode_fallback`` /
``kernels.quant_prefill_fallback``. No Triton, a 32-bit model, or
``HELEXA_TRITON_QUANT_DECODE=0``: the torch path. With the write and decode kernels
serving, a pure-decode step is captured in a CUDA graph (torch_ref.py static_meta): its
split count is then the one the most a row can hold gets, and each row's own context is
cut into that many spans on the device (``decode(per_row=True)``; the probe proves that
form too). The tests run the kernels' source on CPU through Triton's interpreter. It is
unmeasured on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import structlog
import torch

from helexa.checkpoint.kv_path import SPLIT_PROGRAMS
from helexa.checkpoint.layer_memory import AttentionSpec
from helexa.kernels import cuda as cuda_kernels
from helexa.kernels.attention import DecodeGroup, PrefillChunk, grouped_decode, paged_attention
from helexa.kernels.backends.base import token_slots
from helexa.kernels.backends.torch_ref import TorchBackend
from helexa.kernels.cuda import quant_write
from helexa.kernels.paged_kv import PagedKV

log = structlog.get_logger(component="kernels")

BLOCK_N = 32  # tokens a program reads at a time
PREFILL_ROWS = 64  # a prefill program's (query, GQA head) rows: 64 // group queries
MIN_SPLIT = 256  # tokens: no split is shorter (a short row is one split)
TARGET_PROGRAMS = SPLIT_PROGRAMS  # about two a streaming multiprocessor on an H100
# a step's splits at most, a captured graph's (whose count follows the most a row can
# hold, not the step's longest row) and an eager one's alike: the merge's tile is
# GRAPH_SPLITS x head size for every step, one build per layer shape that the probe
# compiles (a tile of the step's own count built another at each new power of two
# mid-serving); at 128 splits of 256 dims it spills (ptxas for sm90), at 64 it does not
GRAPH_SPLITS = 64
_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def unavailable() -> str:
    """"" where the kernels can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_QUANT_DECODE", "_quant_decode_triton")


def splits(rows: int, kv_heads: int, max_len: int) -> tuple[int, int]:
    """How each row's context is cut: (splits, tokens a split), enough programs to fill the
    card, no split shorter than MIN_SPLIT tokens, at most GRAPH_SPLITS, each a whole number
    of BLOCK_N tiles (the longest row's last split is never empty)."""
    want = max(1, min(-(-TARGET_PROGRAMS // (rows * kv_heads)), max_len // MIN_SPLIT,
                      GRAPH_SPLITS))
    length = -(-max_len // want)
    length = -(-length // BLOCK_N) * BLOCK_N
    return -(-max_len // length), length


def decode(q: torch.Tensor, kv: PagedKV, table: torch.Tensor, lens: torch.Tensor,
           max_len: int, block_size: int, per_row: bool = False,
           interpret: bool = False) -> torch.Tensor:
    """One query per decode row over its context in the quantised pool ``kv``: q [B, heads,
    d] (fp16/bf16), table [B, max_blocks] int32 (each row's pages), lens [B] int32 (its
    context, the new token's included, already written), max_len the longest (a host
    figure) -> [B, heads, d] in q's dtype. ``per_row`` (a captured graph's step, where
    max_len is the most any row can hold, not the step's): the split count that length
    gets, each row's own context cut into that many spans on the device, so that no launch
    reads a figure of the step's from the host."""
    from helexa.kernels.cuda import _quant_decode_triton as src

    b, heads, d = q.shape
    kvh = kv.num_kv_heads
    group = heads // kvh
    out = torch.empty_like(q)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    n_split, split_len = splits(b, kvh, max_len)
    dp = cuda_kernels.pow2(d, 16)
    part = torch.empty(b, heads, n_split, dp, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, heads, n_split, dtype=torch.float32, device=q.device)
    split_kernel, merge_kernel, _ = src.build(interpret)
    assert kv.k_data.is_contiguous() and kv.k_scale.is_contiguous() and table.stride(-1) == 1
    split_kernel[(b, kvh, n_split)](
        q, kv.k_data, kv.k_scale, kv.v_data, kv.v_scale, table, lens, part, lse,
        1.0 / math.sqrt(d), q.stride(0), q.stride(1), table.stride(0),
        0 if per_row else split_len, n_split,
        KV_HEADS=kvh, GROUP=group, GP=cuda_kernels.pow2(group, 16), HEAD_DIM=d,
        DP=dp, DATA_DIM=kv.k_data.shape[-1], NUM_SCALES=kv.k_scale.shape[-1],
        KIND=quant_write.KINDS[kv.kv_dtype], BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        DOT_F32=interpret, num_warps=_warps(dp))
    merge_kernel[(b, heads)](part, lse, out, out.stride(0), out.stride(1), n_split,
                             HEADS=heads, HEAD_DIM=d, DP=dp,
                             SP=cuda_kernels.pow2(GRAPH_SPLITS, 2))
    return out


def prefill(q: torch.Tensor, kv: PagedKV, chunk: PrefillChunk,
            interpret: bool = False) -> torch.Tensor:
    """A prefill chunk's queries q [n, heads, d] (fp16/bf16) over its whole context in the
    quantised pool ``kv`` (cached tokens and its own, already written: ``chunk``'s slots,
    or its consecutive run from context_start), causally -> [n, heads, d] in q's dtype."""
    from helexa.kernels.cuda import _quant_decode_triton as src

    n, heads, d = q.shape
    kvh = kv.num_kv_heads
    group = heads // kvh
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dp = cuda_kernels.pow2(d, 16)
    tok = max(1, PREFILL_ROWS // group)
    slots = chunk.context_slots
    _, _, prefill_kernel = src.build(interpret)
    prefill_kernel[(-(-n // tok), kvh)](
        q, kv.k_data, kv.k_scale, kv.v_data, kv.v_scale, slots if slots is not None else q,
        out, chunk.context_start or 0, n, chunk.context_len, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), KV_HEADS=kvh, GROUP=group,
        TOK=tok, R=cuda_kernels.pow2(tok * group, 16), HEAD_DIM=d, DP=dp, DATA_DIM=kv.k_data.shape[-1],
        NUM_SCALES=kv.k_scale.shape[-1], KIND=quant_write.KINDS[kv.kv_dtype], BLOCK_N=BLOCK_N,
        SLOTS=slots is not None, DOT_F32=interpret, num_warps=_warps(dp))
    return out


def _warps(dp: int) -> int:
    """Warps a program: 8 from 128 dims (at 4, a 128-dim int8 split program holds 255
    registers and spills, by ptxas for sm90: a review's compile, no card run), else 4."""
    return 8 if dp >= 128 else 4


def probe_prefill(device: torch.device, kv_dtype: str, heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, interpret: bool = False) -> str:
    """Two prefill chunks (5 queries ending a 75-token context over scattered pages; 40
    ending a 64-token one over consecutive pages) at a layer's sizes against the torch
    path's: "" when they agree within the dtype's tolerance, else why not (a failure
    included)."""
    gen = torch.Generator().manual_seed(heads * head_dim + kv_heads + 1)
    bs = 16
    kv = _random_pool(kv_dtype, 12, bs, kv_heads, head_dim, dtype, device, gen)
    for n, context, table in ((5, 75, [7, 2, 9, 0, 11]), (40, 64, [4, 5, 6, 7])):
        slots = token_slots(table, 0, context, bs)
        consecutive = table == list(range(table[0], table[0] + len(table)))
        chunk = PrefillChunk(start=0, end=n, context_len=context,
                             context_start=slots[0] if consecutive else None,
                             context_slots=None if consecutive else
                             torch.tensor(slots, device=device))
        q = torch.randn(n, heads, head_dim, generator=gen).to(device, dtype)
        ctx = torch.arange(context, device=device)
        ref = PrefillChunk(start=0, end=n, context_len=context,
                           context_slots=torch.tensor(slots, device=device),
                           mask=ctx[None, :] <= ctx[context - n:, None])
        want = paged_attention(q, q[:, :kv_heads], q[:, :kv_heads], kv, 0, _no_decode,
                               [ref]).float()
        why = _agrees("prefill", partial(prefill, q, kv, chunk, interpret), want, dtype, device)
        if why:
            return why
    return ""


def _random_pool(kv_dtype: str, blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> PagedKV:
    """A quantised pool of ``blocks`` blocks, every slot written with seeded K and V."""
    kv = PagedKV(blocks, block_size, kv_heads, head_dim, kv_dtype=kv_dtype, storage=None,
                 compute=dtype, device=device)
    n = blocks * block_size
    kv.write(torch.arange(n, device=device),
             torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype),
             torch.randn(n, kv_heads, head_dim, generator=gen).to(device, dtype))
    return kv


def _agrees(what: str, run: Callable[[], torch.Tensor], want: torch.Tensor,
            dtype: torch.dtype, device: torch.device) -> str:
    """"" when the kernel's output (``run``, waited for) is within the dtype's relative
    tolerance of the torch path's ``want``; else why not, a failure of the kernel included
    (the torch path then serves, so a kernel that fails here never fails a step)."""
    try:
        got = run().float()
        cuda_kernels.settled(device)
    except Exception as e:  # noqa: BLE001 - any failure: the torch path serves, said why
        return f"the Triton quantised-KV {what} failed ({type(e).__name__}: {e})"
    tol = _TOL.get(dtype, 3e-2)
    err = float((got - want.float()).norm() / want.float().norm())
    if not err < tol:
        return f"the Triton quantised-KV {what} is off by {err:.2g} (relative; {tol} allowed)"
    return ""


def _no_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a prefill probe has no decode rows")


def probe(device: torch.device, kv_dtype: str, heads: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype, interpret: bool = False) -> str:
    """Four decode rows (contexts of 1, 37, 300 and 700 tokens over scattered pages: the
    longest in two splits, the others' second split empty; then as a captured graph cuts
    them, each row's own context in as many spans as a graph of 4 rows, then of the
    longest alone, takes) at a layer's sizes against the torch path's decode, every step's
    one merge build among them: "" when all agree within the dtype's tolerance, else why
    not (a failure included)."""
    gen = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    block_size, lens = 16, [1, 37, 300, 700]
    blocks = sum(-(-n // block_size) for n in lens)
    kv = _random_pool(kv_dtype, blocks + 3, block_size, kv_heads, head_dim, dtype, device, gen)
    pages = (torch.randperm(blocks + 3, generator=gen)[:blocks] if blocks else
             torch.empty(0, dtype=torch.long)).tolist()
    tables, at = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(pages[at:at + need])
        at += need
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(device, dtype)
    table, lens_t, want = reference_inputs(tables, lens, block_size, q, kv)
    graph = partial(decode, per_row=True, interpret=interpret)  # the most splits a graph
    return (_agrees("decode", lambda: decode(q, kv, table, lens_t, max(lens), block_size,
                                             interpret=interpret), want, dtype, device)
            or _agrees("decode (a graph's splits)",  # takes: 4 rows', then the longest's
                       lambda: graph(q, kv, table, lens_t, 1 << 20, block_size), want, dtype,
                       device)
            or _agrees("decode (a graph's splits)",
                       lambda: graph(q[3:], kv, table[3:], lens_t[3:], 1 << 20, block_size),
                       want[3:], dtype, device))


def reference_inputs(tables: list[list[int]], lens: list[int], block_size: int,
                     q: torch.Tensor, kv: PagedKV
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's table and lengths for rows of these block tables, and the torch path's
    output for them (one length group, each row's slots gathered)."""
    dev, width = q.device, max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ar = torch.arange(max(lens))
    slots = (table.long()[:, ar // block_size] * block_size + ar % block_size).to(dev)
    grp = DecodeGroup(rows=None, lengths=torch.tensor(lens, device=dev), max_len=max(lens),
                      min_len=min(lens), slots=slots)
    return (table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            grouped_decode(q, kv, [grp]))


def chosen(device: torch.device, kv_dtype: str, heads: int, kv_heads: int, head_dim: int,
           dtype: torch.dtype, check: Callable[..., str] | None = None) -> tuple[bool, str]:
    """Whether the decode kernel (or the one ``check``, probe_prefill, proves) serves a
    quantised pool of these sizes on ``device`` (its probe agreed), and why not where it
    could run here but was refused ("" otherwise)."""
    if (device.type != "cuda" or unavailable() or dtype not in _TOL
            or kv_dtype not in quant_write.KINDS):
        return False, ""
    why = (check or probe)(device, kv_dtype, heads, kv_heads, head_dim, dtype)
    return not why, why


def choose(backend: TorchBackend, spec: AttentionSpec | None, heads: int,
           compute: torch.dtype) -> None:
    """Set the torch backend's quantised-pool kernels (``quant_write``, ``quant_decode``,
    ``quant_prefill``) for pools of ``spec`` (None: a float pool, none) on its device: each
    where its probe agreed, else None, the reason logged (``kernels.quant_write_fallback``,
    ``kernels.quant_decode_fallback``, ``kernels.quant_prefill_fallback``) where it could
    run here but was refused."""
    backend.quant_write = backend.quant_decode = backend.quant_prefill = None
    if spec is None:
        return
    dev = backend.device
    wrote, why = quant_write.chosen(dev, spec.kv_dtype, spec.kv_heads, spec.head_dim, compute)
    if why:
        log.warning("kernels.quant_write_fallback", reason=why)
    read, why = chosen(dev, spec.kv_dtype, heads, spec.kv_heads, spec.head_dim, compute)
    if why:
        log.warning("kernels.quant_decode_fallback", reason=why)
    ahead, why = chosen(dev, spec.kv_dtype, heads, spec.kv_heads, spec.head_dim, compute,
                        probe_prefill)
    if why:
        log.warning("kernels.quant_prefill_fallback", reason=why)
    backend.quant_write = quant_write.write if wrote else None
    backend.quant_decode = decode if read else None
    backend.quant_prefill = prefill if ahead else None
