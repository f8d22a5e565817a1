"""One Generate stream folded into the one message Complete returns.

Generate sends deltas: text, token ids and their logprobs as they come, the
prompt's token ids on the first message when asked for, and the finish
reason, stop_reason and usage on the last. Complete answers with all of it
in one `GenerateResponse`. The neuron builds that message here, and so do
the router (for a neuron that predates Complete) and the tests' fake neuron,
so the two RPCs cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from helexa.proto import neuron_pb2 as pb


def merge_responses(msgs: Sequence[pb.GenerateResponse]) -> pb.GenerateResponse:
    """Concatenate text, extend token_ids, logprobs, prompt_token_ids and prompt_logprobs;
    prompt_tokens, fitted_max_tokens and prompt_text from the first message;
    finish_reason, stop_reason and usage from the last."""
    if len(msgs) == 1:
        return msgs[0]  # already whole (a short answer often is one message)
    out = pb.GenerateResponse(text="".join(m.text for m in msgs),
                              thought_open=any(m.thought_open for m in msgs),
                              prompt_tokens=msgs[0].prompt_tokens if msgs else 0,
                              fitted_max_tokens=msgs[0].fitted_max_tokens if msgs else 0,
                              prompt_text=msgs[0].prompt_text if msgs else "")
    for m in msgs:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
        out.prompt_token_ids.extend(m.prompt_token_ids)
        out.prompt_logprobs.extend(m.prompt_logprobs)
    if msgs:
        last = msgs[-1]
        out.finish_reason = last.finish_reason
        out.stop_reason = last.stop_reason
        if last.HasField("usage"):
            out.usage.CopyFrom(last.usage)
    return out
