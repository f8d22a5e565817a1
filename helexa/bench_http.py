"""`helexa bench`: HTTP load against any OpenAI-compatible endpoint, streaming chat requests.

    helexa bench --url http://127.0.0.1:8080 --model helexa/balanced \\
        --scenario chat:512 --scenario concurrency:8 [--requests N] [--max-tokens 64] [--json]

A scenario is `chat:<prompt_tokens>` (prompts of about that many tokens, one
stream at a time unless the same scenario also says `concurrency`) or
`concurrency:<n>` (n streams at once, short prompts); both may be combined
as `chat:512,concurrency:8`. Each scenario reports TTFT p50/p95,
inter-token latency p50/p95 (gaps between content chunks), per-stream
decode tok/s (median), aggregate tok/s (all completion tokens over the
scenario's wall time), and refused requests by HTTP status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp

_WORDS = ("the quiet harbour keeps its lights burning while ships come home across the grey "
          "water and sailors tell stories of distant islands").split()


@dataclass
class Scenario:
    name: str
    prompt_tokens: int = 32
    concurrency: int = 1


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    stream_tps: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    wall_secs: float = 0.0


def parse_scenario(spec: str) -> Scenario:
    sc = Scenario(spec)
    for part in spec.split(","):
        key, _, value = part.partition(":")
        if key not in ("chat", "concurrency") or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                f"bad scenario `{part}`: expected chat:<prompt_tokens> or concurrency:<n>")
        if key == "chat":
            sc.prompt_tokens = int(value)
        else:
            sc.concurrency = int(value)
    return sc


def prompt(tokens: int, salt: int) -> str:
    """About `tokens` tokens of plain English (~4 chars a token), different per request."""
    words, chars = [f"({salt})"], 0
    i = salt
    while chars < tokens * 4:
        w = _WORDS[i % len(_WORDS)]
        words.append(w)
        chars += len(w) + 1
        i += 7
    return " ".join(words)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one(session: aiohttp.ClientSession, args: argparse.Namespace, sc: Scenario, i: int,
              res: Result) -> None:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt(
        sc.prompt_tokens, i)}], "max_tokens": args.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = last = None
    try:
        async with session.post(args.url.rstrip("/") + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                res.refused[str(r.status)] = res.refused.get(str(r.status), 0) + 1
                await r.read()
                return
            usage = None
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.errors += 1
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        res.ttft.append(now - t0)
                    else:
                        res.gaps.append(now - last)
                    last = now
    except aiohttp.ClientError:
        res.errors += 1
        return
    if usage:
        res.completion_tokens += usage["completion_tokens"]
        res.prompt_tokens.append(usage["prompt_tokens"])
        if first is not None and last > first and usage["completion_tokens"] > 1:
            res.stream_tps.append((usage["completion_tokens"] - 1) / (last - first))


async def run_scenario(args: argparse.Namespace, sc: Scenario) -> Result:
    res = Result()
    n = args.requests or max(8, 4 * sc.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        queue = list(range(n))

        async def worker() -> None:
            while queue:
                await one(session, args, sc, queue.pop(), res)

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(sc.concurrency)))
        res.wall_secs = time.perf_counter() - t
    return res


def summary(sc: Scenario, res: Result) -> dict:
    ms = 1000.0
    done = len(res.ttft)

    def r(x: float | None, k: float = 1.0) -> float | None:
        return None if x is None else round(x * k, 3)
    return {
        "scenario": sc.name, "concurrency": sc.concurrency, "prompt_tokens_asked": sc.prompt_tokens,
        "prompt_tokens_mean": r(statistics.mean(res.prompt_tokens)) if res.prompt_tokens else None,
        "completed": done, "refused": res.refused, "errors": res.errors,
        "ttft_p50_ms": r(pct(res.ttft, 0.5), ms), "ttft_p95_ms": r(pct(res.ttft, 0.95), ms),
        "itl_p50_ms": r(pct(res.gaps, 0.5), ms), "itl_p95_ms": r(pct(res.gaps, 0.95), ms),
        "stream_tok_per_s_p50": r(pct(res.stream_tps, 0.5)),
        "aggregate_tok_per_s": r(res.completion_tokens / res.wall_secs if res.wall_secs else None),
        "completion_tokens": res.completion_tokens, "wall_secs": r(res.wall_secs),
    }


def table(rows: list[dict]) -> str:
    cols = [("scenario", "scenario"), ("conc", "concurrency"), ("prompt", "prompt_tokens_mean"),
            ("done", "completed"), ("refused", "refused"), ("err", "errors"),
            ("ttft p50 ms", "ttft_p50_ms"), ("ttft p95 ms", "ttft_p95_ms"),
            ("itl p50 ms", "itl_p50_ms"), ("itl p95 ms", "itl_p95_ms"),
            ("stream tok/s", "stream_tok_per_s_p50"), ("total tok/s", "aggregate_tok_per_s")]

    def cell(v) -> str:
        if isinstance(v, dict):
            return ",".join(f"{k}:{n}" for k, n in sorted(v.items())) or "0"
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
    grid = [[h for h, _ in cols]] + [[cell(row[k]) for _, k in cols] for row in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in grid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="helexa bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="endpoint base, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True)
    p.add_argument("--scenario", action="append", type=parse_scenario, required=True,
                   help="chat:<prompt_tokens> | concurrency:<n> (repeatable; combine with a comma)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per scenario (default: max(8, 4 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max-tokens (vLLM field)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    rows = [summary(sc, asyncio.run(run_scenario(args, sc))) for sc in args.scenario]
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0 if all(r["completed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
