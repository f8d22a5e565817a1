"""The load shapes of `helexa bench`: scenarios, and how their requests are sent.

A scenario is comma-separated parts (docs/operating.md, "Benchmarking"):

    chat:N          prompts of exactly N tokens (see bench_prompts.py)
    long            prompts as long as the model's context allows (its /v1/models limit)
    concurrency:N   N requests (or sessions) in flight at once
    rate:R          Poisson arrivals at R requests a second (with concurrency:N: at most N)
    sweep:N         concurrency 1, 2, 4, ... N in turn (the knee: where p99 TTFT crosses
                    --ttft-bound-ms)
    turns:K         sessions of K turns; each turn sends the whole history plus a new
                    user turn of chat:N tokens (the prefix cache's workload)

Several endpoints are compared by interleaving: each scenario (each sweep level)
is cut into rounds and every round runs each endpoint's share in turn, in an
order that rotates, so a noisy minute hits every endpoint alike.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from helexa.loadgen.prompts import Counter, exact_prompt
from helexa.loadgen.request import Record, send


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt_tokens: int = 32
    long: bool = False
    concurrency: int = 1
    rate: float | None = None
    sweep: int | None = None
    turns: int = 1

    def levels(self) -> list[Scenario]:
        """The runs this scenario is made of: one, or one per sweep level."""
        if self.sweep is None:
            return [self]
        out, c = [], 1
        while c < self.sweep:
            out.append(c)
            c *= 2
        out.append(self.sweep)
        return [replace(self, name=f"{self.name}@{c}", concurrency=c, sweep=None) for c in out]


def parse_scenario(spec: str) -> Scenario:
    fields: dict[str, Any] = {}
    for part in spec.split(","):
        key, _, value = part.partition(":")
        try:
            if key == "long" and not value:
                fields["long"] = True
            elif key in ("chat", "concurrency", "sweep", "turns") and int(value) >= 1:
                fields[{"chat": "prompt_tokens"}.get(key, key)] = int(value)
            elif key == "rate" and float(value) > 0:
                fields["rate"] = float(value)
            else:
                raise ValueError(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad scenario part `{part}`: expected chat:N, long, concurrency:N, rate:R, "
                f"sweep:N or turns:K (N, K whole numbers ≥ 1, R > 0)") from None
    return Scenario(spec, **fields)


@dataclass
class Endpoint:
    label: str
    url: str  # base, without /v1
    model: str
    session: aiohttp.ClientSession
    count: Counter | None = None  # exact prompt lengths, when something can count
    context: int | None = None
    tokens_per_word: float = 1.25  # for estimates without a counter: learnt from usage

    def learn(self, words_sent: int, rec: Record) -> None:
        """Take the tokens a word the server counted for a single-turn prompt (the words of
        every prompt are alike: bench_prompts.words)."""
        if self.count is None and rec.prompt_tokens and words_sent > 0 and rec.turn in (None, 0):
            self.tokens_per_word = rec.prompt_tokens / words_sent


@dataclass
class Plan:
    """What every request of a run shares."""

    args: argparse.Namespace
    started: float  # perf_counter() at the run's start: records count from it
    emit: Callable[[Record], None]  # called once per finished request
    stop: asyncio.Event  # set on Ctrl-C
    abandon_every: int = 0  # every k-th request hangs up after its first token

    def body(self, ep: Endpoint, messages: list[dict[str, str]]) -> dict[str, Any]:
        a = self.args
        body: dict[str, Any] = {
            "model": ep.model, "messages": messages, "max_tokens": a.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": a.temperature}
        if a.ignore_eos:
            body["ignore_eos"] = True
        if a.token_ids:
            body["return_token_ids"] = True
        if a.principal:
            body["user"] = a.principal
        return body


async def one_request(plan: Plan, ep: Endpoint, sc: Scenario, index: int,
                      history: list[dict[str, str]], asked: int, session: int | None = None,
                      turn: int | None = None) -> tuple[Record, list[dict[str, str]]]:
    """Send one request (history plus a new user turn, `asked` tokens in all)."""
    messages, counted = await exact_prompt(ep.count, history, asked, salt=index * 7919 + 1,
                                           tokens_per_word=ep.tokens_per_word)
    rec = Record(endpoint=ep.label, scenario=sc.name, index=index,
                 t_sent=time.perf_counter() - plan.started, prompt_tokens_asked=counted or asked,
                 concurrency=None if sc.rate and sc.concurrency <= 1 else sc.concurrency,
                 rate=sc.rate, session=session, turn=turn, principal=plan.args.principal)
    abandon = plan.abandon_every > 0 and index % plan.abandon_every == plan.abandon_every - 1
    try:
        await send(ep.session, ep.url + "/v1/chat/completions", plan.body(ep, messages), rec,
                   timeout_secs=plan.args.timeout, abandon=abandon)
    except asyncio.CancelledError:  # Ctrl-C: counted, and left out of the figures
        rec.outcome = "interrupted"
        rec.e2e = time.perf_counter() - plan.started - rec.t_sent
        plan.emit(rec)
        raise
    ep.learn(len(messages[-1]["content"].split()), rec)
    plan.emit(rec)
    return rec, messages


async def session_run(plan: Plan, ep: Endpoint, sc: Scenario, index: int) -> None:
    """One request, or one multi-turn session whose history grows turn by turn."""
    asked = _prompt_tokens(plan, ep, sc)
    history: list[dict[str, str]] = []
    for turn in range(sc.turns):
        if plan.stop.is_set():
            return
        multi = sc.turns > 1
        rec, sent = await one_request(plan, ep, sc, index * 1000 + turn if multi else index,
                                      history, asked, index if multi else None,
                                      turn if multi else None)
        if rec.outcome != "ok":
            return  # a session stops at its first failed turn
        history = [*sent, {"role": "assistant", "content": rec.reply}]
        # the next turn: all of this one (as the server counted it) plus a new user turn
        asked = (rec.prompt_tokens or asked) + rec.output_tokens + sc.prompt_tokens


def _prompt_tokens(plan: Plan, ep: Endpoint, sc: Scenario) -> int:
    if sc.long:
        if not ep.context:
            raise SystemExit(f"helexa bench: `long` needs the model's context; {ep.label}'s "
                             f"/v1/models does not say it for {ep.model}")
        return max(1, ep.context - plan.args.max_tokens - 1)
    return sc.prompt_tokens


async def run_block(plan: Plan, ep: Endpoint, sc: Scenario, indices: list[int]) -> None:
    """Send these requests (or sessions) to one endpoint in the scenario's load shape."""
    limit = asyncio.Semaphore(sc.concurrency if not sc.rate or sc.concurrency > 1 else 1 << 30)
    tasks: list[asyncio.Task[None]] = []

    async def guarded(i: int) -> None:
        async with limit:
            if not plan.stop.is_set():
                await session_run(plan, ep, sc, i)
    if sc.rate:
        rng = random.Random(plan.args.seed + indices[0] if indices else 0)
        for i in indices:
            if plan.stop.is_set():
                break
            tasks.append(asyncio.get_running_loop().create_task(guarded(i)))
            await _sleep_or_stop(plan.stop, rng.expovariate(sc.rate))
    else:
        tasks = [asyncio.get_running_loop().create_task(guarded(i)) for i in indices]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _sleep_or_stop(stop: asyncio.Event, secs: float) -> None:
    try:
        async with asyncio.timeout(secs):
            await stop.wait()
    except TimeoutError:
        pass


async def run_interleaved(plan: Plan, endpoints: list[Endpoint], sc: Scenario, requests: int,
                          rounds: int, on_block: Callable[[], Awaitable[None]] | None = None
                          ) -> None:
    """`requests` per endpoint, in `rounds` rounds; each round visits every endpoint.

    One endpoint needs no interleaving; a round never holds fewer requests than the
    scenario's concurrency (or the load would not reach it)."""
    rounds = 1 if len(endpoints) == 1 else max(1, min(rounds, requests // sc.concurrency))
    shares = [list(range(r, requests, rounds)) for r in range(rounds)]
    for r, share in enumerate(shares):
        order = endpoints[r % len(endpoints):] + endpoints[:r % len(endpoints)]
        for ep in order:
            if plan.stop.is_set():
                return
            await run_block(plan, ep, sc, share)
            if on_block is not None:
                await on_block()
