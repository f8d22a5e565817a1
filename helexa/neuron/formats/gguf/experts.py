"""A GGUF file's quantised expert stacks kept quantised: each expert on the op its type
takes, called per expert by the MoE block (helexa/neuron/models/moe.py).

llama.cpp stacks every expert's projection into one 3-D tensor (``ffn_gate_exps``,
``ffn_up_exps`` [experts, intermediate, hidden], ``ffn_down_exps`` [experts, hidden,
intermediate]; or ``ffn_gate_up_exps``), each expert's rows quantised as a 2-D weight's
are. Before loading, a MoE block whose stacks are quantised gets, in place of its float
``w13`` / ``w2``, their unpacked form per expert (``gguf_w13_q`` int8 [E, rows, cols],
``gguf_w13_scale`` / ``_zero`` fp32 per group), filled through the block's own expert
loaders (each rank its rows of w13, its columns of w2, groups never cut); they hold
memory only from their layer's first expert on (deferred.until_loaded). Once a
stack's parts are in, :func:`install` moves them onto the op of
:func:`helexa.checkpoint.gguf_layout.layout_of`: grouped int8 (``q * scale + zero``), or tinygemm's
int4 for ``Q4_K``, one packed weight per expert; the block then calls
``experts_kernel(which, expert, x)`` in place of ``F.linear(x, w[expert])``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from helexa.checkpoint.gguf import GgufError, reader
from helexa.checkpoint.gguf_layout import FLOAT, QUANT_TYPES, Layout, layout_of
from helexa.kernels import quant as qk
from helexa.kernels.cuda import int4_tiles, moe_routed
from helexa.neuron.formats.gguf.unpack import to_layout
from helexa.neuron.models import deferred
from helexa.neuron.models.layers import TensorSlice
from helexa.neuron.models.moe import SparseMoeBlock

_STACKS = {"w13": ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"), "w2": ("ffn_down_exps",)}


@dataclass
class ExpertStack:
    """One quantised stack (w13 or w2) of a MoE block: its layout and the GGUF tensors
    still to load into it."""

    layout: Layout
    parts: dict[str, int] = field(default_factory=dict)  # tensor -> expert slices to come


def attach_experts(model: nn.Module, path: Path) -> None:
    """Give every MoE block whose expert stacks the file holds quantised their unpacked
    form in place of the float ``w13`` / ``w2``."""
    types = {t.name: t.tensor_type.name for t in reader(path).tensors}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoeBlock):
            continue
        for which, names in _STACKS.items():
            present = [n for n in (f"blk.{i}.{s}.weight" for s in names) if n in types]
            if not present or any(types[n] not in QUANT_TYPES for n in present):
                continue  # float (or missing: the loader's check names it)
            w = getattr(mlp, which)
            e, rows, k = w.shape
            layout = layout_of([types[n] for n in present], rows=rows)
            if layout == FLOAT:
                continue
            if k % layout.group:
                raise GgufError(
                    f"model.layers.{i}.mlp.{which}: groups of {layout.group} would straddle "
                    f"ranks: {k * (mlp.tp_size if which == 'w2' else 1)} input features / "
                    f"tp={mlp.tp_size} = {k} per rank, not a multiple of {layout.group}")
            loader = w.weight_loader
            del mlp._parameters[which]
            at = deferred.home(mlp, w)  # the stack may have been built on meta
            mlp.register_buffer(which, torch.empty(0, dtype=w.dtype, device=at),
                                persistent=False)
            comps = {"q": (torch.int8, k), "scale": (torch.float32, k // layout.group)}
            if layout.zeros:
                comps["zero"] = (torch.float32, k // layout.group)
            for comp, (dtype, width) in comps.items():  # real as the layer loads
                p = deferred.until_loaded((e, rows, width), dtype, at)
                p.weight_loader = loader  # type: ignore[attr-defined]
                mlp.register_parameter(f"gguf_{which}_{comp}", p)
            if not hasattr(mlp, "gguf_stacks"):
                mlp.gguf_stacks = {}
            mlp.gguf_stacks[which] = ExpertStack(
                layout, {n: e * (2 if "gate_up" in n else 1) for n in present})


def install(mlp: nn.Module, which: str, dtype: torch.dtype) -> None:
    """A loaded stack's unpacked form -> its op's buffers; the unpacked form is freed."""
    layout: Layout = mlp.gguf_stacks[which].layout
    q = mlp._parameters.pop(f"gguf_{which}_q").data
    scale = mlp._parameters.pop(f"gguf_{which}_scale").data
    p_zero = mlp._parameters.pop(f"gguf_{which}_zero", None)
    zero = torch.zeros_like(scale) if p_zero is None else p_zero.data
    if layout.op == "int4":  # tinygemm: w = (q - 8) * scale + zero', per expert
        packed = torch.stack([qk.int4_pack(q[e].to(torch.uint8)) for e in range(q.shape[0])])
        sz = torch.stack([qk.int4_scales_zeros(scale[e], 8 * scale[e] + zero[e], dtype)
                          for e in range(q.shape[0])])
        mlp.register_buffer(f"{which}_qweight", packed, persistent=False)
        mlp.register_buffer(f"{which}_qscales_zeros", sz, persistent=False)
    else:
        mlp.register_buffer(f"{which}_qweight", q.contiguous(), persistent=False)
        mlp.register_buffer(f"{which}_qscales", scale.to(dtype).contiguous(), persistent=False)
        if p_zero is not None:
            mlp.register_buffer(f"{which}_qzeros", zero.to(dtype).contiguous(), persistent=False)
    kernel = mlp.experts_kernel or QuantExperts(mlp)
    kernel.ops[which] = (layout.op, layout.group, q.shape[1])
    mlp.experts_kernel = kernel


_PARTS = ("qweight", "qscales", "qzeros", "qscales_zeros")  # a quantised stack's buffers


class QuantExperts:
    """experts_kernel(which, expert, x) -> x @ W[expert]^T on the stack's op."""

    def __init__(self, mlp: Any) -> None:
        self.mlp = mlp  # the MoE block, or a gathered namespace of its stacks (select)
        self.ops: dict[str, tuple[str, int, int]] = {}  # which -> (op, group, rows)
        # w13 and w2 as the routed kernel reads them, once both proved themselves at load
        # (prepare, CUDA): then a gathered step reads its experts in place (routed_experts)
        self.routed: dict[str, moe_routed.Stack] = {}

    def select(self, experts: torch.Tensor) -> QuantExperts:
        """The same products over the experts ``experts`` (device ids) names, gathered:
        expert j of the result is ``experts[j]``. Each stack's packed buffers (or a float
        stack's matrices) are indexed on the device, so no host sync waits for the ids and
        only the chosen experts' bytes are read (moe_experts.quantised_gathered)."""
        names = [f"{w}_{p}" for w in ("w13", "w2") for p in _PARTS]
        names += [w for w in ("w13", "w2") if w not in self.ops]  # a float stack
        gathered = SimpleNamespace(**{n: getattr(self.mlp, n).index_select(0, experts)
                                      for n in names if hasattr(self.mlp, n)})
        out = QuantExperts(gathered)
        out.ops = self.ops
        return out

    @property
    def kind(self) -> str:
        """"int4" where every quantised stack is int4 (the executor's describe), else "int8"."""
        return "int4" if all(op[0] == "int4" for op in self.ops.values()) else "int8"

    def prepare(self, max_num_seqs: int) -> None:
        """Run each grouped int8 stack's op once at load (one expert, the row counts a
        decode step has), so that it picks its kernels now (helexa/kernels/cpu/int8g.py
        measures; helexa/kernels/cuda/int8g.py probes and builds), not in the first
        request's step; an int4 stack's prefill tiles prove themselves on CUDA. The experts
        of a stack share their shape: one run serves all."""
        with torch.inference_mode():
            for which, (kind, group, _) in self.ops.items():
                q = getattr(self.mlp, f"{which}_qweight")
                if kind == "int4":  # its prefill's tiles (helexa/kernels/cuda/int4_tiles.py)
                    int4_tiles.prepare(q, group, qk.int4_pack_cuda)
                    continue
                dtype = getattr(self.mlp, f"{which}_qscales").dtype
                for rows in sorted({1, min(max_num_seqs, 2)}):
                    self(which, 0, torch.zeros(rows, q.shape[-1], dtype=dtype, device=q.device))
            self.routed = self._prove_routed()

    def routed_stack(self, which: str) -> moe_routed.Stack | None:
        """Stack ``which`` as helexa/kernels/cuda/moe_routed.py reads it (float, grouped int8,
        int4 in torch's CUDA layout), else None (int4 in the CPU op's)."""
        m = self.mlp
        op = self.ops.get(which)
        if op is None:  # a float stack
            w = getattr(m, which)
            return moe_routed.Stack("float", w, n=w.shape[1], k=w.shape[2])
        kind, group, rows = op
        q = getattr(m, f"{which}_qweight")
        if kind == "int4":
            if q.dim() != 5:  # [E, N / 8, K / (inner * 16), 32, inner / 2] on CUDA
                return None
            inner = q.shape[-1] * 2
            return moe_routed.Stack("int4", q, getattr(m, f"{which}_qscales_zeros"), None,
                                    group, rows, q.shape[2] * inner * 16)
        return moe_routed.Stack("int8", q, getattr(m, f"{which}_qscales"),
                                getattr(m, f"{which}_qzeros", None), group, rows, q.shape[-1])

    def _prove_routed(self) -> dict[str, moe_routed.Stack]:
        """Both stacks on the routed kernel, proved against this kernel's own products
        (moe_routed.prove_stacks), in the activations' dtype (the router's weight is the
        model's); {} where either cannot or does not agree."""
        return moe_routed.prove_stacks({w: self.routed_stack(w) for w in ("w13", "w2")},
                                       self, self.mlp.gate.dtype)

    def agreed(self) -> None:
        """The verdicts settled (CudaGraphExecutor.agreed): stacks of a refused kind go."""
        self.routed = moe_routed.standing(self.routed)

    def routed_experts(self, x: torch.Tensor, chosen: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor | None:
        """The gathered form's products on the routed kernel, every (token, slot) pair's
        expert read in place: one launch for w13, one for w2 (moe_experts.quantised_gathered);
        None where the stacks did not prove themselves at load (prepare)."""
        if not self.routed:
            return None
        return moe_routed.experts(x, chosen, weights, self.routed["w13"], self.routed["w2"])

    def __call__(self, which: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        op = self.ops.get(which)
        m = self.mlp
        if op is None:  # this stack is float
            return torch.nn.functional.linear(x, getattr(m, which)[expert])
        kind, group, rows = op
        if kind == "int4":
            return qk.int4_linear(x, getattr(m, f"{which}_qweight")[expert], group, rows,
                                  getattr(m, f"{which}_qscales_zeros")[expert], None)
        zeros = getattr(m, f"{which}_qzeros", None)
        return qk.int8g_linear(x, getattr(m, f"{which}_qweight")[expert],
                               getattr(m, f"{which}_qscales")[expert],
                               None if zeros is None else zeros[expert], group, None)


def stack_of(mlp: Any, attr: str) -> ExpertStack | None:
    """The quantised stack a MoE block parameter (``w13`` / ``w2``) loads into, if any."""
    stack = getattr(mlp, "gguf_stacks", {}).get(attr)
    return stack if stack is not None and f"gguf_{attr}_q" in mlp._parameters else None


def load_piece(mlp: nn.Module, mod_name: str, attr: str, shard: Any, value: Any, tensor: str,
               on_loaded: Any) -> None:
    """One expert's unpacked rows (of GGUF ``tensor``) into a quantised stack's parts;
    installs the op once the stack's tensors are all in."""
    stack: ExpertStack = mlp.gguf_stacks[attr]
    assert isinstance(value, tuple), "attach_experts saw the stack quantised"
    for comp, v in zip(("q", "scale", "zero"), to_layout(value, stack.layout), strict=True):
        name = f"gguf_{attr}_{comp}"
        if v is not None and name in mlp._parameters:
            p = deferred.real(mlp, name)
            with torch.no_grad():
                p.weight_loader(p, TensorSlice(v), shard)
            on_loaded(None, (f"{mod_name}.{name}", shard), 0)
    stack.parts[tensor] -= 1
    if stack.parts[tensor] == 0:
        del stack.parts[tensor]
        if not stack.parts:  # every expert in: the op's layout now, the unpacked form freed
            install(mlp, attr, mlp.gate.dtype)
