r"""Whether a long text reaches a token limit, counted in pieces: a prompt past the context is
refused without tokenising, or holding, all of it.

Tokenising a 7.8 MB prompt whole took the neuron 20 s and 1.4 GB (the library's Encoding of
5.2M tokens) only to refuse it for the context. `check` counts the text's tokens a piece of
about `PIECE_CHARS` characters at a time and stops with `PastLimit` once the count reaches
the limit; a text that fits is then tokenised whole by its caller, as before.

The count is exact, not an estimate, for the tokenizers `splittable` accepts: byte-level BPE
after one of the regex pre-tokenizers below (GPT-2's, cl100k's / Llama 3's, Qwen2's and
Qwen3's), no normalizer but NFC, and no added token that a cut could fall inside or that
takes whitespace along. A piece is cut only before a space that follows a character that is
not whitespace, or before a newline that follows an ASCII letter or digit. In each of those
patterns no pre-token holds either pair (a space only ever begins one; a newline ends one of
punctuation, never of letters or digits), and none looks behind, so every pre-token of the
whole text lies in one piece and each piece's pre-tokens are the whole text's (no piece but
the last ends in whitespace, so the `\s+(?!\S)` look-ahead sees the same); NFC composes
nothing across a space or newline; BPE merges only within a pre-token. So the pieces' ids,
end to end, are the whole text's (tests/neuron/test_token_bound.py compares them), and the
count of a prefix of pieces is a count the whole text has at least. Any other tokenizer's
text is not counted in pieces: it is tokenised whole, as before.

A piece with nowhere to cut for `LONG_PIECE_CHARS` (no spaces: "a.b" repeated, a CJK text)
is not tokenised at all: `ByteBound` gives a count it has at least from its bytes alone.
Each token of a byte-level BPE stands for bytes of the (normalised) text, the tokens' bytes
end to end are the text's, and no token of the vocabulary holds more than `most[b]` of byte
`b` (nor more than its longest, ASCII or not, of all bytes, ASCII bytes or others), so the
piece has at least count(b) / most[b] tokens for every byte and class: 7.8 MB of "a.b" or
6 MB of CJK cost a pass over their bytes, not seconds and 1.6 GB of the library's Encoding.
A text that fits is still tokenised whole by its caller, so its ids are the whole text's.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from typing import Any

import numpy as np

PIECE_CHARS = 1 << 16  # characters a piece holds about: ~16k tokens of English, a few MB held
LONG_PIECE_CHARS = 4 * PIECE_CHARS  # a piece past this, cut nowhere, is bounded (ByteBound)

# A piece ends at a character that is not whitespace before a space, or at an ASCII letter
# or digit before a newline (after punctuation, the patterns keep the newline with it).
_CUT = re.compile(r"\S(?= )|[A-Za-z0-9](?=\n)")

# The pre-tokenizer regexes within which a cut is a pre-token boundary (see above).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PATTERNS = frozenset({_QWEN2, _CL100K})


class PastLimit(Exception):
    """The text has at least `at_least` tokens, which is the limit or more."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def splittable(spec: dict) -> bool:
    """Whether the tokenizer of `spec` (tokenizer.json's object) tokenises a text cut as
    `pieces` cuts it to the whole text's ids, end to end (the module's reasoning)."""
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("dropout") or norm not in (None, {"type": "NFC"}):
        return False
    if any(_CUT.search(t.get("content", "")) or t.get("lstrip") or t.get("rstrip")
           or t.get("single_word") for t in spec.get("added_tokens") or ()):
        return False  # an added token a cut could fall inside, or that takes a space along
    if pre.get("type") == "ByteLevel":  # GPT-2's own pattern
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space")
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return False
    split, level = steps
    return (split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and not split.get("invert") and (split.get("pattern") or {}).get("Regex") in _PATTERNS
            and level.get("type") == "ByteLevel" and not level.get("use_regex", True)
            and not level.get("add_prefix_space"))


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of each piece of `text`: about `size` characters, cut only where `_CUT`
    allows, before a space after a non-space character or before a newline after an ASCII
    letter or digit (a text with no such place: one piece)."""
    start = 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        yield start, m.end()
        start = m.end()
    yield start, len(text)


def check(tok: Any, text: str, add_special_tokens: bool, limit: int, before: int = 0,
          bound: ByteBound | None = None) -> None:
    """Raise PastLimit when `before` tokens and the text's reach `limit`, counting the text a
    piece at a time and stopping there; a piece longer than LONG_PIECE_CHARS counts what
    `bound` says it has at least, untokenised. A text whose UTF-8 bytes and special tokens
    come short of the limit is not counted (a byte-level token holds a byte at least). Only
    for a `tok` that `splittable` accepts: of any other, the caller's whole tokenisation
    decides, as it does where the count stays short of the limit."""
    count = before + (tok.num_special_tokens_to_add(False) if add_special_tokens else 0)
    if count + len(text) < limit and count + len(text.encode()) < limit:  # chars <= bytes
        return
    for start, end in pieces(text, PIECE_CHARS):
        if bound is not None and end - start > LONG_PIECE_CHARS:
            count += bound.at_least(text[start:end])
        else:
            count += len(encode(tok, text[start:end], False))
        if count >= limit:
            raise PastLimit(count)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> the byte it stands for."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable},
            **{chr(256 + i): b for i, b in enumerate(others)}}


class ByteBound:
    """The most of each byte (and of all bytes, ASCII bytes, other bytes) one token of a
    byte-level BPE vocabulary holds: a lower bound on a text's tokens, untokenised."""

    def __init__(self, most: np.ndarray, nfc: bool) -> None:
        self.most, self.nfc = most, nfc  # most: [256 bytes, all, ASCII, other]

    @classmethod
    def of(cls, spec: dict) -> ByteBound | None:
        """The bound of a tokenizer.json `splittable` accepts, or None where its vocabulary
        lacks a byte's own token or a token is more than its bytes (a subword prefix)."""
        model = spec.get("model") or {}
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or not isinstance(model.get("vocab"), dict):
            return None
        decoder, most = _byte_decoder(), np.zeros(259, dtype=np.int64)
        if any(c not in model["vocab"] for c in decoder):
            return None  # a byte with no token of its own: BPE could drop it
        texts = [t.get("content", "").encode() for t in spec.get("added_tokens") or ()]
        for piece in model["vocab"]:
            if all(c in decoder for c in piece):  # else no byte-level text makes it
                texts.append(bytes(decoder[c] for c in piece))
        # every token's bytes end to end, each byte tagged with its token's index
        data = np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.int64)
        owner = np.repeat(np.arange(len(texts)), [len(t) for t in texts])
        pairs, counts = np.unique(owner * 256 + data, return_counts=True)
        np.maximum.at(most, pairs % 256, counts)  # the most of byte b in one token
        for column, which in ((256, data >= 0), (257, data < 128), (258, data >= 128)):
            most[column] = np.bincount(owner[which], minlength=1).max()
        return cls(np.maximum(most, 1), (spec.get("normalizer") or {}).get("type") == "NFC")

    def at_least(self, text: str) -> int:
        """Tokens `text` has at least, whole (after the normaliser, which the pieces of
        `pieces` keep apart)."""
        raw = (unicodedata.normalize("NFC", text) if self.nfc else text).encode()
        counts = np.bincount(np.frombuffer(raw, dtype=np.uint8), minlength=256)
        ascii_ = int(counts[:128].sum())
        have = np.array([*counts, len(raw), ascii_, len(raw) - ascii_], dtype=np.int64)
        return int((-(-have // self.most)).max()) if len(raw) else 0


# Beyond this many characters encode through encode_batch_fast, which releases the GIL while
# it works (encode holds it: seconds for a megabyte, freezing every other thread's Python).
# The fast form (tokenizers >= 0.20) skips offsets: freeing a 7 MB text's Encoding with
# them held the GIL 2.5 s, without them 0.07 s. The ids are the same.
LONG_TEXT_CHARS = 16384


def encode(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of `text` by `tok` (a tokenizers.Tokenizer), whole."""
    if len(text) > LONG_TEXT_CHARS:
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids

