"""A mixture-of-experts layer's expert products, in three forms, and the rule that picks one.

Every form takes the router's choice (chosen [N, k] expert ids, weights [N, k]) and the
stacked experts (w13 [E, 2I, H], gate rows then up rows; w2 [E, H, I]) and returns
sum over k of weight * w2[e] @ (silu(gate) * up), [N, H]:

- ``experts_looped``: one pass per expert that some token chose. It reads each chosen
  expert once and computes only routed rows, but how many rows each expert has (one
  count per expert, read back after a sort of the choices: ``routed``) waits for the
  device: a host sync per layer, which a CUDA graph cannot capture. The form for CPU and
  for prefill.
- ``experts_gathered``: each (token, slot)'s expert matrices gathered and multiplied in
  one batched matmul (SGLang's torch-native MoE, ``fused_moe_native.py``). No host sync;
  it copies N x k expert matrices (read, written, read again: 3 N k experts' bytes), so
  it is the form while 3 N k <= E.
- ``experts_masked``: every expert applied to every row and weighted by that row's
  routing weight for it (zero where not chosen, as vLLM's ``moe_torch_iterative.py``),
  in two batched matmuls over the stacked experts and one weighted sum: a handful of
  kernels a layer, whatever E. No host sync; it reads every expert once and computes
  E / k times the routed rows, memory-bound only while N is a decode batch.

Experts kept quantised (a GGUF's stacks, one op per expert) have the three forms too
(``run_quantised_experts``), chosen by the same rule, gathering while N k <= E (the
gathered form copies each (token, slot)'s packed expert out of the stacks by the chosen
ids on the device, a byte or less a value, and runs one op each), where the masked one
runs all E experts' ops.

On CUDA the gathered form's products run on one Triton kernel a stack where it proved
itself at load (helexa/kernels/cuda/moe_routed.py: each pair's expert read where it lies
in the stack, float or quantised), so a gathering step reads each chosen expert once and
copies nothing; the copying forms below stay the reference and the fallback.

``choose_form`` is the rule, a pure function of the device and the step's shape (shapes
are known on the host, so choosing costs no sync). CPU keeps the looped form: it measured
fastest there at every batch (bench/moe_dispatch.py). No GPU figure was measured: the CUDA
thresholds follow the byte counts above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

# SYNC_FREE_MAX_ROWS, the most rows the masked form takes on CUDA (helexa plan counts its
# products at as many): above this a step is a prefill (never captured in a graph), where
# E / k times the routed compute stops being free and the looped form's one sync per layer
# is cheap beside the step. An estimate, not measured.
from helexa.checkpoint.memory import moe_gathers
from helexa.checkpoint.step_memory import SYNC_FREE_MAX_ROWS

Form = Literal["looped", "gathered", "masked"]


def choose_form(device_type: str, num_rows: int, top_k: int, num_experts: int,
                capturing: bool = False, copies: int = 3) -> Form:
    """Which form runs num_rows tokens' experts on this device (see the module docstring);
    ``capturing``: a CUDA graph is being captured, which no host sync may interrupt;
    ``copies``: expert reads a gathered (token, slot) costs in float bytes (3 for float
    stacks; 1 for quantised ones, whose packed copies are a byte or less a value)."""
    if device_type != "cuda" or (num_rows > SYNC_FREE_MAX_ROWS and not capturing):
        return "looped"
    return "gathered" if moe_gathers(num_rows, top_k, num_experts, copies) else "masked"


def routed(chosen: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, rows, slots) for each expert some token chose, rows ascending: one host
    sync for the whole layer (the experts' row counts, read back once), where a ``where``
    per expert made one each. (Counted by a scatter: CUDA's bincount reads the ids' min
    and max back first.)"""
    k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)  # by expert, then by (row, slot)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    out, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            idx = order[start:start + count]
            out.append((expert, idx // k, idx % k))
            start += count
    return out


def routing_table(x: torch.Tensor, num_experts: int, chosen: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """[N, E] in x's dtype: each row's routing weight for each expert, 0 where unrouted."""
    route = torch.zeros(x.shape[0], num_experts, dtype=x.dtype, device=x.device)
    return route.scatter_(1, chosen, weights.to(x.dtype))


def experts_looped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """x [N, H]; chosen, weights [N, k] -> [N, H]; one host sync (``routed``)."""
    out = torch.zeros_like(x)
    for expert, rows, slot in routed(chosen, w13.shape[0]):
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    return out


def experts_gathered(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """As experts_looped, with no host sync: each (token, slot)'s experts gathered."""
    n, k = chosen.shape
    if n == 0:
        return torch.zeros_like(x)
    flat = chosen.reshape(-1)  # [N k]
    rows = x[:, None].expand(n, k, x.shape[1]).reshape(n * k, x.shape[1], 1)  # [N k, H, 1]
    gate, up = torch.bmm(w13.index_select(0, flat), rows)[..., 0].chunk(2, dim=-1)
    y = torch.bmm(w2.index_select(0, flat), (F.silu(gate) * up)[..., None])[..., 0]
    return (y.view(n, k, -1) * weights[..., None]).sum(dim=1)  # [N, H]


def experts_masked(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, chosen: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """As experts_looped, with no host sync: every expert over every row, weighted, in
    one matmul over the gate/up stack seen as one [E 2I, H] matrix, one batched over the
    down stack and a sum over experts (each expert read once; [E, N, 2I] and [E, N, H]
    held between them). The routing weight scales each expert's activations before its
    down projection, which is linear, so unrouted experts add zeros."""
    e, n = w13.shape[0], x.shape[0]
    if n == 0:
        return torch.zeros_like(x)
    route = routing_table(x, e, chosen, weights)
    if w13.is_contiguous():  # [E 2I, H] @ x^T: the stack read in place, x not copied E times
        h = (w13.view(-1, x.shape[1]) @ x.t()).view(e, -1, n).transpose(1, 2)
    else:
        h = torch.matmul(x, w13.transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)  # [E, N, I] each
    act = F.silu(gate) * up * route.t().unsqueeze(-1)
    return torch.bmm(act, w2.transpose(1, 2)).sum(dim=0)  # [E, N, H] -> [N, H]


FORMS = {"looped": experts_looped, "gathered": experts_gathered, "masked": experts_masked}


def quantised_masked(x: torch.Tensor, kernel: Callable[[str, int, torch.Tensor], torch.Tensor],
                     num_experts: int, chosen: torch.Tensor, weights: torch.Tensor
                     ) -> torch.Tensor:
    """experts_masked for experts kept quantised (a GGUF's stacks: ``kernel(which, expert,
    x)`` is x @ W[expert]^T on its op): no host sync, so a CUDA graph can capture it."""
    out = torch.zeros_like(x)
    route = routing_table(x, num_experts, chosen, weights)
    for expert in range(num_experts):
        gate, up = kernel("w13", expert, x).chunk(2, dim=-1)
        out += kernel("w2", expert, F.silu(gate) * up) * route[:, expert, None]
    return out


def quantised_looped(x: torch.Tensor, kernel: Callable[[str, int, torch.Tensor], torch.Tensor],
                     num_experts: int, chosen: torch.Tensor, weights: torch.Tensor
                     ) -> torch.Tensor:
    """experts_looped for experts kept quantised: one host sync (``routed``)."""
    out = torch.zeros_like(x)
    for expert, rows, slot in routed(chosen, num_experts):
        gate, up = kernel("w13", expert, x[rows]).chunk(2, dim=-1)
        y = kernel("w2", expert, F.silu(gate) * up) * weights[rows, slot, None]
        out.index_add_(0, rows, y)
    return out


def quantised_gathered(x: torch.Tensor, kernel: Any, chosen: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """experts_gathered for experts kept quantised: ``kernel.select`` gathers each (token,
    slot)'s expert from the stacks' packed buffers on the device (only the chosen experts'
    bytes read), then one op per (token, slot), a loop of N x k known on the host: no host
    sync, so a CUDA graph can capture it."""
    n, k = chosen.shape
    if n == 0:
        return torch.zeros_like(x)
    routed = getattr(kernel, "routed_experts", None)  # on CUDA: each expert read in place
    if routed is not None and (y := routed(x, chosen, weights)) is not None:
        return y
    picked = kernel.select(chosen.reshape(-1))  # entry j: token j // k's slot j % k
    ys = []
    for j in range(n * k):
        gate, up = picked("w13", j, x[j // k : j // k + 1]).chunk(2, dim=-1)
        ys.append(picked("w2", j, F.silu(gate) * up))
    return (torch.cat(ys).view(n, k, -1) * weights[..., None]).sum(dim=1)


def run_quantised_experts(x: torch.Tensor,
                          kernel: Callable[[str, int, torch.Tensor], torch.Tensor],
                          num_experts: int, chosen: torch.Tensor, weights: torch.Tensor
                          ) -> torch.Tensor:
    """Quantised experts by choose_form's rule: the looped form where it would loop, the
    gathered one where it would gather (if the kernel can ``select``), else the masked."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    form = choose_form(x.device.type, x.shape[0], chosen.shape[1], num_experts, capturing, 1)
    if form == "looped":
        return quantised_looped(x, kernel, num_experts, chosen, weights)
    if form == "gathered" and hasattr(kernel, "select"):
        return quantised_gathered(x, kernel, chosen, weights)
    return quantised_masked(x, kernel, num_experts, chosen, weights)


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor, routed: Any = None) -> torch.Tensor:
    """The expert products by the form choose_form names for this device and step; the
    gathered form on ``routed`` (helexa/kernels/cuda/moe_routed.py FloatExperts: each
    pair's expert read in place, no copies) where it proved itself at load."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    # the routed kernel reads each pair's expert once (the copies: read, written, read)
    copies = 1 if routed is not None and getattr(routed, "stacks", None) else 3
    form = choose_form(x.device.type, x.shape[0], chosen.shape[1], w13.shape[0], capturing,
                       copies)
    if form == "gathered" and routed is not None and chosen.shape[0]:
        if (y := routed(x, chosen, weights)) is not None:
            return y
    return FORMS[form](x, w13, w2, chosen, weights)
