"""How many stop strings and stop token ids a request may carry, and how long a stop string
may be: one rule for the router, which checks a client's body against it, and the neuron,
which checks every call it gets the same way (a caller other than a router, or a router of
another version, gets the same refusal). docs/api.md, "Chat and completions: shared fields".
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP = 16
# A stop string's length: the neuron holds back from a stream what may begin one, so this
# bounds that wait and what it holds.
MAX_STOP_CHARS = 1024
# stop_token_ids: each neuron call carries them and its neuron builds their set on the event
# loop that carries every stream; 3.9M ids held one 2.35 s.
MAX_STOP_TOKEN_IDS = 1024


def stop_problem(stop: Sequence[str], stop_token_ids: Sequence[int]) -> str | None:
    """What is wrong with a call's stop strings and ids (a message naming the field), or None."""
    if len(stop) > MAX_STOP:
        return f"stop: expected at most {MAX_STOP} strings, got {len(stop)}"
    for i, s in enumerate(stop):
        if len(s) > MAX_STOP_CHARS:
            return (f"stop[{i}]: expected at most {MAX_STOP_CHARS} characters,"
                    f" got {len(s)}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return (f"stop_token_ids: expected at most {MAX_STOP_TOKEN_IDS} ids,"
                f" got {len(stop_token_ids)}")
    return None
