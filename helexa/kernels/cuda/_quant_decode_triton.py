"""The Triton source of helexa/kernels/cuda/quant_decode.py's kernels (imported only where
Triton is).

``split_kernel`` (decode rows): one program takes one decode row, one kv head (all the query heads of its
GQA group, padded to 16 rows for ``tl.dot``) and one split of the row's context. It walks
the split BLOCK_N tokens at a time: each token's page from the row's block table, its
K and V bytes and per-token-head scales from the quantised pool (int8; fp8 e4m3 decoded
from its bits; int4 two to a byte, a scale per 32 dims), dequantised in registers to the
queries' dtype, as the torch path's gather does; scores and the online softmax in fp32.
It writes the split's normalised output and its log-sum-exp. The products run on the
card's 16-bit matrix units; with DOT_F32 (Triton's interpreter, whose bf16 dot is not a
float one) the same 16-bit values are multiplied in fp32, which gives the same sums up to
their order. ``merge_kernel``: one
program a (row, query head) weighs the splits by their log-sum-exp (a split past the row's
end has -inf: weight 0). ``prefill_kernel``: a prefill chunk over its cached context and
itself, causally, the same reads, a block of queries (by GQA group) a program.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


@triton.jit
def _dequant(data_ptr, scale_ptr, rows, offs_d, in_tok, in_d, DATA_DIM: tl.constexpr,
             NUM_SCALES: tl.constexpr, KIND: tl.constexpr):
    """[BLOCK_N, DP] fp32 values of the token-heads at flat ``rows`` (slot * kv_heads + head)."""
    mask = in_tok[:, None] & in_d[None, :]
    if KIND == 2:  # int4: dim d in byte d // 2, low nibble first, stored as value + 8
        byte = tl.load(data_ptr + rows[:, None] * DATA_DIM + offs_d[None, :] // 2, mask=mask,
                       other=136).to(tl.int32)
        nib = (byte >> ((offs_d[None, :] % 2) * 4)) & 15
        val = (nib - 8).to(tl.float32)
        scale = tl.load(scale_ptr + rows[:, None] * NUM_SCALES + offs_d[None, :] // 32,
                        mask=mask, other=0.0)
    else:
        raw = tl.load(data_ptr + rows[:, None] * DATA_DIM + offs_d[None, :], mask=mask, other=0)
        if KIND == 0:  # int8, symmetric
            val = raw.to(tl.float32)
        else:  # fp8 e4m3 bits: sign, 4 exponent bits (bias 7), 3 mantissa bits
            bits = raw.to(tl.int32) & 255
            e = (bits >> 3) & 15
            m = bits & 7
            # a normal one is fp32's bits with the exponent rebiased; a subnormal m / 8 * 2^-6
            normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
            val = tl.where((bits & 128) != 0, -mag, mag)
        scale = tl.load(scale_ptr + rows * NUM_SCALES, mask=in_tok, other=0.0)[:, None]
    return val * scale


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b of 16-bit tiles on the matrix units, accumulated in fp32; with DOT_F32 the
    same 16-bit values multiplied in fp32 (Triton's interpreter: its bf16 dot is no float
    one)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile(q, m, den, acc, k_data, k_scale, v_data, v_scale, rows, offs_d, in_tok, in_d,
          allowed, sm_scale, DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr,
          KIND: tl.constexpr, DOT_F32: tl.constexpr):
    """One tile of keys (token-heads at flat ``rows``) into the online softmax of q's rows:
    K and V dequantised to q's dtype (as the torch path's gather gives them), the scores
    where ``allowed`` [rows of q, tile] kept, the running maximum, sum and output updated."""
    k = _dequant(k_data, k_scale, rows, offs_d, in_tok, in_d, DATA_DIM, NUM_SCALES, KIND)
    s = _dot(q, tl.trans(k.to(q.dtype)), DOT_F32)
    s = tl.where(allowed, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    corr = tl.exp(m - m_new)
    v = _dequant(v_data, v_scale, rows, offs_d, in_tok, in_d, DATA_DIM, NUM_SCALES, KIND)
    acc = acc * corr[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_F32)
    return m_new, den * corr + tl.sum(p, 1), acc


def split_kernel(q_ptr, k_data, k_scale, v_data, v_scale, table_ptr, lens_ptr,  # noqa: ANN001
                 out_ptr, lse_ptr, sm_scale, stride_qb, stride_qh, stride_table, split_len,
                 splits, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DP: tl.constexpr, DATA_DIM: tl.constexpr,
                 NUM_SCALES: tl.constexpr, KIND: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + row)
    # split_len 0: this row's own context cut into ``splits`` spans of whole tiles (a
    # captured graph's split count is fixed, whatever the rows' lengths)
    span = tl.where(split_len > 0, split_len,
                    tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N)
    start = split * span
    end = tl.minimum(length, start + span)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_n = tl.arange(0, BLOCK_N)
    in_g = offs_g < GROUP
    in_d = offs_d < HEAD_DIM
    qh = head * GROUP + offs_g  # this kv head's query heads
    q = tl.load(q_ptr + row * stride_qb + qh[:, None] * stride_qh + offs_d[None, :],
                mask=in_g[:, None] & in_d[None, :], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        in_tok = tok < end
        page = tl.load(table_ptr + row * stride_table + tok // BLOCK_SIZE, mask=in_tok,
                       other=0).to(tl.int64)
        rows = (page * BLOCK_SIZE + tok % BLOCK_SIZE) * KV_HEADS + head
        m, den, acc = _tile(q, m, den, acc, k_data, k_scale, v_data, v_scale, rows, offs_d,
                            in_tok, in_d, in_tok[None, :], sm_scale, DATA_DIM, NUM_SCALES,
                            KIND, DOT_F32)
    # a split past the row's end (or an empty one) leaves m at -inf: den 0, weight 0
    safe = tl.where(den > 0, den, 1.0)
    at = (row * KV_HEADS * GROUP + qh) * splits + split  # [GP]
    tl.store(out_ptr + at[:, None] * DP + offs_d[None, :], acc / safe[:, None],
             mask=in_g[:, None] & in_d[None, :])
    tl.store(lse_ptr + at, tl.where(den > 0, m + tl.log(safe), float("-inf")), mask=in_g)


def prefill_kernel(q_ptr, k_data, k_scale, v_data, v_scale, slots_ptr,  # noqa: ANN001
                   out_ptr, slot0, n, context, sm_scale, stride_qt, stride_qh, stride_ot,
                   stride_oh, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TOK: tl.constexpr,
                   R: tl.constexpr, HEAD_DIM: tl.constexpr, DP: tl.constexpr,
                   DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr, KIND: tl.constexpr,
                   BLOCK_N: tl.constexpr, SLOTS: tl.constexpr, DOT_F32: tl.constexpr):
    """A prefill chunk of ``n`` queries at the end of a ``context``-token sequence: one
    program a block of TOK queries and one kv head, its R rows (query token, GQA head)
    walking the keys up to the block's last position, each key's slot read from
    ``slots_ptr`` (SLOTS) or ``slot0 + position``, causally masked, softmax online."""
    blk = tl.program_id(0)
    head = tl.program_id(1)
    offs_r = tl.arange(0, R)
    offs_d = tl.arange(0, DP)
    offs_n = tl.arange(0, BLOCK_N)
    in_d = offs_d < HEAD_DIM
    tok = blk * TOK + offs_r // GROUP
    valid = (offs_r < TOK * GROUP) & (tok < n)
    qpos = context - n + tok  # each row's position in the sequence
    qh = head * GROUP + offs_r % GROUP
    q = tl.load(q_ptr + tok[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & in_d[None, :], other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    den = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DP], tl.float32)
    last = tl.minimum(context, context - n + blk * TOK + TOK)  # keys past it: masked for all
    for n0 in range(0, last, BLOCK_N):
        kpos = n0 + offs_n
        in_tok = kpos < last
        if SLOTS:
            slot = tl.load(slots_ptr + kpos, mask=in_tok, other=0).to(tl.int64)
        else:
            slot = slot0 + kpos.to(tl.int64)
        rows = slot * KV_HEADS + head
        # key 0 is every row's in the first tile: no row's maximum stays -inf after it
        m, den, acc = _tile(q, m, den, acc, k_data, k_scale, v_data, v_scale, rows, offs_d,
                            in_tok, in_d, in_tok[None, :] & (kpos[None, :] <= qpos[:, None]),
                            sm_scale, DATA_DIM, NUM_SCALES, KIND, DOT_F32)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + qh[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & in_d[None, :])


def merge_kernel(part_ptr, lse_ptr, o_ptr, stride_ob, stride_oh, splits,  # noqa: ANN001
                 HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DP: tl.constexpr,
                 SP: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    in_s = offs_s < splits
    at = (row * HEADS + head) * splits + offs_s
    lse = tl.load(lse_ptr + at, mask=in_s, other=float("-inf"))
    top = tl.max(lse, 0)
    full = in_s & (lse > float("-inf"))  # an empty split's partial output is not read
    w = tl.where(full, tl.exp(lse - top), 0.0)
    part = tl.load(part_ptr + at[:, None] * DP + offs_d[None, :],
                   mask=full[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + row * stride_ob + head * stride_oh + offs_d,
             o.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def build(interpret: bool) -> tuple[Any, Any, Any]:
    """The split, merge and prefill kernels compiled for the device, or run by Triton's
    interpreter on CPU."""
    # Triton specialises an int argument on its value 1 and divisibility by 16, and a pointer
    # on its alignment: the split count and length, a step's table width, a chunk's length
    # and context grow with the sequences, and the lengths and slots are views at any
    # offset, so none of them is specialised on (one build per layer shape, not one every
    # few hundred tokens of a growing context)
    keeps = ({"do_not_specialize": ["stride_table", "split_len", "splits"],
              "do_not_specialize_on_alignment": ["table_ptr", "lens_ptr", "q_ptr"]},
             {"do_not_specialize": ["splits"]},
             {"do_not_specialize": ["slot0", "n", "context"],
              "do_not_specialize_on_alignment": ["slots_ptr", "q_ptr"]})
    kernels = (split_kernel, merge_kernel, prefill_kernel)
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return tuple(InterpretedFunction(k, **keep)  # type: ignore[return-value]
                     for k, keep in zip(kernels, keeps, strict=True))
    return tuple(triton.jit(k, **keep)  # type: ignore[return-value]
                 for k, keep in zip(kernels, keeps, strict=True))
