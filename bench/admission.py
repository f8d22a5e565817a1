"""What the neuron's serving path adds to one request: gRPC + daemon + IPC vs the engine in-process.

    .venv/bin/python bench/admission.py [--requests 200] [--max-tokens 1]

All contenders run the same tiny checkpoint with one torch thread and the
same admission code; each request is a short text prompt generating
`--max-tokens` tokens. In-process: tokenise, then step an EngineCore until
the request finishes. IPC: tokenise, then EngineClient.generate against an
engine process (the pipe, no gRPC, no daemon). Daemon: a real `helexa
neuron` subprocess, one gRPC Generate call (tokenising, context check, the
engine process over its pipe, detokenising, streaming back); the same
daemon again with one unary Complete call (the same path answered in one
message, as the router asks for non-streaming requests). Requests
rotate between the contenders; the figures are medians (p50) and p90 of
each and the differences: what the daemon path adds over in-process
(target: < 1 ms p50), split into the engine pipe (IPC − in-process) and
gRPC + daemon (daemon − IPC), next to the floor of an empty gRPC call.
`--fake-model` uses the engine's fake runner for the in-process and IPC
contenders to show the pipe's cost without a model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog."


# The fake runner and the daemon helpers are test support (tests/support/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _spec(model_dir: Path):
    from helexa.neuron.engine.spec import EngineSpec

    return EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=128, block_size=16,
                      bytes_per_token=512, context=2048, torch_threads=1,
                      prefix_cache=False)


def _fake_factory(fake: bool):  # -> a picklable runner factory, or None for the real model
    from support.fake_runner import FakeRunnerFactory

    return FakeRunnerFactory() if fake else None


async def _ipc(model_dir: Path, max_tokens: int, fake: bool):  # -> (client, coroutine fn)
    from helexa.neuron.engine import messages
    from helexa.neuron.engine.client import EngineClient
    from helexa.neuron.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    client = await EngineClient.start(_spec(model_dir), runner_factory=_fake_factory(fake))
    counter = iter(range(10**9))

    async def one() -> float:
        t0 = time.perf_counter()
        ids = tok.encode(PROMPT)
        req = messages.NewRequest(req_id=f"ipc-{next(counter)}", prompt_token_ids=ids,
                                  max_tokens=max_tokens, principal="bench",
                                  sampling=messages.SamplingParams(temperature=0.0))
        async for _ in client.generate(req):
            pass
        return (time.perf_counter() - t0) * 1000

    return client, one


def _in_process(model_dir: Path, max_tokens: int, fake: bool):  # -> callable measuring one request
    import torch

    from helexa.neuron.engine import messages
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(model_dir)
    factory = _fake_factory(fake)
    spec = _spec(model_dir)
    core = EngineCore(spec, factory(spec) if factory is not None else None)
    counter = iter(range(10**9))

    def one() -> float:
        t0 = time.perf_counter()
        ids = tok.encode(PROMPT)
        req = messages.NewRequest(req_id=f"ip-{next(counter)}", prompt_token_ids=ids,
                                  max_tokens=max_tokens, principal="bench",
                                  sampling=messages.SamplingParams(temperature=0.0),
                                  stop_token_ids=[], arrival_unix=time.time())
        inbound: messages.ToEngine | None = messages.ToEngine(new=[req])
        while True:
            out = core.step(inbound)
            inbound = None
            if any(u.finished is not None or u.refused_code for u in out.updates):
                break
        tok.decode(ids)  # the daemon detokenises too; keep the work comparable
        return (time.perf_counter() - t0) * 1000

    return one


async def _daemon_one(stub, md, i: int, max_tokens: int, unary: bool) -> float:
    from helexa.proto import neuron_pb2 as pb

    req = pb.GenerateRequest(req_id=f"d-{i}", model="tiny", principal="bench", text=PROMPT,
                             max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    if unary:
        await stub.Complete(req, metadata=md)
    else:
        async for _ in stub.Generate(req, metadata=md):
            pass
    return (time.perf_counter() - t0) * 1000


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def _run(args: argparse.Namespace, work: Path) -> None:
    import grpc
    from support.neuron import start_neuron, write_neuron_config

    from helexa.fixtures.tiny import init_tiny
    from helexa.neuron.auth import bearer
    from helexa.proto import neuron_pb2 as pb
    from helexa.proto import neuron_pb2_grpc

    model_dir = init_tiny(work / "tiny")
    (work / "token").write_text("bench\n")
    cfg = write_neuron_config(work / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token"},
        "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 1, "prefix_cache": False},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    })
    neuron = start_neuron(cfg)
    client = None
    try:
        in_process = _in_process(model_dir, args.max_tokens, args.fake_model)
        client, ipc = await _ipc(model_dir, args.max_tokens, args.fake_model)
        async with grpc.aio.insecure_channel(neuron.address) as ch:
            stub, md = neuron_pb2_grpc.NeuronStub(ch), bearer("bench")
            counter = iter(range(10**9))

            async def daemon() -> float:
                return await _daemon_one(stub, md, next(counter), args.max_tokens, False)

            async def daemon_unary() -> float:
                return await _daemon_one(stub, md, next(counter), args.max_tokens, True)

            async def local() -> float:
                return in_process()

            async def floor() -> float:  # gRPC's own round trip: an empty unary call
                t0 = time.perf_counter()
                await stub.Health(pb.HealthRequest(), metadata=md)
                return (time.perf_counter() - t0) * 1000

            contenders = {"engine in-process": local, "engine over its pipe (IPC)": ipc,
                          "daemon (gRPC + IPC)": daemon, "gRPC floor (unary Health)": floor,
                          "daemon unary (Complete)": daemon_unary}
            times: dict[str, list[float]] = {k: [] for k in contenders}
            names = list(contenders)
            for i in range(args.warmup + args.requests):
                # rotate the order so that noise and warm caches hit every contender alike
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    t = await contenders[name]()
                    if i >= args.warmup:
                        times[name].append(t)
    finally:
        if client is not None:
            await client.shutdown()
        neuron.stop()
    p50 = {k: statistics.median(v) for k, v in times.items()}
    model = "fake runner (engine) vs tiny qwen3 (daemon)" if args.fake_model else "tiny qwen3"
    print(f"requests: {args.requests} per contender, max_tokens {args.max_tokens}, "
          f"{model} on CPU, 1 torch thread")
    print(f"{'contender':<28} {'p50 ms':>8} {'p90 ms':>8}")
    for k, v in times.items():
        print(f"{k:<28} {p50[k]:8.3f} {_pct(v, 0.9):8.3f}")
    ip, dm = times[names[0]], times[names[2]]
    paired = statistics.median(d - i for d, i in zip(dm, ip, strict=True))
    print(f"daemon path adds p50 {p50[names[2]] - p50[names[0]]:.3f} ms over in-process "
          f"(median of paired differences {paired:.3f} ms)")
    print(f"  engine pipe (IPC - in-process): {p50[names[1]] - p50[names[0]]:.3f} ms;"
          f" gRPC + daemon (daemon - IPC): {p50[names[2]] - p50[names[1]]:.3f} ms,"
          f" of which an empty gRPC call takes {p50[names[3]]:.3f} ms")
    un = times[names[4]]
    paired_unary = statistics.median(u - d for u, d in zip(un, dm, strict=True))
    print(f"daemon unary (Complete) vs streaming (Generate): p50 {p50[names[4]]:.3f} vs"
          f" {p50[names[2]]:.3f} ms (median of paired differences {paired_unary:.3f} ms);"
          f" unary adds p50 {p50[names[4]] - p50[names[0]]:.3f} ms over in-process")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--fake-model", action="store_true",
                   help="engine's fake runner for the in-process and IPC contenders")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(_run(args, Path(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
