"""The answer's logprobs in a Responses reply (`include: ["message.output_text.logprobs"]`):
which of the neuron's token logprobs belong to an `output_text`.

The neuron sends each token's logprob (with its `top_logprobs` alternatives, as chat's)
beside the text. The encoder cuts each message's text where each token's own text ends
(`Tokens.pieces`: the tokens' bytes decoded in order, so a character split over two
tokens, or text the neuron held back a while, lands with the token that completed it) and
feeds the output parser a piece at a time, so no feed holds more than the text of one
token, plus what the parser held back. `Tokens` keeps the tokens whose text the parser has
not placed yet (it holds back what may start a marker): answer text takes the last of them
that cover it (the characters their bytes decode to at least as many as its) and drops
the ones before (a marker, the
end of the thought); text that went to the thought or to a call drops them all. So an
output_text's logprobs are those of the tokens that wrote it; the thought's, the calls'
and the markers' are in none, nor are those of tokens whose text never came (the end of
turn, a stop string cut off).
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Sequence
from typing import Any

from helexa.proto import neuron_pb2 as pb
from helexa.router.agent_output import Parts
from helexa.router.encode import chat_entry

Token = tuple[int, pb.TokenLogprob]  # a token's logprob, and the characters its bytes add


class Tokens:
    """One reply's tokens between the neuron's messages and the output_text they wrote."""

    def __init__(self) -> None:
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._ends: deque[tuple[int, Token]] = deque()  # where each token's text ends
        self._end = 0  # characters the tokens so far decode to
        self._cut = 0  # characters of text cut so far
        self.pending: list[Token] = []  # fed, their text not placed yet

    def pieces(self, text: str, lps: Sequence[pb.TokenLogprob]) -> list[tuple[str, list[Token]]]:
        """The next `text` of the reply (a message's, in order) cut where tokens' text ends,
        each piece with the tokens that end in it (lps: the tokens the message brought)."""
        for lp in lps:
            n = len(self._decode(lp.token_bytes or lp.token.encode("utf-8")))
            self._end += n
            self._ends.append((self._end, (n, lp)))
        out: list[tuple[str, list[Token]]] = []
        at, stop = 0, self._cut + len(text)
        while self._ends and self._ends[0][0] <= stop:
            end, token = self._ends.popleft()
            cut = max(at, end - self._cut)
            if out and cut == at:  # no text of its own here: with the piece before
                out[-1][1].append(token)
            else:
                out.append((text[at:cut], [token]))
                at = cut
        if at < len(text) or not out:
            out.append((text[at:], []))
        self._cut = stop
        return out

    def take(self, parts: Parts) -> list[dict[str, Any]]:
        """The logprob entries of the answer text in `parts` (what the parser made of the
        pending tokens' text); the pending tokens are placed or dropped."""
        if not parts.content:
            if parts.reasoning or parts.calls:
                self.pending.clear()
            return []
        k, covered = len(self.pending), 0
        while k and covered < len(parts.content):
            k -= 1
            covered += self.pending[k][0]
        while k and self.pending[k - 1][0] == 0:  # the first bytes of its first character
            k -= 1
        taken, self.pending = self.pending[k:], []
        return [chat_entry(lp) for _, lp in taken]
