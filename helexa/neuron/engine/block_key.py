"""A full KV block's name in the prefix cache: a SHA-256 chain digest over its parent's
digest and its token ids, kept with both (block_pool.py explains how the pool files them)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockKey:
    """What a full block holds: its chain digest, its parent's digest and its tokens.

    Equality compares all three, so two keys that share a digest but not
    their content are different keys.
    """

    digest: bytes
    parent: bytes
    tokens: bytes  # the token ids as native int64 (8 B a token; keys never leave the process)


def _digest(parent: bytes, tokens: bytes) -> bytes:
    # Python's hash() of a tuple is cheap to collide on purpose; SHA-256 is not.
    return hashlib.sha256(parent + tokens).digest()


def hash_block_tokens(parent: BlockKey | None, token_ids: Sequence[int],
                      salt: bytes = b"") -> BlockKey:
    """Chain key of one full block: its digest depends on every token before it, too.

    `salt` stands in for the parent of a first block (prefix_filing.cache_salt): chains
    of different salts share no key, so their blocks are never found by each other.
    """
    parent_digest = parent.digest if parent is not None else salt
    tokens = array("q", token_ids).tobytes()
    return BlockKey(_digest(parent_digest, tokens), parent_digest, tokens)
