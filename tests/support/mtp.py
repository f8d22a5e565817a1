"""Shared by the MTP speculation tests (tests/neuron/engine/test_mtp_drafter.py at tensor
parallel 1, test_mtp_tp.py at 2): an engine spec, a driver that runs an engine core to
idle, the ledger check, seeded greedy requests, and a head crafted to predict right."""

from __future__ import annotations

import random
from pathlib import Path

from helexa.fixtures.hybrid import craft_right_mtp_head
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from support.spec_engine import assert_whole, drive_steps

drive = drive_steps  # the MTP tests count steps too
crafted = craft_right_mtp_head  # a tiny checkpoint's MTP head made right (tiny_hybrid.py)
__all__ = ["GREEDY", "SPEC", "assert_right_head_drafted", "assert_whole", "crafted", "drive",
           "requests", "spec_for", "with_drafter"]

GREEDY = m.SamplingParams(temperature=0.0)
# always draft spec_k (the policy's load rule is tested apart): every step exercises the head
SPEC = dict(spec_k=3, spec_full_below=1.0, spec_off_above=1.01, spec_min_acceptance=0.0)


def spec_for(model_dir: Path, **limits) -> EngineSpec:
    return EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=200, block_size=4,
                      context=512, bytes_per_token=0,
                      limits=m.SetLimits(anon_max_in_flight=64, max_in_flight=8, max_slots=8,
                                         prefill_chunk_tokens=6, max_batched_tokens=40,
                                         **limits))


def assert_right_head_drafted(core: EngineCore, news: list[m.NewRequest],
                              want: dict[str, list[int]], plain_steps: int) -> None:
    """`core` (a crafted right head, speculation = mtp) gives plain decoding's tokens with
    at least 90% of its drafts accepted, in under 0.6x the plain run's steps, ledger whole."""
    got, steps = drive(core, news)
    assert got == want
    s = core.status()
    assert s.spec_drafted_tokens > 20
    assert s.spec_accepted_tokens >= 0.9 * s.spec_drafted_tokens, s
    assert steps < plain_steps * 0.6, (steps, plain_steps)
    assert_whole(core)


def with_drafter(core: EngineCore, make) -> EngineCore:
    """`core` drafting with `make(core)`: an MtpDrafter draws blocks through its engine."""
    core.speculator.drafter = make(core)
    core._own_drafter = False  # as if handed in: a limits change keeps it
    return core


def requests(seed: int, n: int) -> list[m.NewRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))]
        prompt = base * rng.randrange(1, 3) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]
        out.append(m.NewRequest(req_id=f"r{i}", prompt_token_ids=prompt,
                                max_tokens=rng.randrange(6, 30), sampling=GREEDY))
    return out
