"""The gated delta rule's fast forms (chunked prefill, batched decode) and the causal
conv1d agree with the token-by-token reference, across chunk and call boundaries."""

from __future__ import annotations

import pytest
import torch

from helexa.kernels import fla_gdn as fla
from helexa.kernels import fla_norm
from helexa.kernels import gated_delta as gd


def inputs(t: int, h: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = gd.l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = gd.l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay = -torch.rand(t, h, generator=g) * 2  # log decays, <= 0
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("t", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_reference(t, with_state):
    q, k, v, g, beta, state = inputs(t)
    s0 = state if with_state else None
    ref_o, ref_s = gd.delta_rule_reference(q, k, v, g, beta, s0)
    o, s = gd.delta_rule_chunked(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)


def test_prefill_in_pieces_then_decode_matches_one_pass():
    # A prompt prefilled as 37 + 50 tokens, then 3 decode steps batched beside another row.
    q, k, v, g, beta, state = inputs(90, seed=1)
    ref_o, ref_s = gd.delta_rule_reference(q, k, v, g, beta, None)
    o1, s1 = gd.delta_rule_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], None)
    o2, s2 = gd.delta_rule_chunked(q[37:87], k[37:87], v[37:87], g[37:87], beta[37:87], s1)
    states = torch.stack([s2, state])  # row 1 is someone else's state
    other = state.clone()
    outs = []
    for t in range(87, 90):
        pick = [t, 0]
        o = gd.delta_rule_decode(q[pick], k[pick], v[pick], g[pick], beta[pick], states)
        outs.append(o[0])
        _, other = gd.delta_rule_reference(q[:1], k[:1], v[:1], g[:1], beta[:1], other)
    torch.testing.assert_close(torch.cat([o1, o2, torch.stack(outs)]), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], ref_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[1], other, atol=1e-5, rtol=1e-5)


def test_conv1d_in_pieces_matches_one_pass():
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(20, 6, generator=g), torch.randn(6, 4, generator=g)
    whole, _ = gd.conv1d_prefill(x, weight, None)
    # the same as a zero-padded causal conv, by hand
    padded = torch.cat([torch.zeros(3, 6), x])
    by_hand = torch.nn.functional.silu(torch.stack(
        [(padded[t:t + 4].t() * weight).sum(-1) for t in range(20)]))
    torch.testing.assert_close(whole, by_hand)
    first, window = gd.conv1d_prefill(x[:11], weight, None)
    second, window = gd.conv1d_prefill(x[11:18], weight, window)
    windows = window.unsqueeze(0).clone()
    steps = [gd.conv1d_decode(x[t:t + 1], weight, windows)[0] for t in (18, 19)]
    torch.testing.assert_close(torch.cat([first, second, torch.stack(steps)]), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_prefills_in_one_conv_match_their_convs_one_by_one(dtype):
    """A step's prefills share one convolution (their windows laid between them): each
    sequence's outputs and new window are what its own conv gives, including sequences
    shorter than the window (whose new window keeps part of the old one)."""
    g = torch.Generator().manual_seed(6)
    lengths, c, k = [1, 2, 7, 70], 10, 4
    x = torch.randn(sum(lengths), c, generator=g).to(dtype)
    weight = torch.randn(c, k, generator=g).to(dtype)
    windows = torch.randn(len(lengths), c, k - 1, generator=g).to(dtype)
    got, after = gd.conv1d_prefill_varlen(x, weight, windows, lengths)
    at = 0
    for i, n in enumerate(lengths):
        want, window = gd.conv1d_prefill(x[at:at + n], weight, windows[i])
        torch.testing.assert_close(got[at:at + n], want, rtol=1e-6, atol=1e-6)
        assert torch.equal(after[i], window)  # copies: exact
        at += n
    assert got.shape == x.shape and got.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_over_slots_is_the_gathered_decode_bit_for_bit(dtype):
    """The decode step's conv reading and writing windows in their slots gives what the
    gathered form (the one verification rows replay) gives, and touches no other slot."""
    g = torch.Generator().manual_seed(4)
    x, weight = (torch.randn(3, 6, generator=g).to(dtype),
                 torch.randn(6, 4, generator=g).to(dtype))
    pool = torch.randn(5, 6, 3, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2])
    gathered = pool[slots].clone()
    want = gd.conv1d_decode(x, weight, gathered)
    got_pool = pool.clone()
    got = gd.conv1d_decode_slots(x, weight, got_pool, slots)
    assert torch.equal(got, want) and torch.equal(got_pool[slots], gathered)
    assert torch.equal(got_pool[[1, 3]], pool[[1, 3]])


