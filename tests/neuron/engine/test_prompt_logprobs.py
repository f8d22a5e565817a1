"""Prompt logprobs (helexa/neuron/engine/prompt_logprobs.py): a request that asks gets, for
every prompt token after the first, the log-softmax of the logits before it at that token
and the best k there, as transformers computes them: prefilled whole, in chunks, beside a
prefix the cache holds, beside speculation and lookahead; max_tokens 0 generates nothing;
every block comes back."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from support.engine import assert_whole, drive

from helexa.neuron.engine import lookahead
from helexa.neuron.engine import messages as m
from helexa.neuron.engine.engine_core import EngineCore
from helexa.neuron.engine.spec import EngineSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
SCORED = m.SamplingParams(temperature=0.0, prompt_logprobs=K)
GREEDY = m.SamplingParams(temperature=0.0)


def core_for(model_dir: Path, *, prefix_cache: bool = False, **limits: Any) -> EngineCore:
    spec = EngineSpec(model_id="t", model_dir=str(model_dir), num_blocks=96, block_size=8,
                      context=256, prefix_cache=prefix_cache, bytes_per_token=0,
                      limits=m.Limits(**{"anon_max_in_flight": 16, **limits}))
    return EngineCore(spec)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def scored(core: EngineCore, news: list[m.NewRequest]) -> tuple[Any, dict[str, list]]:
    """Drive `news` to the end: the run, and each request's prompt logprobs as they came."""
    got: dict[str, list] = {}

    def on(u: m.RequestUpdate) -> None:
        if u.prompt_logprobs:
            got.setdefault(u.req_id, []).extend(u.prompt_logprobs)

    return drive(core, news, served=True, on_update=on), got


@cache
def reference(model_dir: Path, ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor,
                                                               torch.Tensor]:
    """transformers in float32: each prompt token's logprob after the ones before it, and the
    best K (values, ids) there."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    top_v, top_i = lps.topk(K, dim=-1)
    return lps.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1), top_v, top_i


def assert_reference(model_dir: Path, ids: list[int], entries: list, atol: float) -> None:
    chosen, top_v, top_i = reference(model_dir, tuple(ids))
    assert [e.token_id for e in entries] == ids[1:]
    got = torch.tensor([e.logprob for e in entries])
    torch.testing.assert_close(got, chosen, atol=atol, rtol=0)
    assert [[t.token_id for t in e.top] for e in entries] == top_i.tolist()
    torch.testing.assert_close(torch.tensor([[t.logprob for t in e.top] for e in entries]),
                               top_v, atol=atol, rtol=0)


@pytest.mark.parametrize("chunk", [512, 7])
def test_they_are_transformers_whole_or_in_chunks(tiny_model_dir, chunk):
    """The prompt prefilled in one chunk or in chunks of 7: transformers' logprobs and top-3
    to 1e-4 in float32; max_tokens 0 finishes `length` with no token; a request with
    max_tokens generates as one without prompt logprobs does."""
    ids = prompt(1, 41)
    core = core_for(tiny_model_dir, prefill_chunk_tokens=chunk)
    run, got = scored(core, [
        m.NewRequest(req_id="alone", prompt_token_ids=ids, max_tokens=0, sampling=SCORED),
        m.NewRequest(req_id="then", prompt_token_ids=ids, max_tokens=5, sampling=SCORED),
        m.NewRequest(req_id="plain", prompt_token_ids=ids, max_tokens=5, sampling=GREEDY)])
    assert run.tokens["alone"] == [] and run.final["alone"].finished == m.FinishReason.LENGTH
    assert run.tokens["then"] == run.tokens["plain"] and len(run.tokens["plain"]) == 5
    assert "plain" not in got
    for rid in ("alone", "then"):
        assert_reference(tiny_model_dir, ids, got[rid], atol=1e-4)
    assert_whole(core)


def test_a_cached_prefix_is_computed_again_and_filed_for_the_next(tiny_model_dir):
    """A prompt whose prefix an earlier request left in the cache: the scoring request takes
    no hit (the skipped positions would have no logits) and still scores every token as
    transformers does; the blocks it files serve the plain request after it."""
    head, tail = prompt(2, 24), prompt(3, 21)
    core = core_for(tiny_model_dir, prefix_cache=True, prefill_chunk_tokens=16)
    first = drive(core, [m.NewRequest(req_id="head", prompt_token_ids=head, max_tokens=2,
                                      sampling=GREEDY)], served=True)
    assert first.admitted["head"].cached_tokens == 0
    run, got = scored(core, [m.NewRequest(req_id="s", prompt_token_ids=head + tail,
                                          max_tokens=0, sampling=SCORED)])
    assert run.admitted["s"].cached_tokens == 0
    assert_reference(tiny_model_dir, head + tail, got["s"], atol=1e-4)
    after = drive(core, [m.NewRequest(req_id="after", prompt_token_ids=head + tail,
                                      max_tokens=2, sampling=GREEDY)], served=True)
    assert after.admitted["after"].cached_tokens == 40  # head's 24, and 16 "s" filed
    assert_whole(core)


def test_a_hybrid_scores_in_chunks_as_whole_and_files_its_snapshots(tiny_checkpoint):
    """A Gated DeltaNet hybrid: chunks of 7 beside a cached prefix score as one whole chunk
    does, and as transformers' reference does; the prefix snapshots the scoring request
    files give the plain request after it the tokens it has alone."""
    model_dir = tiny_checkpoint("qwen3_5")
    ids = prompt(4, 37)
    new = [m.NewRequest(req_id="s", prompt_token_ids=ids, max_tokens=3, sampling=SCORED)]
    whole = core_for(model_dir)
    ran, want = scored(whole, new)
    chunked = core_for(model_dir, prefix_cache=True, prefill_chunk_tokens=7)
    drive(chunked, [m.NewRequest(req_id="warm", prompt_token_ids=ids[:20], max_tokens=2,
                                 sampling=GREEDY)], served=True)
    run, got = scored(chunked, new)
    assert run.admitted["s"].cached_tokens == 0 and run.tokens == ran.tokens
    torch.testing.assert_close(torch.tensor([e.logprob for e in got["s"]]),
                               torch.tensor([e.logprob for e in want["s"]]), atol=1e-4, rtol=0)
    # the hybrid's own kernels differ from transformers' reference ones by ~4e-4 here
    assert_reference(model_dir, ids, want["s"], atol=2e-3)
    after = drive(chunked, [m.NewRequest(req_id="p", prompt_token_ids=ids, max_tokens=3,
                                         sampling=GREEDY)], served=True)
    assert after.admitted["p"].cached_tokens > 20  # past the warm prompt's: "s" filed them
    assert after.tokens["p"] == ran.tokens["s"]
    assert_whole(whole, hybrid=True)
    assert_whole(chunked, hybrid=True)


def test_beside_speculation_and_lookahead_nothing_changes(tiny_model_dir, monkeypatch):
    """Scoring requests among n-gram speculated, lookahead-held decodes: every request's
    tokens are the plain engine's, the scores are the same, drafts were verified, and the
    step's scored rows never reached the sampler or the verifier."""
    loop = [7, 8, 9, 10] * 6  # n-gram drafts find their continuation here
    news = [m.NewRequest(req_id=f"r{i}", prompt_token_ids=loop[i:] + prompt(i, 9 + 3 * i),
                         max_tokens=12, sampling=SCORED if i % 2 else GREEDY)
            for i in range(4)]
    monkeypatch.setenv(lookahead.ENV, "0")
    base_run, base = scored(core_for(tiny_model_dir, prefill_chunk_tokens=8), news)
    monkeypatch.setenv(lookahead.ENV, "1")
    core = core_for(tiny_model_dir, prefill_chunk_tokens=8, speculation="ngram")
    assert core.lookahead
    run, got = scored(core, news)
    assert run.tokens == base_run.tokens
    assert got.keys() == base.keys() == {"r1", "r3"}
    for rid in got:
        torch.testing.assert_close(torch.tensor([e.logprob for e in got[rid]]),
                                   torch.tensor([e.logprob for e in base[rid]]),
                                   atol=1e-5, rtol=0)
    assert core.status().spec_drafted_tokens > 0
    assert_whole(core)


