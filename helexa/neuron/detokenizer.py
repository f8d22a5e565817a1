"""Token ids → text deltas as they are generated, and stop strings over the stream.

`IncrementalDetokenizer` decodes a short window of recent tokens and emits
only what the newest tokens added, holding text back while it ends in an
incomplete UTF-8 character (byte-level BPE splits characters across
tokens: an emoji can take four). Decoding a window rather than one token at
a time keeps decoders that depend on neighbours (spaces, merges) correct.

`StopChecker` finds stop strings that may span token boundaries: it holds
back any tail that could be the start of a stop string, and never emits a
matched stop string or anything after it. Its cost is linear in the text: each
stop string runs a Knuth-Morris-Pratt automaton over the new text only (its
failure table built once per request), whose state is the length of the
longest tail of the text that is a prefix of that string, so what to hold back
is known without comparing the held text again each step. (Comparing every
prefix of a stop string of M characters against the tail, each step, cost M^2:
0.05 CPU s a step at M = 8,500 for 16 strings.) `CallTracker` says whether the
text so far ends inside a tool call (a caller's stop id does not end the reply
there: output_processor.py).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
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

    A stop string ends the text where it is first written whole: of two that end at
    one place, the longer (it began first).

    `calls` (a model's tool-call open and close tags, where the request offers tools):
    a stop string inside a call does not end the text, since the call would reach the
    client cut in half, its arguments not JSON; the stop strings apply to the text
    around the calls (docs/api.md, "Chat and completions: shared fields"). A stop
    string and a call's open tag that start at one place are the call."""

    def __init__(self, stop: list[str], calls: tuple[str, str] | None = None) -> None:
        self.stop = [s for s in stop if s]
        self._fail = [_failure(s) for s in self.stop]
        self._state = [0] * len(self.stop)  # per stop string: its prefix the text ends with
        self._calls = calls if self.stop else None
        self._in_call = False
        self._held = _Held()  # read, not yet emitted: what may begin a stop string or a tag
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to emit, the stop string matched now or None)."""
        if self.matched is not None:
            return "", None
        if not self.stop:
            return text, None
        out: list[str] = []
        held = self._held
        while True:
            if self._in_call:  # held: less than the close tag
                assert self._calls is not None
                close = self._calls[1]
                buf = held.take(held.size) + text
                j = buf.find(close)
                if j < 0:  # all but what may be the close tag's start
                    hold = _tail_prefix(buf, close)
                    held.add(buf[len(buf) - hold:])
                    out.append(buf[:len(buf) - hold])
                    return "".join(out), None
                out.append(buf[:j + len(close)])
                text, self._in_call = buf[j + len(close):], False
                continue  # the automata start afresh after a call (reset at its open tag)
            # Positions are in text, the part the automata have not read; held comes before
            # it (a negative position is in held).
            states, hit = self._advance(text)
            opened, tag, tail = None, "", ""
            if self._calls:  # a tag only now whole begins in held's last len(tag) - 1
                tag = self._calls[0]
                tail = held.tail(len(tag) - 1)
                at = (tail + text).find(tag)
                opened = at - len(tail) if at >= 0 else None
            if opened is not None and (hit is None or opened <= hit[0]):
                cut = opened + len(tag)
                out += [held.take(held.size), text[:cut]]
                text, self._in_call = text[cut:], True
                self._state = [0] * len(self.stop)
                continue
            if hit is not None:
                start, self.matched = hit
                held.add(text)
                out.append(held.take(held.size + start - len(text)))
                held.take(held.size)
                return "".join(out), self.matched
            self._state = states
            hold = max(states)
            if tag:
                hold = max(hold, _tail_prefix(tail + text, tag))
            held.add(text)
            out.append(held.take(held.size - hold))
            return "".join(out), None

    def _advance(self, text: str) -> tuple[list[int], tuple[int, str] | None]:
        """Each automaton run over text from its state: (the states at its end, the first
        match as (its start in text, negative where it began in held; the stop string) or
        None)."""
        states, best = [], None  # best: (end, -len, stop string)
        for s, fail, q in zip(self.stop, self._fail, self._state, strict=True):
            q, end = _scan(s, fail, q, text, 0)
            states.append(q)
            if end >= 0 and (best is None or (end, -len(s)) < best[:2]):
                best = (end, -len(s), s)
        return states, None if best is None else (best[0] + best[1], best[2])

    def flush(self) -> str:
        """At the end of the stream: the held tail (it never became a stop string)."""
        held = self._held.take(self._held.size)
        return "" if self.matched is not None else held


class _Held:
    """Text held back, kept as the pieces it came in: adding and releasing cost what they
    move, never what stays held (a stop string being written holds up to its length)."""

    def __init__(self) -> None:
        self.pieces: deque[str] = deque()
        self.offset = 0  # into pieces[0]: what of it was released already
        self.size = 0

    def add(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self.size += len(text)

    def take(self, k: int) -> str:
        """Release the first k characters (k <= size)."""
        parts, self.size = [], self.size - k
        while k:
            p, at = self.pieces[0], self.offset
            if len(p) - at <= k:
                parts.append(p[at:] if at else p)
                k -= len(p) - at
                self.pieces.popleft()
                self.offset = 0
            else:
                parts.append(p[at:at + k])
                self.offset, k = at + k, 0
        return "".join(parts)

    def tail(self, k: int) -> str:
        """The last k characters (all of it where fewer)."""
        parts, n = [], 0
        for i in range(len(self.pieces) - 1, -1, -1):
            if n >= k:
                break
            p = self.pieces[i][self.offset:] if i == 0 else self.pieces[i]
            parts.append(p[max(0, len(p) - (k - n)):])
            n += len(parts[-1])
        return "".join(reversed(parts))


@lru_cache(maxsize=256)
def _failure(s: str) -> tuple[int, ...]:
    """Knuth-Morris-Pratt's table: fail[i] is the length of the longest proper prefix of
    s[:i + 1] that is also its suffix. Cached: a request's n choices share one."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def _scan(s: str, fail: tuple[int, ...], q: int, text: str, i: int) -> tuple[int, int]:
    """Read text[i:] into the automaton of s at state q (text so far ends with s[:q]):
    (the state after it, or len(s) at the first match, and where that match ends in text,
    -1 for none). Amortised one step a character, most of them in C: where the state is 0
    it skips to the next character that could begin s, and a text that goes on following
    s (a long stop string being written) is compared in one piece, once where s begins
    and once at the start (each such comparison at most the feed's length or s's)."""
    m, n, first = len(s), len(text), s[0]
    whole = True  # the rest may be compared in one piece
    while i < n:
        if not q:
            i = text.find(first, i)
            if i < 0:
                return 0, -1
            q, i, whole = 1, i + 1, True
        elif whole:
            whole = False
            k = min(n - i, m - q)
            if s.startswith(text[i:i + k], q):
                q, i = q + k, i + k
        else:
            c = text[i]
            while q and s[q] != c:
                q = fail[q - 1]
            if s[q] == c:
                q += 1
            i += 1
        if q == m:
            return q, i
    return q, -1


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
