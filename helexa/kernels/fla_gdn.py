"""flash-linear-attention's (``fla-core``) Gated DeltaNet kernels, where installed (CUDA
only, import-guarded: CPU never needs them), each the fla form of a torch form in
helexa/kernels/gated_delta.py that it is tested against:

- ``fla_chunked``: prefill on fla's chunked Triton kernel (16-bit models), for
  delta_rule_chunked; ``fla_chunked_varlen`` a step's prefills in one launch (fla's
  ``cu_seqlens``);
- ``fla_decode``: a decode step on its fused recurrent kernel (decay, delta update and
  output in one launch per layer), for delta_rule_decode; ``fla_decode_gated`` the same for
  a step of decode rows alone with the L2 norms and the gates inside the kernel too;
- ``fla_steps`` / ``fla_advance``: a step's speculative verification rows, and their
  settling at the next step, one launch each, for delta_rule_steps / delta_rule_advance;

fla's kernels take grouped heads (value head h reads key head h // (v_heads / k_heads),
the grouping the torch forms get from ``repeat_interleave``): the recurrent one for
years, the chunked one from fla-core 0.5 (its "GVA"), so prefill, decode and
verification all pass q and k as they are (a layer's output norm: helexa/kernels/
fla_norm.py). Each kernel is run once at load against its torch form (the
``probe_fla_*``), and one that fails or disagrees is left off with the reason logged, so
it never fails a request's step. The release the ``.[cuda]`` extra
pins is run here in the tests too, on CPU (tests/kernels/test_fla_real.py). The state
backend (helexa/kernels/backends/gdn.py) chooses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from itertools import accumulate

import torch

from helexa.kernels.gated_delta import (
    GateInputs,
    delta_rule_advance,
    delta_rule_chunked,
    delta_rule_decode,
    delta_rule_steps,
    gates,
    l2norm,
    rel_error,
)

try:  # optional GPU kernels (pip install -e '.[cuda]'); never needed on CPU
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _fla_chunk = _fla_recurrent = None
# What the chunked kernel takes beside cu_seqlens, so that it need not read the offsets
# back: its chunks' (sequence, chunk) pairs (fla-core after 0.5.2), else the offsets on
# the host (0.5), from which it still copies the pairs to the device (one wait a step, as
# long as every layer is handed the same tensor: fla caches the pairs by identity)
_FLA_PARAMS = inspect.signature(_fla_chunk).parameters if _fla_chunk is not None else {}
_TAKES_CHUNK_INDICES = "chunk_indices" in _FLA_PARAMS
_TAKES_CU_CPU = "cu_seqlens_cpu" in _FLA_PARAMS
FLA_CHUNK = 64  # the chunked kernel's chunk (chunk_gated_delta_rule's default)


def fla_gated_available() -> bool:
    """fla's recurrent kernel takes the norms and gates itself (fla-core 0.6 and newer)."""
    if _fla_recurrent is None:
        return False
    try:
        params = inspect.signature(_fla_recurrent).parameters
    except (TypeError, ValueError):
        return False
    return all(p in params for p in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                     "use_beta_sigmoid_in_kernel", "A_log", "dt_bias"))


def fla_available(device: torch.device, dtype: torch.dtype) -> bool:
    """flash-linear-attention's Triton kernels apply: CUDA, the package installed, and a
    16-bit model (its chunked kernel refuses fp32 inputs)."""
    return _fla_chunk is not None and device.type == "cuda" and dtype != torch.float32


def fla_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_chunked on fla's kernel (CUDA only; q already normalised and scaled),
    with grouped heads: q, k [T, key_heads, dk]; v [T, v_heads, dv]; g, beta [T, v_heads];
    its inputs in the model's 16-bit `dtype`, the decays and the state in fp32."""
    assert _fla_chunk is not None
    o, s = _fla_chunk(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype),
                      g[None].float(), beta[None].to(dtype), scale=1.0,
                      initial_state=None if state is None else state[None].float(),
                      output_final_state=True)
    return o[0].float(), s[0]


