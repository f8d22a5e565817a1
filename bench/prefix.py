"""The prefix cache: TTFT of a chat's second turn, cache on against off, at long histories.

    .venv/bin/python bench/prefix.py [--model DIR] [--history 2000,8000] [--repeats 3]
                                     [--threads 1]

Starts two `helexa neuron` daemons on loopback with the same model, one with
the prefix cache (the default) and one with `kv.prefix_cache = false`. In
every repeat a fresh conversation (its own history, so nothing of it is
cached yet) is played on both, interleaved:

- turn 1: system prompt + a user message of about --history tokens (cold);
- turn 2: turn 1, the assistant's reply, a short new question — the cached
  daemon reuses turn 1's blocks, the other recomputes the whole prompt.

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

import grpc

from helexa.neuron.auth import bearer
from helexa.neuron.tokenizer import Tokenizer
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
          kv_budget_mb: int) -> NeuronProcess:
    (workdir / "token").write_text(TOKEN + "\n")
    cfg = write_neuron_config(workdir / f"{name}.toml", {
        "server": {"name": name, "listen": "127.0.0.1:0", "token_file": "token"},
        "engine": {"torch_threads": threads},
        "kv": {"kv_budget_mb": kv_budget_mb, "prefix_cache": prefix_cache},
        "models": [{"id": "m", "path": str(model)}],
    })
    return start_neuron(cfg)


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


async def conversation(stub, tag: str, history: str, max_tokens: int) -> list[tuple]:
    first = [("system", SYSTEM), ("user", history)]
    t1 = await turn(stub, request(f"{tag}-1", first, max_tokens))
    second = [*first, ("assistant", t1[1]), ("user", FOLLOW_UP)]
    t2 = await turn(stub, request(f"{tag}-2", second, max_tokens))
    return [t1, t2]


async def run(on: str, off: str, histories: list[str], max_tokens: int) -> dict[str, list]:
    rows: dict[str, list] = {"turn 1": [], "turn 2 (cache)": [], "turn 1 (no cache)": [],
                             "turn 2 (no cache)": []}
    async with grpc.aio.insecure_channel(on) as ch_on, grpc.aio.insecure_channel(off) as ch_off:
        s_on, s_off = neuron_pb2_grpc.NeuronStub(ch_on), neuron_pb2_grpc.NeuronStub(ch_off)
        for i, history in enumerate(histories):
            # alternate which daemon goes first, so neither always runs on a warmer machine
            order = [(s_on, ""), (s_off, " (no cache)")][:: 1 if i % 2 == 0 else -1]
            for stub, suffix in order:
                t1, t2 = await conversation(stub, f"r{i}-{'off' if suffix else 'on'}", history, max_tokens)
                rows["turn 1" + suffix].append(t1)
                rows[("turn 2 (cache)" if not suffix else "turn 2" + suffix)].append(t2)
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
    args = ap.parse_args(argv)
    model = args.model or default_model()
    tok = Tokenizer.from_dir(model)
    sizes = [int(x) for x in args.history.split(",")]
    results: dict[int, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as d:
        n_on = start(Path(d), "on", model, True, args.threads, args.kv_budget_mb)
        try:
            n_off = start(Path(d), "off", model, False, args.threads, args.kv_budget_mb)
            try:
                for k, size in enumerate(sizes):
                    # one warm-up conversation (first-step costs), then the measured ones;
                    # each size its own documents, so nothing of it is cached yet
                    histories = [history_text(tok, size, 100 * k + r)
                                 for r in range(args.repeats + 1)]
                    rows = asyncio.run(run(n_on.address, n_off.address, histories,
                                           args.max_tokens))
                    results[size] = {name: v[1:] for name, v in rows.items()}
            finally:
                n_off.stop()
        finally:
            n_on.stop()
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
    print("\nsecond-turn TTFT, cold (prefix cache off) against warm (on), side by side")
    print(f"{'history':>9}{'cold ms':>10}{'warm ms':>10}{'cold / warm':>13}{'cached':>8}")
    for size, rows in results.items():
        cold = statistics.median(r[0] for r in rows["turn 2 (no cache)"]) * 1000
        warm = statistics.median(r[0] for r in rows["turn 2 (cache)"]) * 1000
        cached = statistics.median(r[2].cached_tokens for r in rows["turn 2 (cache)"])
        print(f"{size:>9,}{cold:>10.1f}{warm:>10.1f}{cold / warm:>13.1f}{cached:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
