"""Sampler: greedy, seeded reproducibility, top_k/top_p/min_p distributions, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from support.host_sync import CountReads, NoHostSync

from helexa.neuron.engine import ranking
from helexa.neuron.engine import sampler as sampler_module
from helexa.neuron.engine.messages import SamplingParams
from helexa.neuron.engine.sampler import Sampler, SamplingState, truncate

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.1])
LOGITS = PROBS.log()
N = 6000  # draws per distribution check: 4σ of a 0.5 frequency is ~0.026


def state(prompt=(), **kw) -> SamplingState:
    return SamplingState.for_request(SamplingParams(**kw), list(prompt), [])


def frequencies(logits: torch.Tensor, **kw) -> torch.Tensor:
    """Empirical distribution of N unseeded draws (one batch of N identical rows)."""
    torch.manual_seed(1234)
    picks = Sampler()(logits.repeat(N, 1), [state(**kw) for _ in range(N)])
    counts = torch.bincount(torch.tensor([t for t, _ in picks]), minlength=logits.numel())
    return counts.float() / N


def assert_close(freq: torch.Tensor, expected: list[float]) -> None:
    exp = torch.tensor(expected)
    tol = 4 * torch.sqrt(exp * (1 - exp) / N) + 1e-9  # zero-probability tokens: never drawn
    assert (freq - exp).abs().le(tol).all(), (freq.tolist(), expected)


def test_greedy_is_argmax_and_leaves_the_input_alone():
    logits = torch.randn(5, 50)
    before = logits.clone()
    picks = Sampler()(logits, [state(temperature=0.0, repetition_penalty=1.3) for _ in range(5)])
    assert torch.equal(logits, before)
    plain = Sampler()(logits, [state(temperature=0.0) for _ in range(5)])
    assert [t for t, _ in plain] == logits.argmax(-1).tolist()
    assert all(lp is None for _, lp in plain)
    assert len(picks) == 5


@pytest.mark.parametrize("kw, expected", [
    ({}, [0.5, 0.25, 0.15, 0.1]),
    ({"temperature": 2.0}, (PROBS.sqrt() / PROBS.sqrt().sum()).tolist()),
    ({"top_k": 2}, [2 / 3, 1 / 3, 0, 0]),
    ({"top_p": 0.7}, [2 / 3, 1 / 3, 0, 0]),  # 0.5 < 0.7, 0.75 reaches it: two tokens
    ({"top_p": 0.8}, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
    ({"min_p": 0.35}, [2 / 3, 1 / 3, 0, 0]),  # floor 0.175
    ({"min_p": 0.3}, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),  # floor 0.15 keeps 0.15
    ({"top_k": 3, "top_p": 0.6}, [2 / 3, 1 / 3, 0, 0]),
])
def test_sampled_distribution(kw, expected):
    assert_close(frequencies(LOGITS, **kw), expected)


def run(target: SamplingState, others: list[SamplingState], steps: int, vocab: int = 64) -> list[int]:
    """Decode `steps` tokens for target, batched second among `others`; its logits are the
    same whatever the batch, the neighbours' are noise."""
    mine, noise = torch.Generator().manual_seed(99), torch.Generator().manual_seed(5)
    sampler, out = Sampler(), []
    for _ in range(steps):
        row = torch.randn(1, vocab, generator=mine)
        logits = torch.cat([torch.randn(1, vocab, generator=noise), row,
                            torch.randn(len(others) - 1, vocab, generator=noise)]) if others else row
        batch = [others[0], target, *others[1:]] if others else [target]
        tok = sampler(logits, batch)[1 if others else 0][0]
        target.output_token_ids.append(tok)
        for o in others:
            o.output_token_ids.append(0)
        out.append(tok)
    return out


def test_same_seed_same_tokens_whatever_the_batch():
    alone = run(state(seed=7, temperature=1.0), [], 30)
    torch.manual_seed(0)  # the unseeded neighbours use the default generator
    crowd = [state(temperature=0.8), state(seed=8, top_p=0.9), state(temperature=0.0),
             state(temperature=1.0, repetition_penalty=1.2, logprobs=True, top_logprobs=2)]
    batched = run(state(seed=7, temperature=1.0), crowd, 30)
    assert alone == batched
    other_seed = run(state(seed=70, temperature=1.0), [], 30)
    assert other_seed != alone


