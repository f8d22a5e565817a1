"""One benchmark request: send a streaming chat completion, record what happened.

Every request ends as a `Record` with an `outcome`, whatever the server or
the network did; nothing here raises for a failed request:

| outcome          | meaning                                                          |
|------------------|------------------------------------------------------------------|
| `ok`             | the stream ended with `data: [DONE]`                             |
| `refused`        | an HTTP error status before the stream (code and reason kept)    |
| `upstream_error` | an SSE error event inside the stream (code and reason kept)      |
| `timeout`        | `--timeout` passed before the stream ended                       |
| `abandoned`      | the bench itself hung up after the first token (`--abandon`)     |
| `disconnected`   | the server closed the connection before `[DONE]`                 |
| `error`          | no HTTP answer at all (connection refused, DNS, ...)             |
| `interrupted`    | Ctrl-C ended the run while it was in flight (not in the figures) |

Token arrival is recorded per chunk as (seconds since the request was sent,
tokens in that chunk). A chunk may carry several tokens; the count comes
from the chunk's `token_ids` (`return_token_ids`, as vLLM and helexa
offer), else one per chunk with text, and the usage block (asked for with
`stream_options.include_usage`) gives the final counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import msgspec


class Record(msgspec.Struct, omit_defaults=True):
    """One request, as a line of the JSONL output."""

    endpoint: str
    scenario: str
    index: int
    t_sent: float  # seconds since the run started
    outcome: str = "error"
    status: int | None = None
    code: str | None = None
    reason: str | None = None
    ttft: float | None = None  # seconds from send to the first token
    e2e: float | None = None  # seconds from send to the end (whatever the end was)
    chunks: list[tuple[float, int]] = msgspec.field(default_factory=list)
    prompt_tokens: int | None = None
    prompt_tokens_asked: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    concurrency: int | None = None  # the scenario's target concurrency (None: rate-driven)
    rate: float | None = None
    session: int | None = None
    turn: int | None = None
    principal: str | None = None
    reply: str = ""  # the generated text (multi-turn sessions send it back)

    def itl(self) -> list[float]:
        """Inter-token latency per token: a chunk of k tokens after a gap g gives k gaps of
        g/k (the first token's own wait is TTFT, not ITL)."""
        out: list[float] = []
        prev = None
        for t, k in self.chunks:
            if prev is not None and k > 0:
                out.extend([(t - prev) / k] * k)
            if k > 0:
                prev = t
        return out

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else sum(
            k for _, k in self.chunks)


def _error_fields(payload: Any) -> tuple[str | None, str | None]:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return err.get("code") or err.get("type"), err.get("message")
    if isinstance(err, str):
        return None, err
    return None, None


def _chunk_tokens(chunk: dict[str, Any]) -> tuple[int, str]:
    tokens, text = 0, ""
    for c in chunk.get("choices") or []:
        piece = (c.get("delta") or {}).get("content") or c.get("text") or ""
        text += piece
        ids = c.get("token_ids")
        tokens += len(ids) if isinstance(ids, list) else (1 if piece else 0)
    return tokens, text


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: Record, *,
               timeout_secs: float, abandon: bool = False,
               started: float | None = None) -> Record:
    """POST `body` (a streaming chat request) and fill `rec`; never raises for the request's
    own failures. `started` is the perf_counter() the record's times count from."""
    t0 = time.perf_counter() if started is None else started
    text: list[str] = []
    try:
        async with asyncio.timeout(timeout_secs):
            async with session.post(url, json=body) as r:
                rec.status = r.status
                if r.status != 200:
                    raw = await r.read()
                    rec.outcome = "refused"
                    try:
                        rec.code, rec.reason = _error_fields(json.loads(raw))
                    except ValueError:
                        rec.reason = raw[:200].decode(errors="replace")
                    rec.code = rec.code or str(r.status)
                    return rec
                done = await _read_stream(r, rec, t0, text, abandon)
                if rec.outcome == "upstream_error" or rec.outcome == "abandoned":
                    return rec
                rec.outcome = "ok" if done else "disconnected"
    except TimeoutError:
        rec.outcome = "timeout"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        rec.outcome, rec.reason = "disconnected", str(e) or type(e).__name__
    except (aiohttp.ClientError, OSError) as e:
        rec.outcome, rec.reason = "error", str(e) or type(e).__name__
    finally:
        rec.e2e = time.perf_counter() - t0
        rec.reply = "".join(text)
    return rec


async def _read_stream(r: aiohttp.ClientResponse, rec: Record, t0: float, text: list[str],
                       abandon: bool) -> bool:
    """Read SSE lines into `rec`; True when the stream ended with [DONE]."""
    async for raw in r.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        now = time.perf_counter() - t0
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if "error" in chunk:
            rec.outcome = "upstream_error"
            rec.code, rec.reason = _error_fields(chunk)
            return False
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        k, piece = _chunk_tokens(chunk)
        if k:
            if rec.ttft is None:
                rec.ttft = now
            rec.chunks.append((round(now, 6), k))
            text.append(piece)
            if abandon:  # hang up after the first token: the server must notice
                rec.outcome = "abandoned"
                r.close()
                return False
    return False
