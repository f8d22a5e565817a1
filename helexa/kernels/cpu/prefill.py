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

each returns its rows' log-sum-exp, which weighs the partial outputs into the softmax over
all c + n keys. Neither call builds a mask or visits a masked-out block, so a prompt
prefilled in chunks costs what one causal forward over it does.

Temporaries stay bounded as kernels/attention.py promises: a prefix that is not a view of
the pool (blocks gathered from across it, or a quantised pool dequantised) is read
``DECODE_CHUNK_TOKENS`` keys at a time, one kernel call each, merged by the same
log-sum-exp arithmetic (at 65,536 cached tokens of an int8 pool, read whole, one layer's
chunk grew the process by 897 MiB).
"""

from __future__ import annotations

from itertools import chain

import torch

from helexa.kernels.attention import DECODE_CHUNK_TOKENS, PrefillChunk
from helexa.kernels.paged_kv import PagedKV

# (q, k, v, dropout_p, is_causal) -> (out [B, H, L, d], logsumexp [B, H, L]): the kernel
# behind SDPA on CPU, which alone returns each row's log-sum-exp.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(dtype: torch.dtype) -> bool:
    """Whether this torch has the kernel, for this compute dtype."""
    return _FLASH is not None and dtype in _DTYPES


def context_prefill(q: torch.Tensor, kv: PagedKV, chunk: PrefillChunk,
                    key_chunk: int = DECODE_CHUNK_TOKENS) -> torch.Tensor:
    """Chunk queries q [n, heads, d] over their context (cached + their own, already in
    the pool ``kv``; ``chunk.context_len`` keys), causally: [n, heads, d]. A prefix that
    would be copied is read ``key_chunk`` keys at a time."""
    n, heads, d = q.shape
    kvh, t = kv.num_kv_heads, chunk.context_len
    g, c = heads // kvh, t - n
    viewed = (chunk.context_start is not None and not kv.quantized
              and kv.k_cache.dtype == kv.compute)  # span_heads gives views: read it whole
    step = max(1, c if viewed else key_chunk)
    # the cached prefix: queries [kvh, g * n] (head h = kv head h // g), no mask
    qf = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * n, d)
    parts = (_FLASH(qf, *_keys(kv, chunk, k0, min(c, k0 + step))) for k0 in range(0, c, step))
    # the chunk's own keys, causally, each kv head repeated for its group (n keys only)
    k_own, v_own = _keys(kv, chunk, c, t)
    if g > 1:
        k_own, v_own = k_own.repeat_interleave(g, 1), v_own.repeat_interleave(g, 1)
    own = _FLASH(q.transpose(0, 1).unsqueeze(0), k_own, v_own, 0.0, True)
    acc = top = den = None
    for o, lse in chain(parts, (own,)):  # a softmax over all parts' keys, one at a time
        o, lse = o.reshape(heads, n, d).float(), lse.reshape(heads, n, 1).float()
        if acc is None:
            acc, top, den = o, lse, torch.ones_like(lse)
            continue
        new_top = torch.maximum(top, lse)
        was, w = (top - new_top).exp_(), (lse - new_top).exp_()
        acc = acc.mul_(was).add_(o.mul_(w))
        den = den.mul_(was).add_(w)
        top = new_top
    assert acc is not None and den is not None
    return acc.div_(den).to(q.dtype).transpose(0, 1)


def _keys(kv: PagedKV, chunk: PrefillChunk, k0: int, k1: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the context's keys [k0, k1), [1, kv_heads, k1 - k0, d] in the compute dtype."""
    if chunk.context_start is not None:
        return kv.span_heads(chunk.context_start + k0, k1 - k0)  # views when plain
    assert chunk.context_slots is not None
    k, v = kv.gather_heads(chunk.context_slots[k0:k1])
    return k.unsqueeze(0), v.unsqueeze(0)
