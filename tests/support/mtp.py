"""Shared by the MTP speculation tests (tests/neuron/engine/speculative/test_mtp_drafter.py
at tensor parallel 1, test_mtp_tp.py at 2) and bench/mtp.py: an engine spec, seeded greedy
requests, the check that a right head drafts, and the head crafted to be right."""

from __future__ import annotations

import random
from pathlib import Path

from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec
from support.engine import assert_whole, drive

GREEDY = m.SamplingParams(temperature=0.0)
# always draft spec_k (the policy's load rule is tested apart): every step exercises the head
SPEC = dict(spec_k=3, spec_full_below=1.0, spec_off_above=1.01, spec_min_acceptance=0.0)


def spec_for(model_dir: Path, **limits) -> EngineSpec:
    return EngineSpec(model_id="tiny", model_dir=str(model_dir), num_blocks=200, block_size=4,
                      context=512, bytes_per_token=0,
                      limits=m.Limits(**{"anon_max_in_flight": 64, "max_in_flight": 8,
                                         "max_slots": 8, "prefill_chunk_tokens": 6,
                                         "max_batched_tokens": 40, **limits}))


def assert_right_head_drafted(core: EngineCore, news: list[m.NewRequest],
                              want: dict[str, list[int]], plain_steps: int) -> None:
    """`core` (a crafted right head, speculation = mtp) gives plain decoding's tokens with
    at least 90% of its drafts accepted, in under 0.6x the plain run's steps, ledger whole."""
    run = drive(core, news, served=True)
    assert run.tokens == want
    s = core.status()
    assert s.spec_drafted_tokens > 20
    assert s.spec_accepted_tokens >= 0.9 * s.spec_drafted_tokens, s
    assert run.steps < plain_steps * 0.6, (run.steps, plain_steps)
    assert_whole(core)


def requests(seed: int, n: int) -> list[m.NewRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))]
        prompt = base * rng.randrange(1, 3) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]
        out.append(m.NewRequest(req_id=f"r{i}", prompt_token_ids=prompt,
                                max_tokens=rng.randrange(6, 30), sampling=GREEDY))
    return out


def craft_right_mtp_head(src: Path, out: Path) -> Path:
    """``src`` (a tiny checkpoint with an MTP head) made predictable: every residual branch
    of the target and of the head writes zero, so the target's next token is a fixed
    function of the current one, f(x) = argmax lm_head(norm(embed(x))); the head's fc
    passes the normed embedding through and its norm is the target's, so at position t
    it predicts f(x_{t+1}): the target's own next token. Its drafts are right."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    t = load_file(str(out / "model.safetensors"))
    for name in t:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    h = t["mtp.fc.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # (1 + w) = 1
    root = "model.language_model." if "model.language_model.norm.weight" in t else "model."
    t["mtp.norm.weight"] = t[root + "norm.weight"].clone()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
