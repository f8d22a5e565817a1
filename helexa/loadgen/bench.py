"""`helexa bench`: HTTP load against OpenAI-compatible endpoints, one record per request.

    helexa bench --url http://127.0.0.1:8080 --model helexa/balanced \\
        --scenario chat:512,concurrency:8 --scenario chat:128,sweep:16 \\
        [--url other=http://10.0.0.2:8000 ...] [--tokenizer DIR] [--out run.jsonl]
    helexa bench report run.jsonl [more.jsonl ...] [--out DIR]

Scenarios are described in bench_load.py and docs/operating.md
("Benchmarking"). Every request is a line of the JSONL output (`--out`):
status, outcome, refusal code and reason, TTFT, each chunk's arrival and
token count, E2E, tokens in, out and cached. The table printed at the end
has p50/p90/p99 of TTFT, inter-token latency (per token) and E2E, and
goodput; a sweep also prints its knee. A failed request (refusal, timeout,
disconnect) is a counted outcome; Ctrl-C stops the run, and what was
measured is written and summarised (exit status 130).

The progress bar is tqdm's (on stderr, only on a terminal): one small pure-Python
package that transformers' tooling already brings, where rich would bring a
whole terminal-rendering stack for one bar.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import IO, Any

import aiohttp
import msgspec

from helexa.loadgen.load import Endpoint, Plan, Scenario, parse_scenario, run_interleaved
from helexa.loadgen.prompts import local_counter, remote_counter
from helexa.loadgen.request import Record
from helexa.loadgen.stats import group, knees, summarise, table


def _parse_url(spec: str) -> tuple[str, str]:
    label, eq, url = spec.partition("=")
    if not eq or "://" in label:
        label, url = spec, spec
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"bad --url `{spec}`: expected [LABEL=]http(s)://HOST:PORT")
    return label, url.rstrip("/").removesuffix("/v1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="helexa bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", type=_parse_url, required=True,
                   help="[LABEL=]endpoint base, e.g. http://127.0.0.1:8080 (repeat to compare)")
    p.add_argument("--model", required=True)
    p.add_argument("--scenario", action="append", type=parse_scenario, required=True,
                   help="e.g. chat:512,concurrency:8 | chat:64,rate:5 | chat:64,sweep:16 | "
                        "chat:256,turns:4,concurrency:2 | long (repeatable)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests (or sessions) per scenario, sweep level and endpoint "
                        "(default: max(8, 4 x concurrency))")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaving rounds per scenario when comparing endpoints (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --max-tokens (vLLM's and helexa's field)")
    p.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="do not ask for return_token_ids (servers that refuse the field); "
                        "tokens per chunk are then one per chunk with text")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="checkpoint folder whose tokenizer counts prompt tokens (else the "
                        "endpoint's /tokenize, else an estimate)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--principal", default=None,
                   help="a label sent as the OpenAI `user` field and kept in the records; "
                        "helexa decides a request's principal from its API key, so give the "
                        "bench a key of its own (e.g. mapped to `bench`) to keep it out of "
                        "`helexa journal --exclude-principal bench`")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--abandon", type=float, default=0.0, metavar="FRACTION",
                   help="this share of requests hangs up after its first token")
    p.add_argument("--ttft-bound-ms", type=float, default=1000.0,
                   help="a sweep's knee: the first concurrency whose p99 TTFT is over this")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="goodput: the request's p99 inter-token latency at most this")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--out", metavar="RUN.jsonl", help="write every request as a JSON line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


async def _endpoint(args: argparse.Namespace, label: str, url: str) -> Endpoint:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None))
    ep = Endpoint(label, url, args.model, session)
    with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError, KeyError, TypeError):
        async with asyncio.timeout(10):
            async with session.get(f"{url}/v1/models/{args.model}") as r:
                if r.status == 200:
                    ep.context = (await r.json()).get("limit", {}).get("context")
    if args.tokenizer:
        ep.count = local_counter(args.tokenizer)
    else:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                ep.count = await remote_counter(session, url, args.model)
        if ep.count is None:
            print(f"helexa bench: {label} has no /tokenize and no --tokenizer was given: "
                  "prompt lengths are estimates (the records say what the server counted)",
                  file=sys.stderr)
    return ep


class Sink:
    """Where finished records go: the JSONL file, the list kept for the summary, the bar."""

    def __init__(self, out: IO[bytes] | None, bar: Any) -> None:
        self.out = out
        self.bar = bar
        self.records: list[Record] = []
        self._enc = msgspec.json.Encoder()

    def __call__(self, rec: Record) -> None:
        self.records.append(rec)
        if self.out is not None:
            self.out.write(self._enc.encode(msgspec.structs.replace(rec, reply="")) + b"\n")
            self.out.flush()
        if self.bar is not None:
            self.bar.update(1)
            ok = sum(1 for r in self.records if r.outcome == "ok")
            self.bar.set_postfix(ok=ok, other=len(self.records) - ok, refresh=False)


def _requests(args: argparse.Namespace, sc: Scenario) -> int:
    return args.requests or max(8, 4 * sc.concurrency)


async def run(args: argparse.Namespace, sink: Sink, stop: asyncio.Event) -> None:
    endpoints = [await _endpoint(args, label, url) for label, url in args.url]
    plan = Plan(args, time.perf_counter(), sink, stop,
                abandon_every=round(1 / args.abandon) if args.abandon > 0 else 0)
    try:
        for sc in args.scenario:
            for level in sc.levels():
                await run_interleaved(plan, endpoints, level, _requests(args, level), args.rounds)
                if stop.is_set():
                    return
    finally:
        for ep in endpoints:
            await ep.session.close()


def _planned(args: argparse.Namespace) -> int:
    return sum(_requests(args, lv) * lv.turns * len(args.url)
               for sc in args.scenario for lv in sc.levels())


def summary_rows(records: list[Record], args: argparse.Namespace) -> list[dict[str, Any]]:
    return [summarise(recs, args.slo_ttft_ms, args.slo_itl_ms) for recs in group(records).values()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from helexa.loadgen.report import main as report_main
        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    if not 0 <= args.abandon <= 1:
        print("helexa bench: --abandon: expected a fraction between 0 and 1", file=sys.stderr)
        return 2
    out = open(args.out, "wb") if args.out else None  # noqa: SIM115 - closed below
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=_planned(args), unit="req", file=sys.stderr, disable=None,
                   dynamic_ncols=True)
    sink = Sink(out, bar)
    if out is not None:
        meta = {"run": {"started_unix": time.time(), "model": args.model,
                        "endpoints": dict(args.url), "scenarios": [s.name for s in args.scenario],
                        "max_tokens": args.max_tokens, "ttft_bound_ms": args.ttft_bound_ms,
                        "principal": args.principal}}
        out.write(json.dumps(meta).encode() + b"\n")
    interrupted = _run_until_interrupted(args, sink)
    if bar is not None:
        bar.close()
    if out is not None:
        out.close()
    rows = summary_rows(sink.records, args)
    found = knees(rows, args.ttft_bound_ms)
    if args.json:
        print(json.dumps({"rows": rows, "knees": found, "interrupted": interrupted}, indent=2))
    else:
        print(table(rows))
        for k in found:
            print(f"sweep {k['sweep']} on {k['endpoint']}: " + (
                f"knee at concurrency {k['knee']} (p99 TTFT {k['ttft_p99_ms']:g} ms > "
                f"{k['bound_ms']:g} ms)" if k["knee"] else
                f"no knee up to concurrency {k['max_concurrency']} (bound {k['bound_ms']:g} ms)"))
        if interrupted:
            print(f"interrupted: {len(sink.records)} requests measured")
    if interrupted:
        return 130
    return 0 if rows and all(r["ok"] for r in rows) else 1


def _run_until_interrupted(args: argparse.Namespace, sink: Sink) -> bool:
    """Run the benchmark; True when Ctrl-C (or SIGTERM) cut it short."""
    hit = [False]

    async def go() -> None:
        stop = asyncio.Event()
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            hit[0] = True
            stop.set()
            if task is not None:
                task.cancel()  # requests in flight end as `interrupted`
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, interrupt)
        try:
            await run(args, sink, stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(go())
    return hit[0]


if __name__ == "__main__":
    sys.exit(main())
