"""Token ids → text deltas as they are generated, and stop strings over the stream.

`IncrementalDetokenizer` decodes a short window of recent tokens and emits
only what the newest tokens added, holding text back while it ends in an
incomplete UTF-8 character (byte-level BPE splits characters across
tokens: an emoji can take four). Decoding a window rather than one token at
a time keeps decoders that depend on neighbours (spaces, merges) correct.

`StopChecker` finds stop strings that may span token boundaries: it holds
back any tail that could be the start of a stop string, and never emits a
matched stop string or anything after it. `CallTracker` says whether the text
so far ends inside a tool call (a caller's stop id does not end the reply there:
output_processor.py).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a byte-level decoder yields for an incomplete character
# Tokens of the prompt decoded as left context for the first output token.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed generated ids; get back the text they add, never half a character."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        # ids[prefix_offset:read_offset] decoded is what was already emitted
        # (plus left context); ids[read_offset:] is pending.
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # all output text emitted so far

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the new complete text (possibly "")."""
        self.ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is held, replacement characters included."""
        return self._emit(final=True)

    def held(self) -> str:
        """The text of the ids added but not emitted yet ("" when none): an incomplete
        character's U+FFFD, or a real one, until what follows tells them apart."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return self._decode(self.ids[self.prefix_offset:])[len(prefix):]

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        # A trailing U+FFFD is an incomplete character still waiting for its
        # next bytes (or, rarely, a real one: flush() lets it out).
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def decode_with_offsets(tokenizer: Any, ids: list[int]) -> tuple[str, list[int]]:
    """`ids` as text, decoded as an output is (special tokens skipped, a window at a time),
    and where each token's text begins in it, in characters: after the text of the tokens
    before it, as far as that text is the final one's (held back, a split character's
    first bytes read U+FFFD, which the final text has not). So a token that completes a
    character begins where the character does, as do those that began it; one that adds
    no text (a skipped special token) where the next text begins."""
    detok = IncrementalDetokenizer(tokenizer, [])
    marks = []  # before each token: the text emitted, and the text held back
    for i in ids:
        marks.append((len(detok.text), detok.held()))
        detok.add([i])
    detok.flush()
    text = detok.text
    return text, [at + _common(held, text, at) for at, held in marks]


def _common(held: str, text: str, at: int) -> int:
    """How many characters of `held` text[at:] starts with."""
    n = 0
    while n < len(held) and at + n < len(text) and held[n] == text[at + n]:
        n += 1
    return n


class StopChecker:
    """Cuts the text stream at the first stop string; emits nothing that might be one.

    `calls` (a model's tool-call open and close tags, where the request offers tools):
    a stop string inside a call does not end the text, since the call would reach the
    client cut in half, its arguments not JSON; the stop strings apply to the text
    around the calls (docs/api.md, "Chat and completions: shared fields"). A stop
    string and a call's open tag that start at one place are the call."""

    def __init__(self, stop: list[str], calls: tuple[str, str] | None = None) -> None:
        self.stop = [s for s in stop if s]
        self._calls = calls if self.stop else None
        self._in_call = False
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched now or None)."""
        if self.matched is not None:
            return "", None
        if not self.stop:
            return text, None
        buf, out = self._held + text, ""
        while True:
            if self._in_call:
                assert self._calls is not None
                close = self._calls[1]
                j = buf.find(close)
                if j < 0:  # all but what may be the close tag's start
                    hold = _tail_prefix(buf, close)
                    self._held = buf[len(buf) - hold:] if hold else ""
                    return out + buf[:len(buf) - hold], None
                out, buf, self._in_call = out + buf[:j + len(close)], buf[j + len(close):], False
            hit: tuple[int, str] | None = None
            for s in self.stop:
                i = buf.find(s)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            opened = buf.find(self._calls[0]) if self._calls else -1
            if opened >= 0 and (hit is None or opened <= hit[0]):
                assert self._calls is not None
                cut = opened + len(self._calls[0])
                out, buf, self._in_call = out + buf[:cut], buf[cut:], True
                continue
            if hit is not None:
                self.matched, self._held = hit[1], ""
                return out + buf[:hit[0]], hit[1]
            hold = self._partial_len(buf)
            if self._calls:
                hold = max(hold, _tail_prefix(buf, self._calls[0]))
            self._held = buf[len(buf) - hold:] if hold else ""
            return out + buf[:len(buf) - hold], None

    def _partial_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        return max(_tail_prefix(buf, s) for s in self.stop)

    def flush(self) -> str:
        """At the end of the stream: the held tail (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


class CallTracker:
    """Whether the text fed so far ends inside a tool call (`calls`: its open and close
    tags): after an open tag that no close tag has followed yet. Tags may arrive split
    over pieces."""

    def __init__(self, calls: tuple[str, str]) -> None:
        self._calls = calls
        self.inside = False
        self._tail = ""  # what may be the start of the tag looked for next

    def feed(self, text: str) -> None:
        buf = self._tail + text
        while (i := buf.find(tag := self._calls[1 if self.inside else 0])) >= 0:
            buf, self.inside = buf[i + len(tag):], not self.inside
        hold = _tail_prefix(buf, self._calls[1 if self.inside else 0])
        self._tail = buf[len(buf) - hold:] if hold else ""


def _tail_prefix(buf: str, marker: str) -> int:
    """Length of the longest tail of buf that is a proper prefix of marker."""
    return next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1)
                 if buf.endswith(marker[:k])), 0)
