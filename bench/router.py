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
beside it. Two floors are measured alongside: a bare HTTP round trip (the same
aiohttp client against an aiohttp server whose handler only answers), the
part of the router's added latency that any aiohttp hop costs; and the CPU
each process spends per request in the throughput rounds (this process, the
router, the fake neuron), which bounds the rate ratio when they share the
machine's cores.

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


PATHS = ("generate", "complete", "routed", "http_floor")
LABELS = {"generate": "direct Generate (stream)", "complete": "direct Complete (unary)",
          "routed": "via router (HTTP, Complete)", "http_floor": "bare HTTP round trip"}
# An aiohttp server whose handler reads the body and answers a completion-sized JSON body.
HTTP_FLOOR_SERVER = """
import asyncio
from aiohttp import web
BODY = b'{"id":"cmpl-0","object":"text_completion","created":0,"model":"tiny",' \\
       b'"choices":[{"index":0,"text":"w0 ","finish_reason":"length","logprobs":null}],' \\
       b'"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}'
async def answer(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
async def main():
    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print("FLOOR LISTENING http://127.0.0.1:%d" % runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def cpu_secs(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Paths:
    """The three ways to send one short request."""

    def __init__(self, neuron: str, router: str, floor: str) -> None:
        self.channel = grpc.aio.insecure_channel(neuron)
        self.stub = pbg.NeuronStub(self.channel)
        self.url = router + "/v1/completions"
        self.floor_url = floor + "/v1/completions"
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

    async def http_floor(self) -> None:
        async with self.http.post(self.floor_url, data=self.body,
                                  headers={"Content-Type": "application/json"}) as r:
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


async def run(args: argparse.Namespace, neuron: str, router: str, floor: str,
              pids: dict[str, int]) -> dict:
    paths = Paths(neuron, router, floor)
    cpu: dict[str, dict[str, float]] = {name: dict.fromkeys(pids, 0.0) for name in PATHS}
    served: dict[str, float] = dict.fromkeys(PATHS, 0.0)
    try:
        for _ in range(50):  # warm every path (connections, code paths)
            for name in PATHS:
                await getattr(paths, name)()
        lat = await latency(paths, args.requests)
        rates: dict[str, list[float]] = {name: [] for name in PATHS}
        for _ in range(args.rounds):
            for name in PATHS:
                before = {who: cpu_secs(pid) for who, pid in pids.items()}
                t = time.perf_counter()
                rates[name].append(await rate(getattr(paths, name), args.concurrency, args.secs))
                served[name] += rates[name][-1] * (time.perf_counter() - t)
                for who, pid in pids.items():
                    cpu[name][who] += cpu_secs(pid) - before[who]
    finally:
        await paths.close()
    res: dict = {"requests_per_path": len(lat["routed"]), "concurrency": args.concurrency}
    for name in PATHS:
        res[f"{name}_p50_ms"] = statistics.median(lat[name]) * 1e3
        res[f"{name}_p95_ms"] = percentile(lat[name], 0.95) * 1e3
        res[f"{name}_rps"] = statistics.median(rates[name])
        res[f"{name}_rps_rounds"] = rates[name]
        res[f"{name}_cpu_ms_per_request"] = {who: secs * 1e3 / served[name]
                                             for who, secs in cpu[name].items()}
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
    floor_proc, floor = spawn([py, "-c", HTTP_FLOOR_SERVER], "FLOOR LISTENING")
    pids = {"client": os.getpid(), "router": router_proc.pid, "neuron": fake.pid,
            "http floor server": floor_proc.pid}
    try:
        time.sleep(0.5)  # the router's first Watch message
        res = asyncio.run(run(args, neuron, router, floor, pids))
    finally:
        for proc in (router_proc, fake, floor_proc):
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
    print(f"  of the added latency, a bare aiohttp round trip (client and server, empty"
          f" handler) takes {res['http_floor_p50_ms']:.3f} ms p50")
    print("  CPU ms per request in the throughput rounds (2 cores shared by all):")
    for name in ("complete", "routed", "http_floor"):
        parts = {k: v for k, v in res[f"{name}_cpu_ms_per_request"].items() if v > 0.005}
        print(f"    {LABELS[name]:<28} " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
              + f"; total {sum(parts.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