@pytest.mark.parametrize("gpu", [False, True])
def test_same_seed_same_tokens_whatever_the_batch_when_logits_tie(monkeypatch, gpu):
    """bf16 logits tie often. Tied candidates go in token order, so whether the batch's
    truncation took a top-k or sorted the whole vocabulary (a top_p-only or a wide top_k
    neighbour) does not change which token a seeded row's uniform lands on."""
    if gpu:
        monkeypatch.setattr(sampler_module, "reads_back", lambda device: False)
    g = torch.Generator().manual_seed(11)
    steps = [(torch.randn(1, 64, generator=g) * 2).round() / 2 for _ in range(40)]

    def tokens(neighbours: list[dict]) -> list[int]:
        target = state(seed=3, temperature=0.9, top_k=5)
        crowd = [state(**k) for k in neighbours]
        out = []
        for row in steps:
            logits = torch.cat([row, *(row.roll(i + 1, 1) for i in range(len(crowd)))])
            out.append(Sampler()(logits, [target, *crowd])[0][0])
            target.output_token_ids.append(out[-1])
        return out

    alone = tokens([])
    assert tokens([dict(temperature=1.0, top_p=0.8, seed=1)]) == alone  # a full sort
    assert tokens([dict(temperature=1.0, top_k=40, seed=2)]) == alone  # a wider top-k
    assert tokens([dict(temperature=1.0, top_k=2000, seed=4)]) == alone


@pytest.mark.parametrize("gpu", [False, True])
def test_ranked_candidates_are_a_stable_sorts_first_k(monkeypatch, gpu):
    """However ties fall (bf16 values, -0.0 beside 0.0, rows all alike, masked -inf
    tokens, NaN), ranked's candidates are those a stable sort of the vocabulary puts first,
    in its order; on the GPU path in parts of a bounded size. Masked tokens (-inf) past
    the finite ones carry no probability, so their order is left as it falls."""
    if gpu:
        monkeypatch.setattr(sampler_module, "reads_back", lambda device: False)
        monkeypatch.setattr(ranking, "_KEY_BYTES", 3 * 24 * 300)  # 3 rows a part
    g = torch.Generator().manual_seed(7)
    for trial in range(120):
        vocab = int(torch.randint(5, 300, (1,), generator=g))
        k = int(torch.randint(1, vocab, (1,), generator=g))
        x = (torch.randn(7, vocab, generator=g) * 2).round() / 2
        if trial % 4 == 1:
            x[:, torch.randint(0, vocab, (vocab // 2,), generator=g)] = float("-inf")
        elif trial % 4 == 2:
            x = x.bfloat16().float()
        elif trial % 4 == 3:
            x[0, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
            x[1] = 0.0
            x[1, ::3] = -0.0
        want = torch.where(x.isnan(), float("inf"), x + 0.0).sort(
            dim=-1, descending=True, stable=True)[1][:, :k]
        vals, ids = ranking.ranked(x, k, on_host=sampler_module.reads_back(x.device))
        ranked_ok = vals > float("-inf")
        assert torch.equal(ids[ranked_ok], want[ranked_ok]), trial
        torch.testing.assert_close(vals, x.gather(1, ids), rtol=0, atol=0, equal_nan=True)


def test_repetition_frequency_and_presence_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 0.5]])
    rep = state(prompt=[0, 1], repetition_penalty=2.0, temperature=0.0, logprobs=True)
    rep.output_token_ids.append(4)
    (_, lp), = Sampler()(logits, [rep])
    expect = torch.tensor([1.0, -4.0, 1.0, 0.0, 0.25]).log_softmax(-1)  # seen: ÷2 if >0, ×2 if <0
    assert lp.logprob == pytest.approx(expect[lp.token_id].item(), abs=1e-6)

    s = state(frequency_penalty=0.5, presence_penalty=1.0, temperature=0.0, top_logprobs=5)
    s.output_token_ids.extend([1, 1, 2])
    zeros = torch.zeros(1, 5)
    (tok, lp), = Sampler()(zeros, [s])
    expect = torch.tensor([0.0, -2.0, -1.5, 0.0, 0.0]).log_softmax(-1)
    got = {t.token_id: t.logprob for t in lp.top}
    assert all(got[i] == pytest.approx(expect[i].item(), abs=1e-6) for i in range(5))
    s.output_token_ids.append(0)  # counts follow the growing output
    (tok, lp), = Sampler()(zeros, [s])
    assert tok in (3, 4)
    assert {t.token_id: t.logprob for t in lp.top}[0] == pytest.approx(
        torch.tensor([-1.5, -2.0, -1.5, 0.0, 0.0]).log_softmax(-1)[0].item(), abs=1e-6)


def test_logprobs_are_raw_pre_temperature_with_top_alternatives():
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0, 2.0, 0.0]] * 2)
    sts = [state(temperature=0.5, seed=1, logprobs=True, top_logprobs=3), state(temperature=0.0)]
    (tok, lp), (greedy_tok, none) = Sampler()(logits, sts)
    raw = logits[0].log_softmax(-1)
    assert none is None and greedy_tok == 0
    assert lp.token_id == tok and lp.logprob == pytest.approx(raw[tok].item(), abs=1e-6)
    assert [t.token_id for t in lp.top] == [0, 4, 1]
    assert [t.logprob for t in lp.top] == pytest.approx(raw[[0, 4, 1]].tolist(), abs=1e-6)
    assert math.isclose(sum(math.exp(x) for x in raw.tolist()), 1.0, rel_tol=1e-5)


