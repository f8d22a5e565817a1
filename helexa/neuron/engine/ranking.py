"""A sampler's candidates in one order whatever the batch: the best k of each row, tied
values by token id (helexa/neuron/engine/sampler.py's truncate takes them).

A seeded request promises the same tokens whatever else is in its batch. Which way the
batch truncates (a top-k of the largest top_k asked, or the whole vocabulary sorted) is
the batch's, and topk and sort order tied values as they like; bf16 logits upcast to fp32
tie often, so without one order the same uniform lands on another token. Here the order
is a stable sort's: on the CPU a top-k with only a tied k-th place settled apart, on a GPU
(nothing read back) one top-k of an int64 key.
"""

from __future__ import annotations

import torch


def ranked(x: torch.Tensor, k: int, *, on_host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The best k of x [m, vocab] per row, best first and tied values by token id: (values,
    token ids). Whichever path the batch took (a top-k of some k, or the whole vocabulary
    sorted), a seeded row then gets the same candidates in the same order, so its uniform
    lands on the same token; topk orders ties as it likes, and bf16 logits tie often.
    ``on_host``: x's values may be read back to decide (the CPU, sampler.reads_back); on a
    GPU nothing is."""
    vocab = x.shape[1]
    if k >= vocab:
        return x.sort(dim=-1, descending=True, stable=True)  # stable: ties by token id
    if not on_host:
        return _ranked_by_key(x, k)
    vals, idx = x.topk(k + 1, dim=-1)
    # the k-th place tied with the one after it: topk kept which of the tie it liked (a
    # tie of -inf, masked tokens, carries no probability: its order moves no draw)
    last, after = vals[:, k - 1], vals[:, k]
    straddles = ((after == last) & (after > float("-inf"))) | after.isnan()
    idx, order = idx[:, :k].sort(dim=-1)  # ties by token id within the k
    vals, by_value = vals[:, :k].gather(1, order).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, by_value)
    for r in straddles.nonzero().squeeze(1).tolist():  # the CPU: settle the boundary alone
        row = x[r]
        if bool(row.isnan().any()):
            v, i = _ranked_by_key(row[None], k)
            vals[r], idx[r] = v[0], i[0]
            continue
        above = (row > last[r]).nonzero().squeeze(1)  # fewer than k, ascending ids
        tied = (row == last[r]).nonzero().squeeze(1)[:k - above.numel()]
        ids = torch.cat([above, tied])
        vals[r], order = row[ids].sort(descending=True, stable=True)
        idx[r] = ids[order]
    return vals, idx


_KEY_BYTES = 64 * 2**20  # what _ranked_by_key's keys and their temporaries hold at once


def _ranked_by_key(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked` in one top-k of an int64 key a token: the value's bits made
    order-preserving, above the reversed token id. Exact, and nothing read back; rows
    taken in parts of at most _KEY_BYTES (~24 B a logit), a decode batch's in one."""
    vocab = x.shape[1]
    rows = max(1, _KEY_BYTES // (24 * vocab))
    if x.shape[0] > rows:
        parts = [_ranked_by_key(part, k) for part in x.split(rows)]
        return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])
    # + 0.0: -0.0 ties +0.0, as in a sort; every NaN the largest, as a sort ranks them
    f = x.float() + 0.0
    bits = torch.where(f.isnan(), f.abs(), f).view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long() << 32
    key += vocab - 1 - torch.arange(vocab, device=x.device)
    idx = (vocab - 1) - (key.topk(k, dim=-1)[0] & 0xFFFFFFFF)
    return x.gather(1, idx), idx
