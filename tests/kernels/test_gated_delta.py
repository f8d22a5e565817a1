"""The gated delta rule's fast forms (chunked prefill, batched decode) and the causal
conv1d agree with the token-by-token reference, across chunk and call boundaries."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.skipif(not gd.fla_available(torch.device("cuda"), torch.bfloat16),
                    reason="needs CUDA and fla-core (pip install -e '.[cuda]')")
def test_fla_kernel_matches_reference_in_bf16():
    q, k, v, g, beta, state = (x.cuda() for x in inputs(150, h=4, dk=64, dv=64, seed=3))
    ref_o, ref_s = gd.delta_rule_reference(q, k, v, g, beta, state)
    o, s = gd.fla_chunked(q, k, v, g, beta, state, torch.bfloat16)
    torch.testing.assert_close(o, ref_o, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s, ref_s, atol=3e-2, rtol=3e-2)
