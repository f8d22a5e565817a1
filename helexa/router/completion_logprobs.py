"""A completion's logprobs in OpenAI's legacy shape, and the prompt an echo starts it with.

`tokens`, `token_logprobs`, `top_logprobs` (token text -> logprob: the k best and
the token itself) and `text_offset` are parallel lists. Where the choice echoes its prompt with
logprobs (the neuron's `prompt_logprobs`, asked for by forward.py) the prompt's
tokens come first, as OpenAI's and vLLM's: the first has no logprob and no
alternatives (null: nothing precedes it), a -inf is written -9999.0 (JSON has no
-inf; vLLM's floor), and their offsets are the neuron's, into the prompt's text
as it decoded it, which is the echo; the generated tokens' follow from the echo's
end, each after the text of the one before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from helexa.proto import neuron_pb2 as pb
from helexa.router.forward import asks_prompt_text
from helexa.router.openai_api import ParsedRequest

JSON = msgspec.json.Encoder()

Top = dict[str, float] | None


def echo_text(req: ParsedRequest, call: Any) -> str:
    """The prompt a completion's choice starts with where it echoes (else ""): the
    neuron's text of it where the router asked for one (forward.asks_prompt_text), else the
    client's. `call`: the choice's forward.OpenStream or Completed."""
    if not req.echo:
        return ""
    if not asks_prompt_text(req):
        return req.prompt_text or ""
    first: pb.GenerateResponse | None = getattr(call, "first", None)
    reply: pb.GenerateResponse = first if first is not None else call.reply
    return reply.prompt_text


def each(buf: bytearray, items: Iterable[Any], fn: Callable[[Any], Any]) -> None:
    """A JSON array of fn(item) for each item, appended to buf an item at a time."""
    buf += b"["
    for i, item in enumerate(items):
        if i:
            buf += b","
        JSON.encode_into(fn(item), buf, -1)
    buf += b"]"


def offsets(lps: list[pb.TokenLogprob], offset: int,
            prompt: list[pb.TokenLogprob] | None = None) -> list[int]:
    """Each token's offset in the choice's text: the echoed prompt's as the neuron placed
    them, then the generated ones' from `offset` on, a token's text after another's."""
    out = [t.text_offset for t in prompt or ()]
    for t in lps:
        out.append(offset)
        offset += len(t.token)
    return out


def _floor(lp: float) -> float:
    return max(lp, -9999.0)


def _rows(lps: list[pb.TokenLogprob], prompt: list[pb.TokenLogprob] | None
          ) -> Iterable[tuple[pb.TokenLogprob, float | None, Top]]:
    """Each token, its logprob and its alternatives, the prompt's first."""
    for i, t in enumerate(prompt or ()):
        if i == 0:
            yield t, None, None
        else:
            yield t, _floor(t.logprob), _top(t, _floor)
    for t in lps:
        yield t, t.logprob, _top(t, float)


def _top(t: pb.TokenLogprob, value: Callable[[float], float]) -> dict[str, float]:
    """The k best at a position and the token there (OpenAI's legacy API gives up to k + 1:
    a client reads `top_logprobs[i][tokens[i]]`), as vLLM's."""
    top = {a.token: value(a.logprob) for a in t.top}
    top.setdefault(t.token, value(t.logprob))
    return top


def as_dict(lps: list[pb.TokenLogprob], offset: int,
            prompt: list[pb.TokenLogprob] | None = None) -> dict[str, Any]:
    rows = list(_rows(lps, prompt))
    return {"tokens": [t.token for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows], "text_offset": offsets(lps, offset, prompt)}


def write(buf: bytearray, lps: list[pb.TokenLogprob], offset: int,
          prompt: list[pb.TokenLogprob]) -> None:
    """`as_dict`'s object written into buf a token at a time (encode.json_body: a reply of
    thousands of tokens' alternatives is never a dict of them all at once)."""
    buf += b'{"tokens":'
    each(buf, _rows(lps, prompt), lambda r: r[0].token)
    buf += b',"token_logprobs":'
    each(buf, _rows(lps, prompt), lambda r: r[1])
    buf += b',"top_logprobs":'
    each(buf, _rows(lps, prompt), lambda r: r[2])
    buf += b',"text_offset":'
    JSON.encode_into(offsets(lps, offset, prompt), buf, -1)
    buf += b"}"