def varlen_layout(lengths: list[int]) -> tuple[list[int], list[int]]:
    """For sequences of these lengths back to back: cu_seqlens (0, then the running sums)
    and fla's chunk indices, each FLA_CHUNK-token chunk's (sequence, chunk) flattened."""
    chunks = [x for i, n in enumerate(lengths) for j in range(-(-n // FLA_CHUNK))
              for x in (i, j)]
    return [0, *accumulate(lengths)], chunks


def fla_chunked_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor,
                       cu_host: torch.Tensor, chunks: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla_chunked over several sequences in one launch of each of fla's kernels: their
    tokens back to back (q, k [T, key_heads, dk]; v [T, v_heads, dv]; g, beta [T, v_heads]),
    states [P, v_heads, dk, dv] each one's state before its tokens; varlen_layout's
    cu_seqlens [P + 1] int64 on the device and ``cu_host`` on the host, and its chunk
    indices ``chunks`` [chunks, 2] int64 on the device. fla takes the chunk indices where it
    can (no wait), else the host offsets (one wait on the first layer, fla's cache after:
    the same tensors every layer of a step), else reads the offsets back itself (a wait a
    layer). Returns (o [T, v_heads, dv] fp32, finals [P, ...] fp32)."""
    assert _fla_chunk is not None
    extra: dict[str, torch.Tensor] = {}
    if _TAKES_CHUNK_INDICES:
        extra["chunk_indices"] = chunks
    elif _TAKES_CU_CPU:
        extra["cu_seqlens_cpu"] = cu_host
    o, s = _fla_chunk(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype),
                      g[None].float(), beta[None].to(dtype), scale=1.0,
                      initial_state=states.float(), output_final_state=True,
                      cu_seqlens=cu_seqlens, **extra)
    return o[0].float(), s


def fla_decode_available(device: torch.device) -> bool:
    """fla's fused recurrent kernel applies: CUDA and the package installed (it takes fp32
    inputs as well as 16-bit ones)."""
    return _fla_recurrent is not None and device.type == "cuda"


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, states: torch.Tensor, dtype: torch.dtype, final: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's fused recurrent kernel over [B, T, ...] inputs with the torch forms' g and beta
    (q already normalised and scaled): q, k, v and beta in the model's `dtype`, the decays
    and the state in fp32. (o, the final state where `final`, else None)."""
    assert _fla_recurrent is not None
    # keywords only: fla's releases differ in the optional decays between g and beta
    o, last = _fla_recurrent(q=q.to(dtype).contiguous(), k=k.to(dtype).contiguous(),
                             v=v.to(dtype).contiguous(), g=g.float().contiguous(),
                             beta=beta.to(dtype).contiguous(), scale=1.0,
                             initial_state=states.contiguous(), output_final_state=final)
    return o, last


def fla_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta_rule_decode on fla's fused recurrent kernel (CUDA only), with grouped heads:
    q, k [B, key_heads, dk] (q already normalised and scaled); v [B, v_heads, dv]; g, beta
    [B, v_heads]; states [B, v_heads, dk, dv] fp32, updated in place. Returns o [B, v_heads,
    dv] fp32. Inputs in the model's `dtype`, the decays and the state in fp32."""
    o, final = _recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                          states, dtype, final=True)
    assert final is not None
    states.copy_(final)
    return o[:, 0].float()


def fla_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta_rule_steps' outputs on fla's fused recurrent kernel (CUDA only): every row's T
    tokens in one launch, grouped heads as fla_decode takes them. q, k [B, T, key_heads, dk]
    (q normalised and scaled); v [B, T, v_heads, dv]; g, beta [B, T, v_heads]; states
    [B, v_heads, dk, dv] fp32, read, not written (a verification row is held, not kept).
    Returns o [B, T, v_heads, dv] fp32. The kernel carries the state between a row's tokens
    in fp32 where T decode steps round it to the model's dtype: the outputs agree with
    theirs to that rounding (fla_advance carries it the same way)."""
    return _recurrent(q, k, v, g, beta, states, dtype, final=False)[0].float()


def fla_advance(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                states: torch.Tensor, kept: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta_rule_advance on fla's kernel, one launch (CUDA only): the states after only the
    first kept[b] of row b's tokens, a token past kept[b] run with g = beta = 0 (x 1, + 0:
    the state exactly as it was). Inputs as fla_steps' (k grouped), kept [B]; states read,
    not written. Returns the new states [B, v_heads, dk, dv] fp32 (the outputs, q = k,
    unused)."""
    mask = (torch.arange(k.shape[1], device=k.device)[None, :] < kept[:, None])[..., None]
    _, final = _recurrent(k, k, v, g.float() * mask, beta.float() * mask, states, dtype,
                          final=True)
    assert final is not None
    return final