def test_a_short_scoring_prompt_is_not_held_behind_a_long_one(tiny_model_dir):
    """Two scoring prompts in one step's arrivals, a long one first, 8 scoring rows a step:
    they share them, so the short one finishes (its logprobs whole, as transformers has
    them) while the long one is still prefilling, rather than after it."""
    long_, short = prompt(5, 120), prompt(6, 12)
    core = core_for(tiny_model_dir, max_slots=4, prefill_chunk_tokens=64)
    core.scheduler.scoring_rows = 8
    done: list[str] = []
    got: dict[str, list] = {}

    def on(u: m.RequestUpdate) -> None:
        got.setdefault(u.req_id, []).extend(u.prompt_logprobs or [])
        if u.finished is not None:
            done.append(u.req_id)

    run = drive(core, [
        m.NewRequest(req_id="long", prompt_token_ids=long_, max_tokens=0, sampling=SCORED),
        m.NewRequest(req_id="short", prompt_token_ids=short, max_tokens=0, sampling=SCORED)],
        served=True, on_update=on)
    assert done == ["short", "long"]
    assert run.steps > 120 // 8  # at most 8 scoring rows a step
    assert_reference(tiny_model_dir, short, got["short"], atol=1e-4)
    assert_reference(tiny_model_dir, long_, got["long"], atol=1e-4)
    assert_whole(core)


def test_a_small_vocabulary_scores_whole_chunks(tiny_model_dir):
    """The rows a step scores are bounded by bytes where that allows more than 4 a slot
    (prompt_logprobs.allowance): the tiny model's 512-token vocabulary makes a scored row
    small beside a 2,048-token step's layers (~500 rows, prompt_logprobs.py), so a
    200-token prompt scores in chunks of 64 (4 steps) rather than 8 rows a step (25), as
    transformers has its logprobs."""
    ids = prompt(7, 200)
    core = core_for(tiny_model_dir, max_slots=2, max_batched_tokens=2048,
                    prefill_chunk_tokens=64)
    assert core.scheduler.scoring_rows >= 64 > 4 * 2
    run, got = scored(core, [m.NewRequest(req_id="s", prompt_token_ids=ids, max_tokens=0,
                                          sampling=SCORED)])
    assert run.steps == 4
    assert_reference(tiny_model_dir, ids, got["s"], atol=1e-4)
    assert_whole(core)
