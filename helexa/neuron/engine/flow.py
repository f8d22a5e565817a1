"""Flow control between the engine and a request's reader: a reader that falls behind
pauses its request in the engine.

The daemon's reader of a request's updates (the servicer, which takes the next
update only once gRPC has sent the last reply, so only as fast as the caller
reads) may fall behind the engine. Once PAUSE_TOKENS tokens wait unread on a
request's queue (EngineClient's), the engine is told to pause it
(ToEngine.paused: it leaves the batch, keeping its reservation; intake.py
`pause`), and once the reader has taken all but RESUME_TOKENS of them, to
resume it. So a caller that stops reading costs at most about PAUSE_TOKENS
tokens here (plus what the engine made before the word reached it: a step or
two) and no decode steps, and one that reads again gets every token in order.
"""

from __future__ import annotations

from collections.abc import Callable

# Unread tokens on a request's queue at which the engine pauses it, and to which they
# must fall before it resumes. A reader that keeps up leaves a step's tokens unread at
# most; a few hundred are seconds of one stream's decoding.
PAUSE_TOKENS = 256
RESUME_TOKENS = 64

# told when a request is paused (True) or resumed (False), with the tokens then unread
OnFlow = Callable[[bool, int], None]


class Flow:
    """Unread tokens per open request, which requests are paused, and the words for the
    engine's next message (`take`); `wake` is called when there is a word to send."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._unread: dict[str, int] = {}
        self._tell: dict[str, OnFlow] = {}
        self._paused: set[str] = set()
        self._pending: dict[str, bool] = {}

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def open(self, req_id: str, on_flow: OnFlow | None) -> None:
        self._unread[req_id] = 0
        if on_flow is not None:
            self._tell[req_id] = on_flow

    def close(self, req_id: str) -> None:
        """The request ended (the engine forgets it with its end): forget it here too."""
        self._unread.pop(req_id, None)
        self._tell.pop(req_id, None)
        self._paused.discard(req_id)
        self._pending.pop(req_id, None)

    def arrived(self, req_id: str, n: int, last: bool) -> None:
        """n tokens were queued for the reader (`last`: with the request's end)."""
        if req_id not in self._unread or not n:
            return
        unread = self._unread[req_id] = self._unread[req_id] + n
        if unread >= PAUSE_TOKENS and req_id not in self._paused and not last:
            self._say(req_id, True, unread)

    def taken(self, req_id: str, n: int) -> None:
        """The reader took n tokens."""
        if req_id not in self._unread:
            return
        unread = self._unread[req_id] = self._unread[req_id] - n
        if req_id in self._paused and unread <= RESUME_TOKENS:
            self._say(req_id, False, unread)

    def take(self) -> dict[str, bool]:
        """The words for the engine's next message (ToEngine.paused)."""
        out, self._pending = self._pending, {}
        return out

    def _say(self, req_id: str, paused: bool, unread: int) -> None:
        if paused:
            self._paused.add(req_id)
        else:
            self._paused.discard(req_id)
        self._pending[req_id] = paused
        self._wake()
        if (tell := self._tell.get(req_id)) is not None:
            tell(paused, unread)