@pytest.mark.skipif(not fla.fla_available(torch.device("cuda"), torch.bfloat16),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
def test_fla_kernel_matches_reference_in_bf16():
    q, k, v, g, beta, state = (x.cuda() for x in inputs(150, h=4, dk=64, dv=64, seed=3))
    ref_o, ref_s = gd.delta_rule_reference(q, k, v, g, beta, state)
    o, s = fla.fla_chunked(q, k, v, g, beta, state, torch.bfloat16)
    torch.testing.assert_close(o, ref_o, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s, ref_s, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not fla.fla_available(torch.device("cuda"), torch.bfloat16),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
def test_fla_chunked_takes_grouped_key_heads():
    """Two key heads, each serving two consecutive value heads (Qwen3.5's grouping): fla's
    chunked kernel given them grouped computes what the reference does with them repeated."""
    q, k, v, g, beta, state = (x.cuda() for x in inputs(150, h=4, dk=64, dv=64, seed=5))
    qg, kg = q[:, ::2].contiguous(), k[:, ::2].contiguous()  # key head j serves 2j, 2j + 1
    ref_o, ref_s = gd.delta_rule_reference(qg.repeat_interleave(2, 1),
                                           kg.repeat_interleave(2, 1), v, g, beta, state)
    o, s = fla.fla_chunked(qg, kg, v, g, beta, state, torch.bfloat16)
    torch.testing.assert_close(o, ref_o, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s, ref_s, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(fla_norm._fla_norm_gated is None or not torch.cuda.is_available(),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
def test_fla_gated_norm_matches_the_torch_form():
    """fla's one-kernel gated RMSNorm against the torch form the models round like."""
    gen = torch.Generator().manual_seed(4)
    o = torch.randn(5, 6, 64, generator=gen) * 3
    z = torch.randn(5, 6 * 64, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    want = fla_norm.gated_rms_norm(o, z, w, 1e-6, torch.bfloat16)  # on CPU: the torch form
    got = fla_norm.gated_rms_norm(o.cuda(), z.cuda(), w.cuda(), 1e-6, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == o.shape
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=3e-2, rtol=3e-2)


# ---- speculative verification rows: token by token, and the state after any prefix -------


def batch(b: int, t: int, seed: int):
    """b rows of t tokens each ([B, T, ...]) and b start states."""
    rows = [inputs(t, seed=seed + i) for i in range(b)]
    return [torch.stack([r[j] for r in rows]) for j in range(6)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_steps_are_decode_steps_bit_for_bit(state_dtype):
    q, k, v, g, beta, s0 = batch(3, 5, seed=10)
    s0 = s0.to(state_dtype)
    states = s0.float().clone()  # .float() of fp32 is the same tensor: the kernel writes it
    o = gd.delta_rule_steps(q, k, v, g, beta, states, state_dtype)
    stored, outs = s0.clone(), []  # as the layer decodes: read, step in fp32, store rounded
    for t in range(5):
        work = stored.float().clone()
        outs.append(gd.delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], work))
        stored = work.to(state_dtype)
    assert torch.equal(o, torch.stack(outs, 1))
    assert torch.equal(states.to(state_dtype), stored)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_after_a_prefix_is_decoding_only_that_prefix(state_dtype):
    # Rows of a verification step where 1, 3, 5 and 2 positions stood (5 = all accepted).
    q, k, v, g, beta, s0 = batch(4, 5, seed=20)
    s0 = s0.to(state_dtype)
    kept = torch.tensor([1, 3, 5, 2])
    states = s0.float().clone()
    gd.delta_rule_advance(k, v, g, beta, states, kept, state_dtype)
    for b, n in enumerate(kept.tolist()):
        only = s0[b:b + 1].float().clone()
        gd.delta_rule_steps(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], g[b:b + 1, :n],
                            beta[b:b + 1, :n], only, state_dtype)
        assert torch.equal(states[b].to(state_dtype), only[0].to(state_dtype)), b
    ref_o, ref_s = gd.delta_rule_reference(q[1, :3], k[1, :3], v[1, :3], g[1, :3],
                                           beta[1, :3], s0[1])
    tol = 1e-5 if state_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(states[1], ref_s, atol=tol, rtol=tol)


def test_conv_window_after_a_prefix_is_decoding_only_that_prefix():
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(3, 5, 6, generator=g), torch.randn(6, 4, generator=g)
    w0 = torch.randn(3, 6, 3, generator=g)
    windows = w0.clone()
    out = gd.conv1d_steps(x, weight, windows)
    kept = torch.tensor([1, 4, 5])
    after = gd.conv1d_window_after(w0, x, kept)
    for b, n in enumerate(kept.tolist()):
        only = w0[b:b + 1].clone()
        steps = [gd.conv1d_decode(x[b:b + 1, t], weight, only) for t in range(n)]
        assert torch.equal(after[b], only[0])
        # one conv over the row against n one-token convs: equal up to the CPU's summation order
        torch.testing.assert_close(out[b, :n], torch.cat(steps))
    assert torch.equal(windows[2], after[2])  # all 5 kept: where the steps left it
