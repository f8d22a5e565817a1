"""Router overhead: the same short requests sent to a neuron directly over gRPC and through
`helexa router` over HTTP, measured side by side in one run.

A minimal implementation of neuron.proto (tests/router/router_fake_neuron.py, one
token per request, no model) stands in for the engine, so the figures are
the router's own cost: parsing, selection, the gRPC hop and encoding. Both
the fake neuron and the router run as separate processes; this process is
the client. Rounds of the two paths are interleaved and medians reported.

    .venv/bin/python bench/router.py [--requests 400] [--concurrency 8] [--secs 2] [--rounds 3]

Targets: the router adds < 1 ms p50 per request; requests/s through the
router ≥ 0.8 × the direct rate at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parent.parent


def spawn(argv: list[str], prefix: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "HELEXA_LOG_LEVEL": "warning"})
    for line in proc.stdout:
        if line.startswith(prefix):
            return proc, line.split()[-1]
    raise RuntimeError(f"{argv} did not start")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Paths:
    """The two ways to send one short request."""

    def __init__(self, neuron: str, router: str) -> None:
        self.channel = grpc.aio.insecure_channel(neuron)
        self.stub = pbg.NeuronStub(self.channel)
        self.url = router + "/v1/completions"
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1})
        self.n = 0

    async def direct(self) -> None:
        self.n += 1
        req = pb.GenerateRequest(req_id=f"b{self.n}", model="tiny", text="hello", max_tokens=1,
                                 sampling=pb.SamplingParams(temperature=1.0, top_p=1.0))
        async for _ in self.stub.Generate(req):
            pass

    async def routed(self) -> None:
        async with self.http.post(self.url, data=self.body,
                                  headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()


async def latency(paths: Paths, n: int, block: int = 25) -> tuple[list[float], list[float]]:
    out: dict[str, list[float]] = {"direct": [], "routed": []}
    for _ in range(max(1, n // block)):
        for name in ("direct", "routed"):
            fn = getattr(paths, name)
            for _ in range(block):
                t = time.perf_counter()
                await fn()
                out[name].append(time.perf_counter() - t)
    return out["direct"], out["routed"]


async def rate(fn, concurrency: int, secs: float) -> float:
    done = 0
    end = time.perf_counter() + secs

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await fn()
            done += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t)


async def run(args: argparse.Namespace, neuron: str, router: str) -> dict:
    paths = Paths(neuron, router)
    try:
        for _ in range(50):  # warm both paths (connections, code paths)
            await paths.direct()
            await paths.routed()
        d, r = await latency(paths, args.requests)
        rates: dict[str, list[float]] = {"direct": [], "routed": []}
        for _ in range(args.rounds):
            for name in ("direct", "routed"):
                rates[name].append(await rate(getattr(paths, name), args.concurrency, args.secs))
    finally:
        await paths.close()
    d50, r50 = statistics.median(d), statistics.median(r)
    dr, rr = statistics.median(rates["direct"]), statistics.median(rates["routed"])
    return {"requests_per_path": len(d), "direct_p50_ms": d50 * 1e3, "routed_p50_ms": r50 * 1e3,
            "direct_p95_ms": percentile(d, 0.95) * 1e3, "routed_p95_ms": percentile(r, 0.95) * 1e3,
            "router_added_p50_ms": (r50 - d50) * 1e3, "concurrency": args.concurrency,
            "direct_rps": dr, "routed_rps": rr, "rps_ratio": rr / dr,
            "direct_rps_rounds": rates["direct"], "routed_rps_rounds": rates["routed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=400, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--secs", type=float, default=2.0, help="length of one throughput round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    py = sys.executable
    fake, neuron = spawn([py, str(ROOT / "tests/router/router_fake_neuron.py"), "--models", "tiny"],
                         "NEURON LISTENING")
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    (tmp / "router.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:0"\n[[neurons.endpoints]]\nname = "fake"\n'
        f'address = "{neuron}"\n')
    router_proc, router = spawn([py, "-m", "helexa.cli", "router", "--config",
                                 str(tmp / "router.toml"), "--log-level", "warning"],
                                "ROUTER LISTENING")
    try:
        time.sleep(0.5)  # the router's first Watch message
        res = asyncio.run(run(args, neuron, router))
    finally:
        for proc in (router_proc, fake):
            proc.terminate()
            proc.wait(10)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"router overhead, {res['requests_per_path']} sequential short requests per path"
          f" (1 output token, fake neuron)")
    print(f"  p50 latency   direct gRPC {res['direct_p50_ms']:.3f} ms   via router"
          f" {res['routed_p50_ms']:.3f} ms   added {res['router_added_p50_ms']:.3f} ms"
          f"   (target < 1 ms)")
    print(f"  p95 latency   direct gRPC {res['direct_p95_ms']:.3f} ms   via router"
          f" {res['routed_p95_ms']:.3f} ms")
    print(f"  throughput at concurrency {args.concurrency}: direct {res['direct_rps']:.0f} req/s,"
          f" via router {res['routed_rps']:.0f} req/s, ratio {res['rps_ratio']:.2f}"
          f"   (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
