"""A kv_dtype profile switch against loading the model, through a real neuron daemon.

    .venv/bin/python bench/profile_switch.py [--model DIR] [--kv-budget-mb 256] [--repeats 3]
                                             [--kv-dtype int8]

Starts `helexa neuron` on loopback with one model and a profile whose only
setting is a kv_dtype, then, interleaved in every repeat:

- switch: `SetProfile(model, "quant")` — the daemon stops admitting, waits for
  in-flight work (none here), re-plans the pool in the engine process
  (`reset_kv`: the old pool freed, the new one allocated, no weights touched)
  and answers once the model is ready again; then `SetProfile(model, "")`
  back to the base kv_dtype (timed too);
- load: `Unload(model)` then `Load(model)` — a fresh engine process that
  imports torch, reads the checkpoint, builds the model and its pool; `Load`
  answers once it is ready. Only the Load is timed.

Each is timed from the client's call to its answer, the way `helexa ctl`
sees it. Switching to the quantised dtype costs more than switching back:
each repeat's Load makes a fresh engine process, whose first pool of that
shape faults in fresh pages (~0.2 s for 256 MiB here); returning to the
base dtype reuses pages the allocator already holds. Without --model it builds (once, cached) bench/engine.py's
checkpoint: init-tiny qwen3, hidden 512, 8 layers, vocab 8192 (~30M
parameters, fp32). Benchmarks print figures; they assert nothing.

(Issue 7 calls this bench/profile.py; a bench/profile.py shadows the standard
library's `profile` for every script run from bench/, which breaks cProfile
and so transformers' imports in bench/engine.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from helexa.neuron.auth import bearer
from helexa.proto import neuron_pb2 as pb
from helexa.proto import neuron_pb2_grpc

# the daemon helpers are test support (tests/support/)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.neuron import start_neuron, write_neuron_config  # noqa: E402

TOKEN = "bench-profile"


def default_model() -> Path:
    from helexa.fixtures.tiny import bench_checkpoint

    return bench_checkpoint()


def neuron_config(workdir: Path, model: Path, kv_budget_mb: int, kv_dtype: str,
                  threads: int) -> Path:
    (workdir / "token").write_text(TOKEN + "\n")
    return write_neuron_config(workdir / "neuron.toml", {
        "server": {"name": "bench-profile", "listen": "127.0.0.1:0", "token_file": "token",
                   "drain_secs": 30.0},
        "engine": {"torch_threads": threads},
        "kv": {"kv_budget_mb": kv_budget_mb},
        "profiles": {"quant": {"kv_dtype": kv_dtype}},
        "models": [{"id": "m", "path": str(model)}],
    })


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await coro
    return time.perf_counter() - t0, out


async def run(address: str, repeats: int) -> dict[str, list[float]]:
    md = bearer(TOKEN)
    secs: dict[str, list[float]] = {"switch": [], "switch back": [], "load": []}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = neuron_pb2_grpc.NeuronStub(ch)
        for i in range(repeats):
            dt, res = await timed(stub.SetProfile(pb.SetProfileRequest(model="m", profile="quant"),
                                                  metadata=md))
            secs["switch"].append(dt)
            if i == 0:
                print("switch:", "; ".join(res.changed))
            dt, _ = await timed(stub.SetProfile(pb.SetProfileRequest(model="m", profile=""),
                                                metadata=md))
            secs["switch back"].append(dt)
            await stub.Unload(pb.UnloadRequest(model="m"), metadata=md)
            dt, res = await timed(stub.Load(pb.LoadRequest(model="m", principal="bench"),
                                            metadata=md))
            if res.status.state != pb.MODEL_STATE_READY:
                raise RuntimeError(f"load did not end ready: {res.status}")
            secs["load"].append(dt)
    return secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: a cached init-tiny)")
    ap.add_argument("--kv-budget-mb", type=int, default=256, help="the model's KV pool")
    ap.add_argument("--kv-dtype", default="int8", help="the profile's kv_dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    args = ap.parse_args(argv)
    model = args.model or default_model()
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as d:
        cfg = neuron_config(Path(d), model, args.kv_budget_mb, args.kv_dtype, args.threads)
        neuron = start_neuron(cfg)
        try:
            secs = asyncio.run(run(neuron.address, args.repeats))
        finally:
            neuron.stop()
    med = {k: statistics.median(v) for k, v in secs.items()}
    print(f"model {model}; KV pool {args.kv_budget_mb} MiB; base kv_dtype -> {args.kv_dtype}; "
          f"{args.repeats} repeats, medians (each run: " +
          ", ".join(f"{k} {' '.join(f'{s:.3f}' for s in v)}" for k, v in secs.items()) + " s)")
    print(f"{'kv_dtype switch (SetProfile)':<34}{med['switch']:>9.3f} s")
    print(f"{'switch back':<34}{med['switch back']:>9.3f} s")
    print(f"{'load (Load after Unload)':<34}{med['load']:>9.3f} s")
    print(f"switch / load = {med['switch'] / med['load']:.3f}  "
          f"(load is {med['load'] / med['switch']:.1f}x the switch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
