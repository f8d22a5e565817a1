"""What the engine's own bookkeeping costs per step, without a model.

    .venv/bin/python bench/admission_core.py [--repeats 5]

Two figures, medians of repeats, torch pinned to one thread:

1. admission: µs for one submit + admit + expire round with a deep queue
   (256 queued over 32 principals, the pool full so nobody is admitted —
   the worst case, every step scans the rotation and the deadlines);
2. engine step overhead: µs per step (and per token) of EngineCore with a
   runner that returns zero logits at once, at 1, 8 and 64 running requests:
   its own bookkeeping (scheduler, block draws, stop checks, prefix hashing,
   status) with a sampler that costs nothing, then with the real Sampler
   (greedy over a 32000-token vocabulary).

Compare the second with a real step of your model (bench/engine.py) to see
the share the engine adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.admission import Admission
from helexa.neuron.engine.block_pool import BlockPool
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.runner import StepOutput
from helexa.neuron.engine.spec import EngineSpec


class NullRunner:
    """Logits at once: a preallocated zero block, sliced; nothing else (a Runner:
    helexa/neuron/engine/runner.py, with no model, pool or state)."""

    num_blocks, num_state_slots, mtp_kv_layers = 8192, 0, 0
    kv_bytes_per_block = fixed_bytes_per_request = 0
    attention_backend, has_mtp_head, failed = "", False, ""

    def __init__(self, vocab: int) -> None:
        self.vocab_size = vocab
        self.logits = torch.zeros(64, vocab)

    def run_step(self, seqs, *, keep_hidden=False):
        return StepOutput(self.logits[: sum(s.need_logits for s in seqs)], [])

    def reset_kv(self, num_blocks, kv_dtype="auto"):
        self.num_blocks = num_blocks

    def close(self):
        pass


def first_token(logits, states):
    """A sampler that costs nothing: isolates the engine's own bookkeeping."""
    return [(1, None)] * len(states)


def bench_admission(rounds: int = 2000) -> float:
    pool = BlockPool(1024, 16, 16)
    pool.reserve("hog", 1024)  # nothing fits: every round walks the queue and finds no room
    limits = m.Limits(max_queue_depth=10_000, max_per_principal=10_000)
    adm = Admission(pool, limits)
    for i in range(256):
        adm.submit(Request(req_id=f"q{i}", prompt_token_ids=[1] * 100, output_budget=100,
                           principal=f"p{i % 32}", deadline_unix=time.time() + 3600))
    t0 = time.perf_counter()
    for i in range(rounds):
        req = Request(req_id=f"n{i}", prompt_token_ids=[1] * 100, output_budget=100,
                      principal=f"p{i % 32}")
        adm.submit(req)
        adm.admit()
        adm._last_expire = -1.0  # defeat the 10 ms throttle: measure the scan itself
        adm.expire()
        adm.remove(req)
    return (time.perf_counter() - t0) / rounds * 1e6


def bench_step(slots: int, steps: int = 200, *, vocab: int = 32000, sampler=None) -> float:
    spec = EngineSpec(model_id="null", num_blocks=8192, block_size=16, context=4096,
                      prefix_cache=True,
                      limits=m.Limits(max_slots=slots, max_in_flight=slots,
                                      anon_max_in_flight=slots, max_per_principal=10_000))
    core = EngineCore(spec, NullRunner(vocab), sampler=sampler)
    greedy = m.SamplingParams(temperature=0.0)
    core.step(m.ToEngine(new=[m.NewRequest(req_id=f"r{i}", prompt_token_ids=list(range(128)),
                                           max_tokens=steps + 10, sampling=greedy)
                              for i in range(slots)]))
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    adm = statistics.median(bench_admission() for _ in range(args.repeats))
    print(f"admission round, 256 queued over 32 principals: {adm:8.1f} µs")
    for slots in (1, 8, 64):
        own = statistics.median(bench_step(slots, sampler=first_token) for _ in range(args.repeats))
        full = statistics.median(bench_step(slots) for _ in range(args.repeats))
        print(f"engine step, {slots:2d} running: bookkeeping {own:7.1f} µs/step"
              f" ({own / slots:5.1f} µs/token); with Sampler at vocab 32000 {full:7.1f} µs/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
