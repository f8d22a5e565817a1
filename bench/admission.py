"""What the neuron's serving path adds to one request: gRPC + daemon + IPC vs the engine in-process.

    .venv/bin/python bench/admission.py [--requests 200] [--max-tokens 1]

Both contenders run the same tiny checkpoint with one torch thread and the
same admission code; each request is a short text prompt generating
`--max-tokens` tokens. In-process: tokenise, then step an EngineCore until
the request finishes. Daemon: a real `helexa neuron` subprocess, one gRPC
Generate call (tokenising, context check, the engine process over its pipe,
detokenising, streaming back). Requests alternate between the two; the
figures are medians (p50) and p90 of each and their difference, the
overhead the daemon path adds (target: < 1 ms p50).
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


def _in_process(model_dir: Path, max_tokens: int):  # -> callable measuring one request
    import torch
    from helexa.neuron.engine import messages
    from helexa.neuron.engine.engine_core import EngineCore
    from helexa.neuron.engine.spec import EngineSpec, full_limits
    from helexa.neuron.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(model_dir)
    spec = EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=128, block_size=16,
                      bytes_per_token=512, context=2048, limits=full_limits(), torch_threads=1)
    core = EngineCore(spec)
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


async def _daemon_one(stub, md, i: int, max_tokens: int) -> float:
    from helexa.proto import neuron_pb2 as pb

    req = pb.GenerateRequest(req_id=f"d-{i}", model="tiny", principal="bench", text=PROMPT,
                             max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    async for _ in stub.Generate(req, metadata=md):
        pass
    return (time.perf_counter() - t0) * 1000


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def _run(args: argparse.Namespace, work: Path) -> None:
    import grpc
    from helexa.neuron.auth import bearer

    from helexa.proto import neuron_pb2_grpc
    from helexa.testing import start_neuron, write_neuron_config
    from helexa.tiny import init_tiny

    model_dir = init_tiny(work / "tiny")
    (work / "token").write_text("bench\n")
    cfg = write_neuron_config(work / "neuron.toml", {
        "server": {"listen": "127.0.0.1:0", "token_file": "token"},
        "engine": {"torch_threads": 1},
        "kv": {"kv_budget_mb": 1, "prefix_cache": False},
        "models": [{"id": "tiny", "path": str(model_dir)}],
    })
    neuron = start_neuron(cfg)
    try:
        in_process = _in_process(model_dir, args.max_tokens)
        async with grpc.aio.insecure_channel(neuron.address) as ch:
            stub, md = neuron_pb2_grpc.NeuronStub(ch), bearer("bench")
            for i in range(args.warmup):  # both sides warm (allocator, JIT-free paths, caches)
                in_process()
                await _daemon_one(stub, md, -i - 1, args.max_tokens)
            ip, dm = [], []
            for i in range(args.requests):  # interleaved, so noise hits both alike
                if i % 2:
                    ip.append(in_process())
                    dm.append(await _daemon_one(stub, md, i, args.max_tokens))
                else:
                    dm.append(await _daemon_one(stub, md, i, args.max_tokens))
                    ip.append(in_process())
    finally:
        neuron.stop()
    p50_ip, p50_dm = statistics.median(ip), statistics.median(dm)
    print(f"requests: {args.requests} per contender, max_tokens {args.max_tokens}, "
          f"tiny qwen3 on CPU, 1 torch thread")
    print(f"{'contender':<26} {'p50 ms':>8} {'p90 ms':>8}")
    print(f"{'engine in-process':<26} {p50_ip:8.3f} {_pct(ip, 0.9):8.3f}")
    print(f"{'daemon (gRPC + IPC)':<26} {p50_dm:8.3f} {_pct(dm, 0.9):8.3f}")
    print(f"daemon path adds p50 {p50_dm - p50_ip:.3f} ms "
          f"(median of paired differences {statistics.median(d - i for d, i in zip(dm, ip, strict=True)):.3f} ms)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=1)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(_run(args, Path(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