def reference_keep(x: torch.Tensor, top_k: int, top_p: float) -> tuple[set[int], set[int]]:
    """Tokens kept by top_k then top_p, the plain way (sort everything), and the tokens so
    close to the top_p boundary (1e-5) that rounding may decide either way."""
    vals, idx = x.double().sort(descending=True)
    if top_k:
        vals, idx = vals[:top_k], idx[:top_k]
    probs = vals.softmax(-1)
    before = probs.cumsum(-1) - probs
    return set(idx[before < top_p].tolist()), set(idx[(before - top_p).abs() < 1e-5].tolist())


@pytest.mark.parametrize("host", [False, True])  # the GPU's way: top_k read on the host
@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])  # flat (needs the full sort) .. peaky
def test_truncation_matches_a_full_sort(scale, host):
    g = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(6, 5000, generator=g) * scale
    cases = [(0, 0.9), (40, 1.0), (40, 0.5), (2000, 0.95), (0, 0.999), (1, 0.3)]
    top_k = torch.tensor([k or 5000 for k, _ in cases])
    top_p = torch.tensor([p if p < 1 else 2.0 for _, p in cases])
    if host:
        host_top_k = top_k.tolist()  # the engine's own list, as the GPU's way takes it
        with NoHostSync():
            cand, idx = truncate(x, top_k, top_p, host_top_k=host_top_k)
    else:
        cand, idx = truncate(x, top_k, top_p)
    for row, (k, p) in enumerate(cases):
        kept = set(idx[row][cand[row] > float("-inf")].tolist())
        expected, boundary = reference_keep(x[row], k, p)
        assert kept ^ expected <= boundary, (scale, k, p)
        assert len(kept) > 0.9 * len(expected)


def test_top_p_over_a_large_vocab_and_edge_values():
    logits = torch.full((1500,), -40.0)  # > 1,024 candidates; a negligible tail: closes early
    logits[:4] = LOGITS
    assert_close(frequencies(logits, top_p=0.7)[:4], [2 / 3, 1 / 3, 0, 0])
    picks = Sampler()(LOGITS.repeat(2, 1), [state(top_p=0.0), state(min_p=1.5)])
    assert [t for t, _ in picks] == [0, 0]  # both cut down to the best token


def test_on_a_gpu_sampling_reads_nothing_back_and_draws_the_same_tokens(monkeypatch):
    """A lookahead step samples without waiting for the device (engine/lookahead.py):
    with reads_back off, as on a GPU, no op of choose reads a value back, and seeded rows
    draw what the CPU's shortcut draws."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=g) * 2
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=1),
             dict(temperature=1.0, top_k=50, seed=2), dict(temperature=0.7, min_p=0.1, seed=3),
             dict(temperature=1.2, seed=4), dict(temperature=0.9, top_k=2000, top_p=0.95, seed=5)]
    want = Sampler().choose(logits, [state(**k) for k in kinds])
    monkeypatch.setattr(sampler_module, "reads_back", lambda device: False)
    with NoHostSync():
        got = Sampler().choose(logits, [state(**k) for k in kinds])
    assert got.tolist() == want.tolist()


def test_a_step_with_logprobs_waits_for_the_device_once(monkeypatch):
    """A synchronous step's tokens and logprobs are computed on the device and copied back
    together, read after one wait (was four: the tokens, then each logprobs tensor). A GPU
    is stood in for: copies to the host are clones (not reads) and the copies' event counts
    its wait; sampling truncates as on a GPU. The same tokens and logprobs as the CPU's."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 300, generator=g) * 2
    kinds = [dict(temperature=0.0, logprobs=True, top_logprobs=3),
             dict(temperature=0.8, seed=1, logprobs=True, top_logprobs=5), dict(temperature=0.0),
             dict(temperature=1.0, top_k=40, seed=2, logprobs=True), dict(temperature=0.9, seed=3)]
    want = Sampler()(logits, [state(**k) for k in kinds])
    assert [lp is not None for _, lp in want] == [True, True, False, True, False]
    counted = CountReads()

    class Event:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            counted.reads.append("wait")

    def to_host(t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        counted.host.append(copy)
        return copy

    monkeypatch.setattr(sampler_module, "copies_done_event", lambda device: Event())
    monkeypatch.setattr(sampler_module, "to_host", to_host)
    monkeypatch.setattr(sampler_module, "reads_back", lambda device: False)
    with counted:
        got = Sampler()(logits, [state(**k) for k in kinds])
    assert counted.reads == ["wait"]
    assert got == want
