"""Prompts of an exact length in tokens, as the server counts them (chat template included).

The count comes from the checkpoint's own tokenizer when `--tokenizer DIR`
is given (tokenizer.json and the chat template of tokenizer_config.json or
chat_template.jinja), else from the endpoint's `/tokenize` (vLLM's shape:
`POST /tokenize {"model", "messages"}` → `{"count"}`). With neither, prompts are
estimates: words times tokens a word, a ratio each endpoint learns from the
`prompt_tokens` its answers report (bench_load.py), and the records say what
the server counted.

A prompt is words from a fixed list after a per-request salt (so no two
requests share a prefix unless a session means them to); the number of
words is found by bisection on the count, then single-character words pad
the last token or two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from helexa.budget import tokens_past_context

_WORDS = ("the quiet harbour keeps its lights burning while ships come home across the grey "
          "water and sailors tell stories of distant islands where winter never reaches and "
          "the markets smell of salt bread and oranges").split()
_PAD = "a"

Counter = Callable[[list[dict[str, str]]], Awaitable[int | None]]


def words(n: int, salt: int) -> str:
    """The salt, then n words of the list in order from a salt-chosen start: every prompt
    draws on all the words alike, so tokens a word hardly vary between prompts."""
    start = salt % len(_WORDS)
    return " ".join([f"({salt})", *(_WORDS[(start + i) % len(_WORDS)] for i in range(n))])


def local_counter(tokenizer_dir: str | Path) -> Counter:
    """Count with the checkpoint's tokenizer and chat template, as a helexa neuron does."""
    from helexa.neuron.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)

    async def count(messages: list[dict[str, str]]) -> int | None:
        return len(tok.encode_chat(messages))
    return count


async def remote_counter(session: aiohttp.ClientSession, base_url: str, model: str
                         ) -> Counter | None:
    """The endpoint's /tokenize, if it has one that counts chat messages."""
    url = base_url.rstrip("/") + "/tokenize"

    async def count(messages: list[dict[str, str]]) -> int | None:
        async with session.post(url, json={"model": model, "messages": messages}) as r:
            if r.status != 200:
                # helexa refuses a chat past the context with the count it reached, "at
                # least N tokens" (docs/api.md): a count above any target that fits
                return tokens_past_context(await r.text()) if r.status == 400 else None
            body: Any = await r.json()
        if isinstance(body, dict):
            if isinstance(body.get("count"), int):
                return int(body["count"])
            if isinstance(body.get("tokens"), list):
                return len(body["tokens"])
        return None
    try:
        probe = await count([{"role": "user", "content": "hello"}])
    except (aiohttp.ClientError, ValueError, TimeoutError):
        return None
    return count if probe else None


async def exact_prompt(count: Counter | None, history: list[dict[str, str]], tokens: int,
                       salt: int, tokens_per_word: float = 1.25
                       ) -> tuple[list[dict[str, str]], int | None]:
    """`history` plus one user turn, the whole conversation `tokens` long as counted.

    Returns (messages, counted tokens or None when nothing could count). When the history
    alone is already longer, the user turn is one salt word."""
    def conv(n: int, pad: int = 0) -> list[dict[str, str]]:
        text = words(n, salt) + (" " + " ".join([_PAD] * pad) if pad else "")
        return [*history, {"role": "user", "content": text}]

    if count is None:  # an estimate: tokens_per_word as the caller last measured it
        base = sum(len(m["content"].split()) for m in history) * tokens_per_word
        return conv(max(0, int((tokens - base) / tokens_per_word))), None
    lo, hi = 0, 1
    while (await count(conv(hi)) or 0) <= tokens:  # grow until past the target
        lo, hi = hi, hi * 2
        if hi > 1 << 22:
            break
    while hi - lo > 1:  # largest word count not over the target
        mid = (lo + hi) // 2
        if (await count(conv(mid)) or 0) <= tokens:
            lo = mid
        else:
            hi = mid
    best = conv(lo)
    got = await count(best) or 0
    pad = 0
    while got < tokens and pad < 16:  # close the last gap a word left
        pad += 1
        trial = conv(lo, pad)
        n = await count(trial) or 0
        if n > tokens:
            break
        best, got = trial, n
    return best, got