def fla_decode_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw: GateInputs,
                     states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole pure-decode step on fla's fused recurrent kernel, its inputs as the conv gives
    them (CUDA only): q, k [B, key_heads, dk] not yet normalised, v [B, v_heads, dv], the
    gates raw; the kernel takes the L2 norms, q's k_dim^-0.5 scale, g and beta (:func:`gates`'
    formulas, fp32) itself, so none of the ~25 small kernels those are in torch run. states
    [B, v_heads, dk, dv] are read, not written. Returns (o [B, v_heads, dv] fp32, the new
    states fp32)."""
    assert _fla_recurrent is not None
    o, final = _fla_recurrent(q=q[:, None], k=k[:, None], v=v[:, None], g=raw.a[:, None],
                              beta=raw.b[:, None], scale=q.shape[-1] ** -0.5,
                              initial_state=states, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              A_log=raw.A_log, dt_bias=raw.dt_bias,
                              use_beta_sigmoid_in_kernel=True)
    return o[:, 0].float(), final


def probe_fla_gated(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                    value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run fla's gated decode (fla_decode_gated) once on a small random step at a layer's
    sizes (so the kernel's build is the one serving uses) against the torch forms: "" when
    it agrees, else why not (the gates then run in torch)."""
    gen = torch.Generator().manual_seed(0)
    kh, vh, dk, dv = key_heads, value_heads, key_dim, value_dim
    q, k = (torch.randn(1, kh, dk, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(1, vh, dv, generator=gen).to(dtype)
    raw = GateInputs(*(torch.randn(*shape, generator=gen).to(dtype)
                       for shape in ((1, vh), (1, vh), (vh,), (vh,))))
    states = torch.randn(1, vh, dk, dv, generator=gen)
    g, beta = gates(raw)
    want_states = states.clone()
    want = delta_rule_decode((l2norm(q.float()) * dk ** -0.5).repeat_interleave(vh // kh, 1),
                             l2norm(k.float()).repeat_interleave(vh // kh, 1), v, g, beta,
                             want_states)

    def run() -> float:
        dev = GateInputs(*(x.to(device) for x in raw))
        got, final = fla_decode_gated(q.to(device), k.to(device), v.to(device), dev,
                                      states.to(device))
        return max(rel_error(got.cpu(), want), rel_error(final.cpu(), want_states))

    return _agrees("gated decode", run, tol)


def _random_rows(lead: tuple[int, ...], kh: int, vh: int, dk: int, dv: int,
                 dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """A probe's seeded inputs of ``lead`` rows at a layer's sizes: q (normalised, scaled),
    k (normalised), v in ``dtype``, log decays g <= 0, beta; and then a state per leading
    row but the last (``lead[:-1]``, or one state for a single sequence)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(*lead, kh, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(*lead, kh, dk, generator=gen))
    v = torch.randn(*lead, vh, dv, generator=gen).to(dtype)
    g, beta = -torch.rand(*lead, vh, generator=gen), torch.rand(*lead, vh, generator=gen)
    return q, k, v, g, beta, torch.randn(*lead[:-1], vh, dk, dv, generator=gen)


def _agrees(what: str, run: Callable[[], float], tol: float) -> str:
    """"" when ``run`` (a kernel against its torch form: the relative error) is within
    ``tol``; else why not, a failure of the kernel included (the torch form then runs, so
    a kernel that fails here never fails a request's step)."""
    try:
        err = run()
    except Exception as e:  # noqa: BLE001 - any failure: the torch form runs, said why
        return f"fla's {what} failed ({type(e).__name__}: {e})"
    return "" if err < tol else f"fla's {what} is off by {err:.2g} (relative)"


def probe_fla_chunked(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                      value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run fla_chunked once on a prefill of 70 tokens (past one 64-token chunk) from a
    state, the key heads grouped, at a layer's sizes, against delta_rule_chunked with them
    repeated: "" when they agree, else why not (prefill then runs the torch form: an fla
    older than 0.5 takes no grouped heads in this kernel and fails here, not in a step)."""
    kh, vh = key_heads, value_heads
    q, k, v, g, beta, state = _random_rows((70,), kh, vh, key_dim, value_dim, dtype, 2)
    want, want_state = delta_rule_chunked(q.repeat_interleave(vh // kh, 1),
                                          k.repeat_interleave(vh // kh, 1), v, g, beta, state)

    def run() -> float:
        got, final = fla_chunked(*(x.to(device) for x in (q, k, v, g, beta, state)), dtype)
        return max(rel_error(got.cpu(), want), rel_error(final.cpu(), want_state))

    return _agrees("chunked prefill kernel", run, tol)


def probe_fla_varlen(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                     value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run fla_chunked_varlen once on three prefills back to back (5, 70 and 1 tokens: short,
    past one chunk, a single token), each from its own state, against delta_rule_chunked
    run sequence by sequence: "" when they agree, else why not (a step's prefills then run
    one fla launch each)."""
    kh, vh, lengths = key_heads, value_heads, [5, 70, 1]
    q, k, v, g, beta, _ = _random_rows((sum(lengths),), kh, vh, key_dim, value_dim, dtype, 4)
    states = _random_rows((len(lengths), 1), kh, vh, key_dim, value_dim, dtype, 5)[5]
    qr, kr = q.repeat_interleave(vh // kh, 1), k.repeat_interleave(vh // kh, 1)
    outs, finals, at = [], [], 0
    for i, n in enumerate(lengths):
        o, s = delta_rule_chunked(qr[at:at + n], kr[at:at + n], v[at:at + n], g[at:at + n],
                                  beta[at:at + n], states[i])
        outs.append(o)
        finals.append(s)
        at += n
    want, want_states = torch.cat(outs), torch.stack(finals)

    def run() -> float:
        cu, chunks = varlen_layout(lengths)
        got, final = fla_chunked_varlen(*(x.to(device) for x in (q, k, v, g, beta, states)),
                                        torch.tensor(cu, device=device), torch.tensor(cu),
                                        torch.tensor(chunks, device=device).view(-1, 2),
                                        dtype)
        return max(rel_error(got.cpu(), want), rel_error(final.cpu(), want_states))

    return _agrees("chunked prefill kernel over several sequences", run, tol)


def probe_fla_decode(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                     value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run fla_decode once on two decode rows at a layer's sizes against delta_rule_decode:
    "" when they agree, else why not (decode then runs the torch step)."""
    kh, vh = key_heads, value_heads
    rows = _random_rows((2, 1), kh, vh, key_dim, value_dim, dtype, 3)  # two rows of one token
    q, k, v, g, beta = (x[:, 0] for x in rows[:5])
    states = rows[5]
    want_states = states.clone()
    want = delta_rule_decode(q.repeat_interleave(vh // kh, 1), k.repeat_interleave(vh // kh, 1),
                             v, g, beta, want_states)

    def run() -> float:
        dev_states = states.to(device)
        got = fla_decode(*(x.to(device) for x in (q, k, v, g, beta)), dev_states, dtype)
        return max(rel_error(got.cpu(), want), rel_error(dev_states.cpu(), want_states))

    return _agrees("decode kernel", run, tol)


def probe_fla_steps(device: torch.device, key_heads: int, value_heads: int, key_dim: int,
                    value_dim: int, dtype: torch.dtype, tol: float = 2e-2) -> str:
    """Run fla_steps and fla_advance once on two small verification rows at a layer's sizes
    (rows of 3 tokens; 1 and 3 of them kept) against the torch forms, delta_rule_steps and
    delta_rule_advance: "" when both agree, else why not (verification rows then run the
    torch forms, so a kernel that fails here never fails a request's step)."""
    kh, vh = key_heads, value_heads
    q, k, v, g, beta, states = _random_rows((2, 3), kh, vh, key_dim, value_dim, dtype, 1)
    kept = torch.tensor([1, 3])
    qr, kr = q.repeat_interleave(vh // kh, 2), k.repeat_interleave(vh // kh, 2)
    want = delta_rule_steps(qr, kr, v, g, beta, states.clone(), torch.float32)
    want_states = states.clone()
    delta_rule_advance(kr, v, g, beta, want_states, kept, torch.float32)

    def run() -> float:
        dev = [x.to(device) for x in (q, k, v, g, beta, states, kept)]
        got = fla_steps(*dev[:6], dtype)
        final = fla_advance(dev[1], dev[2], dev[3], dev[4], dev[5], dev[6], dtype)
        return max(rel_error(got.cpu(), want), rel_error(final.cpu(), want_states))

    return _agrees("verification kernel", run, tol)
