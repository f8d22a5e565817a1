"""The prefix cache: TTFT of a chat's second turn, cache off, on, and restored from the
host tier, at long histories.

    .venv/bin/python bench/prefix.py [--model DIR] [--history 2000,8000] [--repeats 3]
                                     [--threads 1] [--host-cache-mb 512]

Starts three `helexa neuron` daemons on loopback with the same model: one with
the prefix cache (the default), one with `kv.prefix_cache = false`, and one
with the cache and a host tier (`kv.host_cache_mb`). In every repeat a fresh
conversation (its own history, so nothing of it is cached yet) is played on
each, interleaved:

- turn 1: system prompt + a user message of about --history tokens (cold);
- turn 2: turn 1, the assistant's reply, a short new question — the cached
  daemon reuses turn 1's blocks, the uncached one recomputes the whole prompt,
  and on the host-tier daemon another caller's prompts fill its whole pool
  between the turns (so turn 1's blocks are evicted to host memory), and turn 2
  copies them back instead of recomputing them.

TTFT is measured at the client, from the gRPC call to the first message
carrying tokens; the daemon's own `usage.prefill_ms` (arrival to first
token) is printed beside it. Medians over the repeats, and the ratios, for
each --history size (comma-separated) in one run, side by side. A hybrid
checkpoint (`helexa model init-tiny --arch qwen3_5`) measures the prefix
snapshots of its linear-attention state (docs/architecture.md).
Without --model it uses bench/engine.py's checkpoint (init-tiny qwen3,
hidden 512, 8 layers, vocab 8192, ~30M parameters, fp32; built once, cached).
Benchmarks print figures; they assert nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import grpc

from helexa.config.schema import load_neuron_config
from helexa.neuron.auth import bearer
from helexa.neuron.tokenizer import Tokenizer
from helexa.plan import check_neuron_config
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc

# the daemon helpers are test support (tests/support/)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.neuron import NeuronProcess, start_neuron, write_neuron_config  # noqa: E402

TOKEN = "bench-prefix"
SYSTEM = "You are a helpful assistant. Answer from the document the user gives you."
FOLLOW_UP = "Thank you. Now say in one sentence what the document was about."


def default_model() -> Path:
    from helexa.fixtures.tiny import bench_checkpoint

    return bench_checkpoint()


def history_text(tok: Tokenizer, tokens: int, repeat: int) -> str:
    """About `tokens` tokens of the package's fixed text, a different cut per repeat."""
    data = resources.files("helexa") / "data"
    text = "\n".join((data / n).read_text() for n in sorted(
        p.name for p in data.iterdir() if p.name.endswith(".txt")))
    ids = tok.encode(text, add_special_tokens=False)
    ids = ids * (tokens // max(1, len(ids)) + 2)  # long histories repeat the text
    start = (repeat * 997) % max(1, len(ids) - tokens)
    return f"Document {repeat}:\n" + tok.decode(ids[start:start + tokens])


def start(workdir: Path, name: str, model: Path, prefix_cache: bool, threads: int,
          kv_budget_mb: int, host_cache_mb: int = 0) -> tuple[NeuronProcess, Any]:
    """The daemon, and its model's plan (pool tokens and context)."""
    (workdir / "token").write_text(TOKEN + "\n")
    kv: dict[str, Any] = {"kv_budget_mb": kv_budget_mb, "prefix_cache": prefix_cache}
    if host_cache_mb:
        kv["host_cache_mb"] = host_cache_mb
    cfg = write_neuron_config(workdir / f"{name}.toml", {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token"},
        "engine": {"torch_threads": threads},
        "kv": kv,
        "models": [{"id": "m", "path": str(model)}],
    })
    plan = check_neuron_config(cfg, load_neuron_config(cfg))[0]
    return start_neuron(cfg), plan


_FILLS = 0


async def fill_pool(stub, tag: str, plan: Any, tok: Tokenizer) -> None:
    """Another caller's prompts, one after another, as many tokens as the whole pool: every
    cached block of the conversation is evicted (to the host tier, where there is one)."""
    global _FILLS
    left, i = plan.pool_tokens, 0
    while left > 0:
        _FILLS += 1  # every fill its own text: a fill that hit its own cache would evict nothing
        n = max(1, min(left, plan.context - 2))
        ids = tok.encode(history_text(tok, n, 10_000 + _FILLS), add_special_tokens=False)[:n]
        req = pb.GenerateRequest(req_id=f"{tag}-fill{i}", model="m", principal="filler",
                                 token_ids=pb.TokenIds(ids=ids), max_tokens=1,
                                 sampling=pb.SamplingParams(temperature=0.0))
        async for _ in stub.Generate(req, metadata=bearer(TOKEN)):
            pass
        left, i = left - n, i + 1


def request(req_id: str, messages: list[tuple[str, str]], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        req_id=req_id, model="m", principal="bench",
        chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=pb.SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True)


async def turn(stub, req: pb.GenerateRequest) -> tuple[float, str, pb.Usage]:
    """(client TTFT seconds, reply text, usage)."""
    t0 = time.perf_counter()
    ttft, text, usage = 0.0, [], pb.Usage()
    async for r in stub.Generate(req, metadata=bearer(TOKEN)):
        if r.token_ids and not ttft:
            ttft = time.perf_counter() - t0
        text.append(r.text)
        if r.HasField("usage"):
            usage = r.usage
    return ttft, "".join(text), usage


async def conversation(stub, tag: str, history: str, max_tokens: int,
                       fill: tuple[Any, Tokenizer] | None = None) -> list[tuple]:
    """Both turns; with `fill` (a plan) the pool is filled by another caller between them."""
    first = [("system", SYSTEM), ("user", history)]
    t1 = await turn(stub, request(f"{tag}-1", first, max_tokens))
    if fill is not None:
        await fill_pool(stub, tag, *fill)
    second = [*first, ("assistant", t1[1]), ("user", FOLLOW_UP)]
    t2 = await turn(stub, request(f"{tag}-2", second, max_tokens))
    return [t1, t2]


KINDS = ("cache", "no cache", "host")  # the daemons, in the tables' order


async def run(addresses: dict[str, str], host_plan: Any, tok: Tokenizer,
              histories: list[str], max_tokens: int) -> dict[str, list]:
    rows: dict[str, list] = {f"turn {t} ({k})": [] for k in KINDS for t in (1, 2)}
    channels = {k: grpc.aio.insecure_channel(a) for k, a in addresses.items()}
    try:
        stubs = {k: neuron_pb2_grpc.NeuronStub(c) for k, c in channels.items()}
        for i, history in enumerate(histories):
            # rotate which daemon goes first, so none always runs on a warmer machine
            order = KINDS[i % 3:] + KINDS[:i % 3]
            for kind in order:
                t1, t2 = await conversation(stubs[kind], f"r{i}-{kind.replace(' ', '')}",
                                            history, max_tokens,
                                            (host_plan, tok) if kind == "host" else None)
                rows[f"turn 1 ({kind})"].append(t1)
                rows[f"turn 2 ({kind})"].append(t2)
    finally:
        for c in channels.values():
            await c.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: a cached init-tiny)")
    ap.add_argument("--history", default="2000,8000",
                    help="tokens of turn 1's user message, comma-separated sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per reply")
    ap.add_argument("--threads", type=int, default=1, help="each engine's torch threads")
    ap.add_argument("--kv-budget-mb", type=int, default=256)
    ap.add_argument("--host-cache-mb", type=int, default=512,
                    help="the host-tier daemon's kv.host_cache_mb")
    args = ap.parse_args(argv)
    model = args.model or default_model()
    tok = Tokenizer.from_dir(model)
    sizes = [int(x) for x in args.history.split(",")]
    results: dict[int, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as d:
        daemons: dict[str, NeuronProcess] = {}
        try:
            for kind, cache, host_mb in (("cache", True, 0), ("no cache", False, 0),
                                         ("host", True, args.host_cache_mb)):
                daemons[kind], plan = start(Path(d), kind.replace(" ", ""), model, cache,
                                            args.threads, args.kv_budget_mb, host_mb)
                if kind == "host":
                    host_plan = plan
            addresses = {k: n.address for k, n in daemons.items()}
            for k, size in enumerate(sizes):
                # one warm-up conversation (first-step costs), then the measured ones;
                # each size its own documents, so nothing of it is cached yet
                histories = [history_text(tok, size, 100 * k + r)
                             for r in range(args.repeats + 1)]
                rows = asyncio.run(run(addresses, host_plan, tok, histories,
                                       args.max_tokens))
                results[size] = {name: v[1:] for name, v in rows.items()}
        finally:
            for n in daemons.values():
                n.stop()
    print(f"model {model}; {args.repeats} conversations per size, medians; TTFT at the client "
          f"(and the daemon's prefill_ms)")
    for size, rows in results.items():
        print(f"\nhistory {size:,} tokens")
        print(f"{'':<20}{'prompt':>8}{'cached':>8}{'TTFT ms':>10}{'prefill_ms':>12}")
        for name, runs in rows.items():
            print(f"{name:<20}{statistics.median(r[2].prompt_tokens for r in runs):>8.0f}"
                  f"{statistics.median(r[2].cached_tokens for r in runs):>8.0f}"
                  f"{statistics.median(r[0] for r in runs) * 1000:>10.1f}"
                  f"{statistics.median(r[2].prefill_ms for r in runs):>12.1f}")
    print(f"\nsecond-turn TTFT, side by side: cold (prefix cache off), warm (on), and "
          f"restored from the host tier after another caller filled the pool "
          f"({host_plan.pool_tokens:,} tokens)")
    print(f"{'history':>9}{'cold ms':>10}{'warm ms':>10}{'host ms':>10}{'cold/warm':>11}"
          f"{'cold/host':>11}{'cached':>8}{'restored':>10}")
    for size, rows in results.items():
        cold, warm, host = (statistics.median(r[0] for r in rows[f"turn 2 ({k})"]) * 1000
                            for k in ("no cache", "cache", "host"))
        cached = statistics.median(r[2].cached_tokens for r in rows["turn 2 (cache)"])
        restored = statistics.median(r[2].cached_tokens for r in rows["turn 2 (host)"])
        print(f"{size:>9,}{cold:>10.1f}{warm:>10.1f}{host:>10.1f}{cold / warm:>11.1f}"
              f"{cold / host:>11.1f}{cached:>8.0f}{restored:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
