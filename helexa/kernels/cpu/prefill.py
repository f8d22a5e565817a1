"""A prefill chunk over cached context on CPU, as one causal forward over the whole prompt
would compute it: torch's CPU flash-attention kernel twice, merged by log-sum-exp.

A chunk of n queries at positions [c, c + n) attends to every cached key [0, c) and,
causally, to its own n keys. SDPA's ``is_causal`` aligns the mask top-left (query i sees
keys [0, i]), so the torch reference (kernels/attention.py) passes a dense [n, c + n] mask
instead, which SDPA turns into a float mask per layer and the kernel reads for every
block; past ``DECODE_CHUNK_TOKENS`` it computes the scores itself, a chunk of keys at a
time. Both cost several times a causal forward once prompts reach agent sizes (8k-48k
tokens). Here, as FlashAttention's and vLLM's chunked prefill do, the chunk's attention is
split at c:

- over the cached prefix, no mask at all (every query sees every cached key), the GQA
  group folded into the query axis so no K/V head is repeated;
- over its own keys, ``is_causal`` (the square is aligned: query i sees keys [c, c + i]);

each returns its rows' log-sum-exp, which weighs the two partial outputs into the softmax
over all c + n keys. Neither call builds a mask or visits a masked-out block, so a prompt
prefilled in chunks costs what one causal forward over it does.
"""

from __future__ import annotations

import torch

from helexa.kernels.attention import PrefillChunk
from helexa.kernels.paged_kv import PagedKV

# (q, k, v, dropout_p, is_causal) -> (out [B, H, L, d], logsumexp [B, H, L]): the kernel
# behind SDPA on CPU, which alone returns each row's log-sum-exp.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(dtype: torch.dtype) -> bool:
    """Whether this torch has the kernel, for this compute dtype."""
    return _FLASH is not None and dtype in _DTYPES


def context_prefill(q: torch.Tensor, kv: PagedKV, chunk: PrefillChunk) -> torch.Tensor:
    """Chunk queries q [n, heads, d] over their context (cached + their own, already in
    the pool ``kv``; ``chunk.context_len`` keys), causally: [n, heads, d]."""
    n, heads, d = q.shape
    kvh, t = kv.num_kv_heads, chunk.context_len
    g, c = heads // kvh, t - n
    if chunk.context_start is not None:
        k, v = kv.span_heads(chunk.context_start, t)  # [1, kvh, t, d]: views when plain
    else:
        assert chunk.context_slots is not None
        k, v = (x.unsqueeze(0) for x in kv.gather_heads(chunk.context_slots))
    # the cached prefix: queries [kvh, g * n] (head h = kv head h // g), no mask
    qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    o_pre, lse_pre = _FLASH(qf, k[:, :, :c], v[:, :, :c])
    # the chunk's own keys, causally, each kv head repeated for its group (n keys only)
    k_own, v_own = k[:, :, c:], v[:, :, c:]
    if g > 1:
        k_own, v_own = k_own.repeat_interleave(g, 1), v_own.repeat_interleave(g, 1)
    o_own, lse_own = _FLASH(q.transpose(0, 1).unsqueeze(0), k_own, v_own, 0.0, True)
    lse_pre, lse_own = lse_pre.reshape(heads, n, 1).float(), lse_own.reshape(heads, n, 1).float()
    top = torch.maximum(lse_pre, lse_own)
    w_pre, w_own = (lse_pre - top).exp_(), (lse_own - top).exp_()
    out = (o_pre.reshape(heads, n, d).float() * w_pre + o_own.reshape(heads, n, d).float() * w_own)
    return out.div_(w_pre + w_own).to(q.dtype).transpose(0, 1)
