"""Router overhead: the same short requests sent to a neuron directly over gRPC and through
`helexa router` over HTTP, measured side by side in one run.

A minimal implementation of neuron.proto (tests/router/router_fake_neuron.py, one
token per request, no model) stands in for the engine, so the figures are
the router's own cost: parsing, selection, the gRPC hop and encoding. Both
the fake neuron and the router run as separate processes; this process is
the client. Three contenders, interleaved in blocks and rounds, medians
reported: the neuron called directly with `Generate` (server stream) and
with `Complete` (unary), and a non-streaming HTTP request through the
router, whose own hop to the neuron is `Complete`; so direct `Complete` is
the fair baseline, and the figures against direct `Generate` are printed
beside it.

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


PATHS = ("generate", "complete", "routed")
LABELS = {"generate": "direct Generate (stream)", "complete": "direct Complete (unary)",
          "routed": "via router (HTTP, Complete)"}


class Paths:
    """The three ways to send one short request."""

    def __init__(self, neuron: str, router: str) -> None:
        self.channel = grpc.aio.insecure_channel(neuron)
        self.stub = pbg.NeuronStub(self.channel)
        self.url = router + "/v1/completions"
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1})
        self.n = 0

    def _request(self) -> pb.GenerateRequest:
        self.n += 1
        return pb.GenerateRequest(req_id=f"b{self.n}", model="tiny", text="hello", max_tokens=1,
                                  sampling=pb.SamplingParams(temperature=1.0, top_p=1.0))

    async def generate(self) -> None:
        async for _ in self.stub.Generate(self._request()):
            pass

    async def complete(self) -> None:
        await self.stub.Complete(self._request())

    async def routed(self) -> None:
        async with self.http.post(self.url, data=self.body,
                                  headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()


async def latency(paths: Paths, n: int, block: int = 25) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(max(1, n // block)):
        for name in PATHS:
            fn = getattr(paths, name)
            for _ in range(block):
                t = time.perf_counter()
                await fn()
                out[name].append(time.perf_counter() - t)
    return out


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
        for _ in range(50):  # warm every path (connections, code paths)
            for name in PATHS:
                await getattr(paths, name)()
        lat = await latency(paths, args.requests)
        rates: dict[str, list[float]] = {name: [] for name in PATHS}
        for _ in range(args.rounds):
            for name in PATHS:
                rates[name].append(await rate(getattr(paths, name), args.concurrency, args.secs))
    finally:
        await paths.close()
    res: dict = {"requests_per_path": len(lat["routed"]), "concurrency": args.concurrency}
    for name in PATHS:
        res[f"{name}_p50_ms"] = statistics.median(lat[name]) * 1e3
        res[f"{name}_p95_ms"] = percentile(lat[name], 0.95) * 1e3
        res[f"{name}_rps"] = statistics.median(rates[name])
        res[f"{name}_rps_rounds"] = rates[name]
    for direct in ("complete", "generate"):
        res[f"router_added_p50_ms_vs_{direct}"] = res["routed_p50_ms"] - res[f"{direct}_p50_ms"]
        res[f"rps_ratio_vs_{direct}"] = res["routed_rps"] / res[f"{direct}_rps"]
    return res


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
          f" (1 output token, fake neuron); throughput at concurrency {args.concurrency}")
    print(f"  {'path':<28} {'p50 ms':>8} {'p95 ms':>8} {'req/s':>8}")
    for name in PATHS:
        print(f"  {LABELS[name]:<28} {res[f'{name}_p50_ms']:8.3f} {res[f'{name}_p95_ms']:8.3f}"
              f" {res[f'{name}_rps']:8.0f}")
    for direct, note in (("complete", "the router's own hop: the fair baseline"),
                         ("generate", "the streaming call")):
        print(f"  vs {LABELS[direct]} ({note}): router adds p50"
              f" {res[f'router_added_p50_ms_vs_{direct}']:.3f} ms (target < 1 ms),"
              f" rps ratio {res[f'rps_ratio_vs_{direct}']:.2f} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
