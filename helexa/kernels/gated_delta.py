"""Gated DeltaNet linear attention: the causal conv1d and the gated delta rule.

A linear-attention layer keeps, per request, two fixed-size states instead of
a KV cache that grows with tokens:

- the conv window: the last ``K - 1`` inputs of its depthwise causal conv1d,
  [channels, K - 1];
- the recurrent state S: [v_heads, k_dim, v_dim], updated per token t as
  ``S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t``.

Three forms of the rule live here: ``delta_rule_reference`` (token by token,
obviously right, the one every other form is tested against),
``delta_rule_chunked`` (prefill: the chunked WY form, matmuls over chunks of
64 tokens and a short loop carrying the state between chunks) and
``delta_rule_decode`` (one token for a batch of requests). ``delta_rule_steps``
runs a few tokens per row as that many decode steps would (a speculative
verification row), and ``delta_rule_advance`` / ``conv1d_window_after`` give the
state after only the first few of them: the rollback of rejected drafts
(docs/speculation.md), and ``conv1d_steps_unfolded`` a verification row's conv in one
pass. On CUDA, flash-linear-attention's kernels run these steps where installed
(helexa/kernels/fla_gdn.py: prefill, decode, verification and its settling;
helexa/kernels/fla_norm.py: the gated norm), import-guarded: CPU never needs them.

FlashInfer's Gated DeltaNet decode goes further for a step of decode rows alone
(helexa/kernels/flashinfer_gdn.py): it reads and writes each row's state in its slot.

q and k arrive L2-normalised (``l2norm``) and q is scaled by the caller's
``scale``; everything is computed in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64

class GateInputs(NamedTuple):
    """A decode step's gate inputs as the layer's projection gives them: a, b [N, v_heads]
    (raw), and the layer's A_log, dt_bias [v_heads]. :func:`gates` turns them into the
    rule's g and beta; fla's fused decode takes them raw and does the same in its kernel."""

    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def gates(raw: GateInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [N, v_heads] fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -raw.A_log.float().exp() * F.softplus(raw.a.float() + raw.dt_bias.float())
    return g, raw.b.float().sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as the reference models compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------- conv1d


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's new tokens (the reference the
    state backend's conv1d_prefill_varlen is tested against).

    x [T, C]; weight [C, K]; window [C, K - 1] (the previous inputs, None = zeros).
    Returns (out [T, C], the new window [C, K - 1]).
    """
    t, c = x.shape
    k = weight.shape[1]
    if window is None:
        window = x.new_zeros(c, k - 1)
    seq = torch.cat([window.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=c)[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), seq[:, -(k - 1):]


def conv1d_prefill_varlen(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                          lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """conv1d_prefill over several sequences in one conv: x [sum(lengths), C], the
    sequences' tokens back to back; windows [P, C, K - 1], sequence i's previous inputs.
    Each sequence is laid out as [window | tokens] one after another and a single
    convolution runs over the whole row; the outputs that straddle two sequences are
    dropped. Returns (out [sum(lengths), C], the new windows [P, C, K - 1]): the same
    products and sums as conv1d_prefill's, sequence by sequence."""
    c, k = weight.shape
    pieces: list[torch.Tensor] = []
    at, offsets = 0, []  # each sequence's first token in x; its window's first column in seq
    for i, n in enumerate(lengths):
        pieces += [windows[i].to(x.dtype), x[at:at + n].t()]
        offsets.append(at + i * (k - 1))
        at += n
    seq = torch.cat(pieces, dim=1)  # [C, sum(lengths) + P (K - 1)]
    out = F.silu(F.conv1d(seq.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=c)[0])
    # sequence i's outputs start where its window does; its new window ends its segment
    kept = torch.cat([out[:, o:o + n] for o, n in zip(offsets, lengths, strict=True)], dim=1)
    after = torch.stack([seq[:, o + n:o + n + k - 1] for o, n in zip(offsets, lengths,
                                                                       strict=True)])
    return kept.t().to(x.dtype), after


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """One new token per row: x [B, C], windows [B, C, K - 1] (updated in place) -> [B, C]."""
    seq = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    windows.copy_(seq[..., 1:])
    return F.silu((seq * weight).sum(-1))


def conv1d_decode_slots(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """conv1d_decode over windows kept in slots: x [B, C]; pool [slots, C, K - 1], row b's
    window at ``slots[b]`` (read, then written back in place); -> [B, C]. The same sums as
    conv1d_decode, bit for bit, in six kernels where gathering the windows, updating the
    copy and scattering it back took eight."""
    seq = torch.cat([pool.index_select(0, slots).to(x.dtype), x.unsqueeze(-1)], dim=-1)
    pool.index_copy_(0, slots, seq[..., 1:].to(pool.dtype))
    return F.silu((seq * weight).sum(-1))


def conv1d_steps(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """T new tokens per row, one at a time as conv1d_decode takes them (so bit for bit what
    T decode steps give): x [B, T, C], windows [B, C, K - 1] (updated in place) -> [B, T, C]."""
    return torch.stack([conv1d_decode(x[:, t], weight, windows) for t in range(x.shape[1])], 1)


def conv1d_steps_unfolded(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor
                          ) -> torch.Tensor:
    """conv1d_steps' outputs in a few kernels for any T (windows read, not written): the T
    windows of [window | x] unfolded and each summed against the weight. The same
    products, summed in another order than conv1d_decode's, so equal to rounding, not bit
    for bit: the form for the fla path, whose decode runs other kernels anyway.
    x [B, T, C], windows [B, C, K - 1] -> [B, T, C]."""
    seq = torch.cat([windows.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
    taps = seq.unfold(-1, weight.shape[1], 1)  # [B, C, T, K]
    return F.silu((taps * weight[:, None, :]).sum(-1)).transpose(1, 2)


def conv1d_window_after(windows: torch.Tensor, x: torch.Tensor, kept: torch.Tensor
                        ) -> torch.Tensor:
    """The window after the first kept[b] of row b's tokens: the last K - 1 of [window | x]
    (copies only, so exact). windows [B, C, K - 1]; x [B, T, C]; kept [B] >= 0 -> [B, C, K - 1]."""
    seq = torch.cat([windows.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
    width = windows.shape[-1]
    at = kept.view(-1, 1, 1) + torch.arange(width, device=x.device)  # [B, 1, K - 1]
    return seq.gather(-1, at.expand(-1, seq.shape[1], -1))


# ------------------------------------------------------------- delta rule


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H]; state [H, dk, dv].
    Returns (o [T, H, dv], final state), fp32."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = (state.float().clone() if state is not None
         else q.new_zeros(q.shape[1], q.shape[2], v.shape[2]))
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor | None, chunk: int = CHUNK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as delta_rule_reference, a chunk of tokens at a time.

    Within a chunk, with G_i the running sum of g up to token i, the WY form gives
    every token's correction to the state at the chunk's start by one unit-lower
    triangular solve, (I + A) [u | w] = [beta v | beta k e^G], A_ij = beta_i k_i.k_j
    e^(G_i - G_j) for j < i; then v' = u - w S, o = (q e^G) S + (q k^T * decay) v'
    and S <- e^(G_last) S + (k e^(G_last - G))^T v'. Only the state crosses chunks.
    """
    n, h, dk = q.shape
    dv = v.shape[2]
    # A short prefill chunk would be mostly padding at 64: the next power of two does.
    chunk = min(chunk, 1 << max(n - 1, 1).bit_length())
    pad = (-n) % chunk
    # [H, chunks, C, d] in fp32; padded tokens have g = beta = 0: they change nothing.
    def split(x: torch.Tensor) -> torch.Tensor:  # [T, H, d] -> [H, chunks, C, d]
        return F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(h, -1, chunk,
                                                                              x.shape[2])

    qc, kc, vc = split(q), split(k), split(v)
    gc = F.pad(g.float(), (0, 0, 0, pad)).t().reshape(h, -1, chunk)
    bc = F.pad(beta.float(), (0, 0, 0, pad)).t().reshape(h, -1, chunk)
    cum = gc.cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc[..., None]
    system = (kb @ kc.transpose(-1, -2)) * decay  # diagonal ignored: unit triangular
    rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], dim=-1)
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :dv], uw[..., dv:]
    attn = (qc @ kc.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = qc * cum.exp()[..., None]
    k_decayed = kc * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()  # [H, N]
    s = (state.float().clone() if state is not None else q.new_zeros(h, dk, dv, dtype=torch.float32))
    out = torch.empty(h, qc.shape[1], chunk, dv, dtype=torch.float32, device=q.device)
    for i in range(qc.shape[1]):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * last[:, i, None, None] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, dv)[:, :n].transpose(0, 1), s


def delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """One token for each of B rows: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H];
    states [B, H, dk, dv] fp32, updated in place. Returns o [B, H, dv]."""
    _delta_update(k, v, g, beta, states)
    return torch.einsum("bhkv,bhk->bhv", states, q.float())


def _delta_update(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  states: torch.Tensor) -> None:
    """The state's half of a decode step (every form that must agree bit for bit uses it)."""
    states.mul_(g.float().exp()[..., None, None])
    kf = k.float()
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", states, kf)) * beta.float()[..., None]
    states.add_(kf[..., :, None] * delta[..., None, :])


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, state_dtype: torch.dtype
                     ) -> torch.Tensor:
    """T tokens for each of B rows, one at a time as T decode steps take them: q, k
    [B, T, H, dk]; v [B, T, H, dv]; g, beta [B, T, H]; states [B, H, dk, dv] fp32, updated
    in place. Between tokens the state is rounded to `state_dtype`, as a decode step stores
    it, so outputs and states are bit for bit those of T decode steps. Returns o [B, T, H, dv].
    (A speculative verification row: a few tokens, whose state may be rolled back.)"""
    out = []
    for t in range(q.shape[1]):
        out.append(delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states))
        if state_dtype != torch.float32:
            states.copy_(states.to(state_dtype))
    return torch.stack(out, 1)


def delta_rule_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, kept: torch.Tensor, state_dtype: torch.dtype
                       ) -> None:
    """states after only the first kept[b] of row b's tokens, bit for bit what that many decode
    steps (delta_rule_steps) leave: inputs as delta_rule_steps', kept [B]. A token past kept[b]
    runs with g = beta = 0, which leaves a state exactly as it was (x 1, + 0)."""
    mask = torch.arange(k.shape[1], device=k.device)[None, :] < kept[:, None]  # [B, T]
    g, beta = g.float() * mask[..., None], beta.float() * mask[..., None]
    for t in range(k.shape[1]):
        _delta_update(k[:, t], v[:, t], g[:, t], beta[:, t], states)
        if state_dtype != torch.float32:
            states.copy_(states.to(state_dtype))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| (Frobenius, in fp32): how far a kernel's probe step is off."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
