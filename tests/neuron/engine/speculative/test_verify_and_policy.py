"""Verification, policy and prompt lookup as units: the rejection rule leaves the sampled
distribution unchanged (statistical, toy vocabulary, seeded), greedy takes the longest
matching prefix, k gives way to load, prompt lookup continues earlier text."""

from __future__ import annotations

import torch

from helexa.config.speculation import Speculation
from helexa.neuron.engine.messages import SamplingParams
from helexa.neuron.engine.request import Request
from helexa.neuron.engine.sampler import Sampler, SamplingState
from helexa.neuron.engine.speculative import verify as verify_mod
from helexa.neuron.engine.speculative.drafters import NgramDrafter
from helexa.neuron.engine.speculative.policy import choose_k, update_acceptance
from helexa.neuron.engine.speculative.verify import Row, target_probs, verify, verify_rows

V = 6
N = 4_000  # sampler draws (vectorised)
TRIALS = 2_500  # verifications (one at a time: the loaded CI machine is slow at them)


def state(**kw) -> SamplingState:
    return SamplingState.for_request(SamplingParams(**kw), [1, 2], [])


def close(freq: torch.Tensor, p: torch.Tensor, n: int) -> None:
    """Every frequency within 5 standard errors of its probability."""
    se = (p * (1 - p) / n).sqrt().clamp(min=1e-4)
    assert ((freq - p).abs() <= 5 * se).all(), (freq, p)


def test_greedy_accepts_longest_matching_prefix_plus_one():
    logits = torch.full((4, V), -1.0)
    for row, t in enumerate([3, 1, 4, 0]):
        logits[row, t] = 1.0
    g = state(temperature=0.0)
    assert verify(logits, [3, 1, 4], None, g) == [3, 1, 4, 0]  # all accepted + bonus
    assert verify(logits, [3, 2, 4], None, g) == [3, 1]  # stops at the first mismatch
    assert verify(logits, [5, 1, 4], None, g) == [3]


def test_rejection_rule_keeps_the_target_distribution_with_a_stochastic_drafter():
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    logits = torch.stack([target, target.flip(0), target]).log()
    q = torch.stack([target.flip(0), target])  # a poor drafter: 60 % rejected at token 1
    st = state(temperature=1.0, seed=7)
    p = target_probs(logits, st)
    first = torch.zeros(V)
    second = torch.zeros(V)
    n_second = 0
    for _ in range(TRIALS):
        d = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = verify(logits, d, q, st)
        first[out[0]] += 1
        if len(out) >= 2:  # token 1 accepted: what follows is drawn as the target would
            second[out[1]] += 1
            n_second += 1
    close(first / TRIALS, p[0], TRIALS)
    assert n_second > TRIALS // 10
    close(second / n_second, p[1], n_second)


def test_rejection_rule_with_a_deterministic_draft_and_truncation():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=gen)
    st = state(temperature=1.3, top_k=4, top_p=0.9, seed=3)
    p = target_probs(logits, st)
    guess = int(p[0].argmax())
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        counts[verify(logits, [guess], None, st)[0]] += 1
    close(counts / TRIALS, p[0], TRIALS)


def test_a_steps_rows_are_verified_together_in_three_reads(monkeypatch):
    """Rows of different requests verified in one call: the host waits for the device three
    times (every greedy row's argmax, every draft's test, then every sampled row's token
    after its drafts) however many rows, and each row keeps its own target distribution
    (rows with a stochastic drafter, with a deterministic one, with no draft, and a greedy
    row, which takes its own argmax)."""
    reads = []
    real_read = verify_mod._read
    monkeypatch.setattr(verify_mod, "_read", lambda t: reads.append(t.shape) or real_read(t))
    gen = torch.Generator().manual_seed(4)
    target = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    poor = torch.stack([target.flip(0), target])  # rejected 60 % of the time at token 1
    a_logits = torch.stack([target, target.flip(0), target]).log()
    b_logits = torch.randn(3, V, generator=gen)
    b_logits[0, 2] += 3.0  # its first guess stands far more often than row a's drafts
    c_logits = torch.randn(1, V, generator=gen)
    a, b = state(temperature=1.0, seed=7), state(temperature=0.8, top_k=4)
    c, g = state(temperature=1.2, seed=9), state(temperature=0.0)
    pa, pb, pc = (target_probs(x, st) for x, st in ((a_logits, a), (b_logits, b), (c_logits, c)))
    guess = [int(pb[0].argmax()), int(pb[1].argmax())]
    firsts = torch.zeros(3, V)
    trials = 1_500
    for _ in range(trials):
        d = [int(torch.multinomial(poor[i], 1, generator=gen)) for i in range(2)]
        outs = verify_rows([Row(a_logits, d, poor, a), Row(b_logits, guess, None, b),
                            Row(torch.eye(V)[[0, 3]], [0], None, g),
                            Row(c_logits, [], None, c)])
        for i, out in enumerate((outs[0], outs[1], outs[3])):
            firsts[i, out[0]] += 1
        assert outs[2] == [0, 3]
    assert len(reads) == 3 * trials
    # the greedy row's 2 argmaxes; 2 + 2 + 0 drafts' tests; 3 sampled rows' tokens
    assert reads[:3] == [(2,), (4, 3), (3,)]
    for i, p in enumerate((pa[0], pb[0], pc[0])):
        close(firsts[i] / trials, p, trials)


