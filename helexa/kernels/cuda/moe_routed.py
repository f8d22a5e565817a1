"""A mixture-of-experts step's expert products on CUDA, each read in place (Triton).

The gathered form of helexa/kernels/moe_experts.py, the one a decode step takes on CUDA,
copies each (token, slot) pair's expert out of the stacks (``index_select``: read and
written) and then runs one op per pair on the copy (read again): three times the chosen
experts' bytes and a few kernels a pair, 8 pairs a token for Qwen3.5's MoE. This kernel
(helexa/kernels/cuda/_moe_routed_triton.py) takes the pairs' expert ids and rows and reads
each pair's expert from the stack where it lies: one launch a stack for every pair, the
experts' bytes read once, no host sync (a CUDA graph captures it). It reads float stacks,
grouped int8 ones (GGUF Q8_0, Q6_K, Q5_K) and torch's CUDA int4 layout (GGUF Q4_K).

The kernel earns its place on each stack it serves: at load (QuantExperts.prepare) it runs
on two of the stack's own experts and is compared with the stack's op; one that fails or
disagrees leaves that stack to the gathered copies, the reason logged as
``kernels.cuda_moe_routed_fallback``. No Triton, or ``HELEXA_TRITON_MOE=0``: the copies.
The tests run the same kernel on CPU tensors through Triton's interpreter. The block
sizes and the split are read from the arithmetic, not measured: no GPU has run this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from helexa.kernels import cuda as cuda_kernels

BLOCK_N, BLOCK_K = 32, 128
PROGRAMS_PER_SM = 4  # K is split until the programs number this many per SM ...
MIN_SPAN_BLOCKS = 4  # ... while each keeps at least this many BLOCK_K steps
KINDS = {"float": 0, "int8": 1, "int4": 2}
_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# (device, kind, group, zeros, inner) -> "" or why the gathered copies serve (a stack of
# that kind that failed its probe: a later one agreeing does not clear it)
_verdicts = cuda_kernels.Verdicts(
    "kernels.cuda_moe_routed", "MoE experts: routed in place (Triton)",
    "MoE experts: gathered copies",
    lambda key: {"device": str(key[0]), "kind": key[1], "group": key[2]})


@dataclass(frozen=True)
class Stack:
    """One expert stack as the kernel reads it: ``kind`` float / int8 / int4, the weight
    (float or int8 [E, N, K]; int4 torch's packed [E, N / 8, K / (inner * 16), 32,
    inner / 2]), the scales (int8: [E, N, K / group]; int4: scales and zeros [E, K / group,
    N, 2]) and int8's zeros, and the outputs ``n`` and inputs ``k`` of one expert."""

    kind: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group: int = 1
    n: int = 0
    k: int = 0


def on_card(t: torch.Tensor) -> bool:
    """Where the kernel may serve a stack: a CUDA device (the CPU keeps its ops)."""
    return t.is_cuda


