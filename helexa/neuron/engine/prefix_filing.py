"""Prefix filing: a request's full blocks under the chain hash of the tokens they hold.

A block's key is the hash of its tokens chained to its parent's key
(block_key.hash_block_tokens), so equal keys mean equal prefixes up to and
including that block; an image's tokens are keyed by the image's content hash
(images.py: PromptImages.hash_ids), so two images of one size never share KV. A prompt's keys are known when it arrives (admission
looks them up to reuse cached blocks); its blocks are filed as the steps
complete them, prompt and output alike, so a later request sharing the
prefix finds them. The pool decides what a filed block becomes once its
request ends (cached, reclaimable); filing never moves a block.

Under kv.prefix_sharing = "principal" (the default) every chain starts from a
salt of its principal, so one principal's blocks are never found by another:
a hit, and usage.cached_tokens, would tell B that A sent the same prefix (a
block-by-block oracle on other tenants' prompts). "global" has no salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from helexa.neuron.engine.block_key import BlockKey, hash_block_tokens
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.request import Request


def cache_salt(prefix_sharing: str, principal: str) -> bytes:
    """The parent digest of a request's first block: its principal's, or none (global)."""
    if prefix_sharing == "global":
        return b""
    return hashlib.sha256(b"helexa-principal\0" + principal.encode()).digest()


def prompt_block_hashes(prompt: list[int], block_size: int, salt: bytes = b"") -> list[BlockKey]:
    """The chain keys of a prompt's full blocks, the first chained to `salt`."""
    hashes: list[BlockKey] = []
    parent = None
    for i in range(len(prompt) // block_size):
        parent = hash_block_tokens(parent, prompt[i * block_size:(i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


def file_full_blocks(pool: BlockPool, req: Request, pending: Sequence[int] = ()) -> None:
    """File every block of `req` completed since the last call under its chain key.
    `pending`: the tokens its step produced, not appended yet: a verification row's
    accepted drafts sit at the positions after req's tokens, computed already, and a block
    they end is keyed by them (a key over fewer tokens would match no later prompt)."""
    bs = pool.block_size
    start = max(req.num_filed_blocks, req.num_cached_tokens // bs)
    for i in range(start, req.num_computed_tokens // bs):
        if i >= len(req.block_hashes):
            parent = req.block_hashes[i - 1] if i else None
            have, end = req.num_tokens, (i + 1) * bs
            tokens = req.hash_slice(i * bs, min(end, have))
            if end > have:
                tokens = tokens + list(pending[max(0, i * bs - have):end - have])
            req.block_hashes.append(hash_block_tokens(parent, tokens, req.cache_salt))
        pool.register(req.block_table[i], req.block_hashes[i])
        req.num_filed_blocks = i + 1
