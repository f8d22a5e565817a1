"""The thinking budget: where a request's thought is, and closing it when the budget is spent.

A thinking model writes its thought between markers (`<think>` ...
`</think>`), either opening it itself or having it opened by the prompt
(`Thinking.starts_open`). The engine follows the output in token space: it
counts the tokens written inside the thought and, once `budget_tokens` of
them were spent, writes the closing marker itself (the sampler's choice is
replaced, one forced token per step), so the answer follows. The thought and
the answer both come out of the request's one output budget (max_tokens),
which its KV reservation covers: a long thought cannot outgrow it. A grammar
(constrained output) applies to the answer only: the engine masks and feeds
its matcher once the thought is over. While a grammar waits for the answer, a
stop token sampled inside the thought does not end the request: the engine
writes the closing marker in its place (`close`), so the answer the grammar
holds still comes (docs/api.md, "JSON Schema keywords under constrained
decoding").
"""

from __future__ import annotations

import enum

from helexa.neuron.engine.messages import Thinking


class Phase(enum.IntEnum):
    OPENING = 0  # waiting to see whether the output opens a thought
    THINKING = 1
    CLOSING = 2  # budget spent: writing close_ids
    ANSWERING = 3  # the thought ended (or never began)


class ThoughtTracker:
    """One request's thought: feed every output token with `observe`; ask `forced` for the
    token the engine must write instead of the sampled one."""

    def __init__(self, spec: Thinking) -> None:
        self.spec = spec
        self.phase = Phase.THINKING if spec.starts_open else Phase.OPENING
        self.reasoning_tokens = 0
        self._recent: list[int] = []  # tokens since the thought opened (for the close match)
        self._opened = 0  # how much of open_ids matched so far
        self._forcing = 0  # how much of close_ids was forced so far
        if self.phase == Phase.THINKING and spec.budget_tokens <= 0:
            self.phase = Phase.CLOSING

    @property
    def answering(self) -> bool:
        """The thought is over (or never began): tokens now belong to the answer."""
        return self.phase == Phase.ANSWERING

    def unforced_tokens(self) -> int | None:
        """How many next tokens `forced` surely leaves to the sampler (None: all of them).
        Speculation drafts only that far (speculative/speculator.py): a forced token
        would invalidate the drafts verified after it."""
        if self.phase == Phase.ANSWERING:
            return None
        if self.phase == Phase.THINKING:  # CLOSING starts once the budget is spent
            return max(0, self.spec.budget_tokens - self.reasoning_tokens)
        return 0  # opening (the budget may be 0) or closing: one token at a time

    def forced(self) -> int | None:
        """The token to write next in place of sampling, or None."""
        if self.phase == Phase.CLOSING and self._forcing < len(self.spec.close_ids):
            return self.spec.close_ids[self._forcing]
        return None

    def close(self) -> None:
        """End the thought now: the closing marker is forced from its first token (a stop
        token sampled inside a thought that a grammar's answer must follow)."""
        if self.phase == Phase.THINKING:
            self.phase, self._forcing = Phase.CLOSING, 0

    def observe(self, token_id: int) -> None:
        s = self.spec
        if self.phase == Phase.OPENING:
            if self._opened < len(s.open_ids) and token_id == s.open_ids[self._opened]:
                self._opened += 1
                if self._opened == len(s.open_ids):
                    self.phase = Phase.THINKING if s.budget_tokens > 0 else Phase.CLOSING
            else:
                self.phase = Phase.ANSWERING
            return
        if self.phase == Phase.CLOSING:
            self._forcing += 1
            if self._forcing >= len(s.close_ids):
                self.phase = Phase.ANSWERING
            return
        if self.phase != Phase.THINKING:
            return
        self.reasoning_tokens += 1
        self._recent.append(token_id)
        n = len(s.close_ids)
        if n and self._recent[-n:] == s.close_ids:
            # The model closed the thought itself: its marker is not thought.
            self.reasoning_tokens -= n
            self.phase = Phase.ANSWERING
            return
        del self._recent[:-max(n, 1)]
        if self.reasoning_tokens >= s.budget_tokens:
            self.phase = Phase.CLOSING