def test_target_probs_are_what_the_sampler_draws_from():
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 2
    for kw in ({"temperature": 0.7}, {"temperature": 1.0, "top_k": 3},
               {"temperature": 1.0, "top_p": 0.6}, {"temperature": 0.9, "min_p": 0.2}):
        st = state(**kw)
        p = target_probs(logits, st)[0]
        picks = Sampler()(logits.expand(N, V), [st] * N)
        freq = torch.bincount(torch.tensor([t for t, _ in picks]), minlength=V) / N
        close(freq, p, N)


def test_target_probs_read_nothing_back_from_a_gpu(monkeypatch):
    """Sampled verification truncates each request's rows by its top_k / top_p: on a GPU
    (reads_back off) with top_k known on the host, as the sampler does, not read back from
    the device three times a row. The same distributions either way."""
    from support.host_sync import NoHostSync

    from helexa.neuron.engine import sampler as sampler_module

    torch.manual_seed(3)
    logits = torch.randn(3, 2048) * 3  # more than the first candidates a top_p row tries
    kws = ({"temperature": 0.7, "top_p": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.95},
           {"temperature": 1.0, "top_k": 50}, {"temperature": 0.9, "min_p": 0.1, "top_p": 0.9})
    on_cpu = [target_probs(logits, state(**kw)) for kw in kws]
    for where in (sampler_module, verify_mod):
        monkeypatch.setattr(where, "reads_back", lambda device: False)
    with NoHostSync():
        on_gpu = [target_probs(logits, state(**kw)) for kw in kws]
    for a, b in zip(on_cpu, on_gpu, strict=True):
        torch.testing.assert_close(a, b)


def test_policy_gives_way_to_load():
    pol = Speculation(spec_k=4, spec_full_below=0.25, spec_off_above=0.75)
    ks = [choose_k(pol, occupancy=n / 8, acceptance=0.5, probe=False)
          for n in range(1, 9)]
    assert ks == [4, 4, 3, 2, 1, 0, 0, 0]
    assert choose_k(Speculation(spec_k=0), occupancy=0.1, acceptance=None,
                    probe=False) == 0
    # a full batch still probes now and then, and keeps drafting where drafts are right
    assert choose_k(pol, occupancy=1.0, acceptance=None, probe=False) == 1
    assert choose_k(pol, occupancy=1.0, acceptance=0.5, probe=True) == 1
    assert choose_k(pol, occupancy=1.0, acceptance=0.5, probe=False) == 0
    assert choose_k(pol, occupancy=1.0, acceptance=0.9, probe=False) == 4


def test_policy_stops_drafting_for_a_poor_acceptor_but_probes():
    pol = Speculation(spec_k=4, spec_min_acceptance=0.3)  # probes every 8 steps
    assert choose_k(pol, occupancy=0.1, acceptance=0.1, probe=False) == 0
    assert choose_k(pol, occupancy=0.1, acceptance=0.1, probe=True) == 4
    assert choose_k(pol, occupancy=0.1, acceptance=0.9, probe=False) == 4
    a = update_acceptance(None, 4, 0)
    assert a == 0.0 and update_acceptance(a, 4, 4) > a and update_acceptance(a, 0, 0) == a


def test_prompt_lookup_continues_the_latest_earlier_match():
    req = Request("r", prompt_token_ids=[5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3], output_budget=9)
    req.output_token_ids += [5, 6]
    # "5 6" occurs twice earlier; the later one (followed by 7 2 3) wins
    assert NgramDrafter().propose(req, 3).tokens == [7, 2, 3]
    assert NgramDrafter().propose(req, 0).tokens == []
    loop = Request("l", prompt_token_ids=[9, 4, 5, 4, 5], output_budget=9)
    assert NgramDrafter().propose(loop, 5).tokens == [4, 5, 4, 5, 4]  # a loop runs on
    lone = Request("s", prompt_token_ids=[1, 2, 3, 4], output_budget=4)
    assert NgramDrafter().propose(lone, 3).tokens == []
