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
count of a prefix of pieces is a count the whole text has at least. A text with nowhere to
cut (no spaces: CJK, say) is one piece; any other tokenizer's text is not counted in pieces:
either is tokenised whole, as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

PIECE_CHARS = 1 << 16  # characters a piece holds about: ~16k tokens of English, a few MB held

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


def check(tok: Any, text: str, add_special_tokens: bool, limit: int, before: int = 0) -> None:
    """Raise PastLimit when `before` tokens and the text's reach `limit`, counting the text a
    piece at a time and stopping there. A text whose UTF-8 bytes and special tokens come short
    of the limit is not counted (a byte-level token holds a byte at least). Only for a `tok`
    that `splittable` accepts: of any other, the caller's whole tokenisation decides."""
    count = before + (tok.num_special_tokens_to_add(False) if add_special_tokens else 0)
    if count + len(text) < limit and count + len(text.encode()) < limit:  # chars <= bytes
        return
    for start, end in pieces(text):
        count += len(encode(tok, text[start:end], False))
        if count >= limit:
            raise PastLimit(count)


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

