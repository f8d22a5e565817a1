"""`Refusal`: the one shape every refusal takes inside the neuron, daemon and engine alike.

A refusal is an OpenAI-style code (docs/errors.md's table: `overloaded`,
`context_length_exceeded`, `model_loading`, …), a message that names what is
wrong with its numbers, and, where the neuron can estimate one, how long the
caller should wait before trying again. The budget rule (helexa/budget.py)
returns one, engine admission (helexa/neuron/engine/admission.py) returns
one, the daemon raises one; the engine's travel to the daemon as a
`RequestUpdate`'s refused_* fields and become a `Refusal` again there.

Only the gRPC edge turns it into a status (helexa/neuron/grpc_status.py, the
one mapping): this module imports nothing beyond the standard library, so
the engine process and the router's import of the budget rule pay nothing.
"""

from __future__ import annotations


class Refusal(Exception):
    """A request (or operation) that will not be served, and why.

    An exception so that deep code can raise it; a value so that policy code
    (admission, the budget rule) can return it: `refusal = submit(req)`.
    """

    def __init__(self, code: str, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = max(0, int(retry_after_ms))

    def __repr__(self) -> str:
        retry = f", {self.retry_after_ms}" if self.retry_after_ms else ""
        return f"Refusal({self.code!r}, {self.message!r}{retry})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refusal) and (self.code, self.message, self.retry_after_ms) \
            == (other.code, other.message, other.retry_after_ms)

    def __hash__(self) -> int:
        return hash((self.code, self.message, self.retry_after_ms))