def unavailable() -> str:
    """"" where the kernel can be built; else why not."""
    return cuda_kernels.unavailable("HELEXA_TRITON_MOE", "_moe_routed_triton")


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k(n: int, k: int, pairs: int, sms: int) -> int:
    """How many spans K is cut into: enough programs for PROGRAMS_PER_SM on each of
    ``sms``, each span at least MIN_SPAN_BLOCKS steps of BLOCK_K."""
    blocks = -(-n // BLOCK_N) * pairs
    want = -(-PROGRAMS_PER_SM * sms // blocks)
    return max(1, min(want, k // (BLOCK_K * MIN_SPAN_BLOCKS)))


def run(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, stack: Stack,
        sms: int | None = None, interpret: bool = False) -> torch.Tensor:
    """For each pair j: x[rows[j]] @ W[experts[j]]^T, [pairs, n] in x's dtype (``rows``,
    ``experts``: int32 on x's device). ``interpret``: Triton's interpreter (CPU tensors)."""
    from helexa.kernels.cuda import _int8g_triton, _moe_routed_triton

    pairs = experts.shape[0]
    if pairs == 0:
        return x.new_zeros(0, stack.n)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w, s = stack.weight, stack.scales
    sms = sms or (_sms(x.device.index or 0) if x.is_cuda else 4)
    split = split_k(stack.n, stack.k, pairs, sms)
    span = -(-stack.k // (split * BLOCK_K)) * BLOCK_K
    split = -(-stack.k // span)  # no span left empty
    part = torch.empty(split, pairs, stack.n, dtype=torch.float32, device=x.device)
    kind = KINDS[stack.kind]
    inner = w.shape[-1] * 2 if kind == 2 else 1
    # int8 [E, N, K / G]: a row's scales; int4 [E, K / G, N, 2]: a group's pairs
    stride_se, stride_s = (s.stride(0), s.stride(1)) if s is not None else (0, 0)
    z = stack.zeros if stack.zeros is not None else s
    _moe_routed_triton.build(interpret)[(-(-stack.n // BLOCK_N), split, pairs)](
        x, rows, experts, w, w if s is None else s, w if z is None else z, part,
        pairs, stack.n, stack.k, span, x.stride(0), w.stride(0), stride_se, stride_s,
        KIND=kind, G=stack.group, GROUPING=_int8g_triton.grouping(stack.group, BLOCK_K),
        HAS_ZEROS=stack.zeros is not None, INNER=inner,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    out = part[0] if split == 1 else part.sum(0)
    return out.to(x.dtype)


def probe(x: torch.Tensor, stack: Stack, reference: torch.Tensor, experts: tuple[int, ...],
          interpret: bool = False) -> str:
    """Run the kernel on the pairs (row 0, expert e) for each of ``experts`` and compare
    with ``reference`` ([pairs, n]: the stack's own op on those experts): "" when within the
    dtype's tolerance, else why not (a failure of the kernel included). Outside any graph
    capture: it compiles the build every step on this stack then runs."""
    ids = torch.tensor(experts, dtype=torch.int32, device=x.device)
    rows = torch.zeros(len(experts), dtype=torch.int32, device=x.device)
    try:
        got = run(x, rows, ids, stack, interpret=interpret).float()
        cuda_kernels.settled(x.device)
    except Exception as e:  # noqa: BLE001 - any failure: the gathered copies serve, said why
        return f"the Triton routed expert product failed ({type(e).__name__}: {e})"
    want = reference.float()
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    tol = _TOL.get(x.dtype, 1e-2)
    if stack.kind == "int4":  # its reference, torch's CUDA op, rounds x and out to bf16
        tol = max(tol, _TOL[torch.bfloat16])
    return "" if err < tol else f"the Triton routed expert product is off by {err:.2g}"


def prove(x: torch.Tensor, stack: Stack, reference: torch.Tensor,
          experts: tuple[int, ...]) -> str:
    """``probe`` on one stack at load, its verdict kept for describe(): logged the first
    time a kind proves itself on a device (``kernels.cuda_moe_routed_chosen``), and each
    time a stack fails (``kernels.cuda_moe_routed_fallback``: that block's steps keep the
    gathered copies)."""
    why = probe(x, stack, reference, experts)
    _verdicts.record(_key(stack), why, outputs=stack.n, inputs=stack.k)
    return why


def _key(stack: Stack) -> tuple:
    inner = stack.weight.shape[-1] * 2 if stack.kind == "int4" else 0
    return (stack.weight.device, stack.kind, stack.group, stack.zeros is not None, inner)


def standing(stacks: dict[str, Stack]) -> dict[str, Stack]:
    """Proved ``stacks`` (prove_stacks'), {} where a kind of theirs was refused since: by
    another block's probe of the same kind, or by another rank's card (a tensor-parallel
    group refuses on every rank a kind one rank's card refused). The executor prunes with
    it once the verdicts are agreed (CudaGraphExecutor.agreed), not at every call, so a
    step's form (moe_experts.run_experts: the copies it counts) sees the stacks that run."""
    return stacks if stacks and all(not _verdicts.get(_key(s)) for s in stacks.values()) else {}


def prove_stacks(stacks: dict[str, Stack | None],
                 op: Callable[[str, int, torch.Tensor], torch.Tensor],
                 dtype: torch.dtype) -> dict[str, Stack]:
    """A MoE block's stacks on the kernel at load: each run on its first and last expert
    against ``op`` (the stack's own product: which, expert, x), activations of ``dtype``;
    ``stacks`` where all agree, {} where the kernel cannot be built, a stack is not on a
    card (or has no form the kernel reads: None), or one disagrees (prove says why)."""
    if unavailable() or not all(s is not None and on_card(s.weight) for s in stacks.values()):
        return {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for which, stack in stacks.items():
            assert stack is not None
            x = torch.randn(1, stack.k, generator=gen).to(stack.weight.device, dtype)
            last = stack.weight.shape[0] - 1
            if prove(x, stack, torch.cat([op(which, e, x) for e in (0, last)]), (0, last)):
                return {}
    return stacks  # type: ignore[return-value]


def describe(device: torch.device) -> str:
    """What serves a decode step's quantised MoE experts on ``device``, for the executor's
    describe() ("" before any stack was proved there)."""
    return _verdicts.describe(device, unavailable())


def experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: Stack,
            w2: Stack) -> torch.Tensor:
    """A MoE block's routed experts on the kernel, every (token, slot) pair's expert read
    in place: sum over k of weight * w2[e] @ (silu(gate) * up), [N, hidden], in two
    launches (w13: gate rows then up rows; w2) and no host sync."""
    n, k = chosen.shape
    ids = chosen.reshape(-1).to(torch.int32)  # pair j: token j // k's slot j % k
    pairs = torch.arange(n * k, dtype=torch.int32, device=x.device)
    gate, up = run(x, pairs // k, ids, w13).chunk(2, dim=-1)
    y = run(F.silu(gate) * up, pairs, ids, w2)
    return (y.view(n, k, -1) * weights[..., None]).sum(dim=1)


class FloatExperts:
    """A MoE block's float expert stacks (``w13`` [E, 2I, H], ``w2`` [E, H, I]) on the
    kernel, where the gathered form would copy each pair's expert matrices out first (3
    N k experts' bytes): ``prepare`` proves both at load against F.linear on the first and
    last expert; called, the products (None where they did not prove themselves)."""

    kind = "float"

    def __init__(self, mlp: Any) -> None:
        self.mlp = mlp
        self.stacks: dict[str, Stack] = {}

    def prepare(self, max_num_seqs: int) -> None:
        w13, w2 = self.mlp.w13, self.mlp.w2
        self.stacks = prove_stacks(
            {w: Stack("float", t, n=t.shape[1], k=t.shape[2]) for w, t in (("w13", w13),
                                                                         ("w2", w2))},
            lambda which, e, x: F.linear(x, getattr(self.mlp, which)[e]), w13.dtype)

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor | None:
        if not self.stacks:
            return None
        return experts(x, chosen, weights, self.stacks["w13"], self.stacks["w2"])

    def agreed(self) -> None:
        self.stacks = standing(self.stacks)
