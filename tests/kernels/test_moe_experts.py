"""The MoE expert forms (helexa/kernels/moe_experts.py): the sync-free ones give the looped
form's output, make no host sync, and the rule picks them only for CUDA decode steps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.host_sync import NoHostSync

from helexa.kernels import moe_experts
from helexa.kernels.moe_experts import (
    choose_form,
    experts_gathered,
    experts_looped,
    experts_masked,
)
from helexa.neuron.models.moe import SparseMoeBlock


def _experts(e: int = 8, h: int = 32, i: int = 16, dtype: torch.dtype = torch.float32,
             device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
    return w13.to(device), w2.to(device)


def _routing(n: int, e: int, k: int, h: int, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, h, generator=gen).to(dtype)
    # a skew toward expert 0 so it is shared by many rows and some experts go unchosen
    logits = torch.randn(n, e, generator=gen)
    logits[:, 0] += 2.0
    weights, chosen = logits.softmax(-1).topk(k, dim=-1)
    return x, chosen, weights.to(dtype)


@pytest.mark.parametrize("form", [experts_gathered, experts_masked])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_sync_free_forms_match_the_looped_one_fp32(form, n):
    w13, w2 = _experts()
    x, chosen, weights = _routing(n, 8, 2, 32)
    # fp32 sums in another order: 1e-5 relative, 1e-6 absolute
    torch.testing.assert_close(form(x, w13, w2, chosen, weights),
                               experts_looped(x, w13, w2, chosen, weights),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", [experts_gathered, experts_masked])
def test_sync_free_forms_match_the_looped_one_bf16(form):
    w13, w2 = _experts(dtype=torch.bfloat16)
    x, chosen, weights = _routing(5, 8, 3, 32, torch.bfloat16)
    # bf16 rounds each product (8 bits of mantissa): 2e-2 relative and absolute
    torch.testing.assert_close(form(x, w13, w2, chosen, weights),
                               experts_looped(x, w13, w2, chosen, weights),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", [experts_gathered, experts_masked, experts_looped])
def test_a_step_of_no_rows_gives_no_rows(form):
    w13, w2 = _experts()
    x, chosen, weights = _routing(3, 8, 2, 32)
    assert form(x[:0], w13, w2, chosen[:0], weights[:0]).shape == (0, 32)


@pytest.mark.parametrize("form", [experts_gathered, experts_masked])
def test_sync_free_forms_make_no_host_sync(form):
    w13, w2 = _experts()
    x, chosen, weights = _routing(4, 8, 2, 32)
    with NoHostSync():
        form(x, w13, w2, chosen, weights)
    # on the meta device any read of the data (.item, .tolist, .cpu, nonzero) fails too
    meta = [t.to("meta") for t in (x, w13, w2, chosen, weights)]
    assert form(*meta).shape == (4, 32)


def test_the_looped_form_reads_the_routing_back_once_a_layer(monkeypatch):
    """It reads how many rows each expert has (one tolist a layer: a host sync on a GPU,
    which the meta device, holding no data, refuses), where it read each chosen expert's
    rows apart (a nonzero each) and gives the same products."""
    w13, w2 = _experts()
    x, chosen, weights = _routing(16, 8, 2, 32)
    with pytest.raises((RuntimeError, NotImplementedError)):
        experts_looped(*(t.to("meta") for t in (x, w13, w2, chosen, weights)))
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    with NoHostSync(tolist=True):  # no nonzero, unique or scalar read; tolists counted
        got = experts_looped(x, w13, w2, chosen, weights)
    assert len(reads) == 1
    want = torch.zeros_like(x)
    for n in range(16):
        for e, w in zip(chosen[n].tolist(), weights[n], strict=True):
            gate, up = torch.nn.functional.linear(x[n], w13[e]).chunk(2)
            want[n] += torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e]) * w
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_rule_keeps_syncs_off_cuda_decode_steps_only():
    assert choose_form("cpu", 1, 8, 128) == "looped"
    assert choose_form("cuda", 1, 8, 128) == "gathered"
    # a float stack's gathered (token, slot) costs 3 experts' reads: E's worth at 5 rows
    assert choose_form("cuda", 5, 8, 128) == "gathered"
    assert choose_form("cuda", 6, 8, 128) == "masked"
    # a quantised stack's is indexed in place: one read each
    assert choose_form("cuda", 16, 8, 128, copies=1) == "gathered"
    assert choose_form("cuda", 17, 8, 128, copies=1) == "masked"
    assert choose_form("cuda", moe_experts.SYNC_FREE_MAX_ROWS, 8, 128) == "masked"
    assert choose_form("cuda", moe_experts.SYNC_FREE_MAX_ROWS + 1, 8, 128) == "looped"
    # a graph of a batch that large is still captured whole: no sync may interrupt it
    assert choose_form("cuda", moe_experts.SYNC_FREE_MAX_ROWS + 1, 8, 128, True) == "masked"
    assert choose_form("cpu", 1, 8, 128, True) == "looped"


def _block(shared: bool) -> SparseMoeBlock:
    cfg: Any = SimpleNamespace(num_experts=8, hidden_size=32, moe_intermediate_size=16,
                               num_experts_per_tok=2, norm_topk_prob=True,
                               shared_expert_intermediate_size=24 if shared else 0)
    block = SparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(2)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block


@pytest.mark.parametrize("form", ["gathered", "masked"])
def test_a_moe_layer_on_the_cuda_path_syncs_nowhere_and_answers_the_same(monkeypatch, form):
    block = _block(shared=True)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    want = block(x)  # CPU: the looped form
    monkeypatch.setattr(moe_experts, "choose_form", lambda *a: form)  # as on a CUDA decode
    with NoHostSync():
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _op_kernel(w13: torch.Tensor, w2: torch.Tensor) -> Any:
    """A quantised stack's experts_kernel(which, expert, x) stand-in: one op per expert."""
    return lambda which, e, x: torch.nn.functional.linear(x, (w13 if which == "w13" else w2)[e])


@pytest.mark.parametrize("n", [1, 5])
def test_quantised_experts_masked_match_looped_and_make_no_host_sync(n):
    w13, w2 = _experts()
    x, chosen, weights = _routing(n, 8, 2, 32)
    kernel = _op_kernel(w13, w2)
    want = moe_experts.quantised_looped(x, kernel, 8, chosen, weights)
    torch.testing.assert_close(want, experts_looped(x, w13, w2, chosen, weights))
    with NoHostSync():
        got = moe_experts.quantised_masked(x, kernel, 8, chosen, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_gguf_moe_layer_on_the_cuda_path_syncs_nowhere(monkeypatch):
    block = _block(shared=False)
    block.experts_kernel = _op_kernel(block.w13.data, block.w2.data)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    want = block(x)  # CPU: one pass per chosen expert
    monkeypatch.setattr(moe_experts, "choose_form", lambda *a: "gathered")  # a CUDA decode
    with NoHostSync():
        got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _quantised_block(w13_op: str, w2_op: str) -> torch.nn.Module:
    """A MoE block's expert stacks as a GGUF file leaves them (formats/gguf/experts.py's
    install): w13 and w2 each on ``op`` ("int4", "int8g"), or "float" (kept as it is)."""
    from helexa.checkpoint.gguf_layout import Layout
    from helexa.neuron.formats.gguf.experts import ExpertStack, install

    gen = torch.Generator().manual_seed(9)
    e, h, i, group = 8, 64, 32, 32
    mlp = torch.nn.Module()
    mlp.experts_kernel = None
    mlp.gguf_stacks = {}
    for which, (rows, k), op in (("w13", (2 * i, h), w13_op), ("w2", (h, i), w2_op)):
        if op == "float":
            mlp.register_buffer(which, torch.randn(e, rows, k, generator=gen) * k ** -0.5)
            continue
        lo, hi = (0, 16) if op == "int4" else (-128, 128)
        q = torch.randint(lo, hi, (e, rows, k), dtype=torch.int8, generator=gen)
        scale = torch.rand(e, rows, k // group, generator=gen) * 0.02 / k ** 0.5
        zero = torch.randn(e, rows, k // group, generator=gen) * 0.01
        for comp, t in (("q", q), ("scale", scale), ("zero", zero)):
            mlp.register_parameter(f"gguf_{which}_{comp}",
                                   torch.nn.Parameter(t, requires_grad=False))
        mlp.gguf_stacks[which] = ExpertStack(Layout(op, group, True))
        install(mlp, which, torch.float32)
    return mlp


@pytest.mark.parametrize(("w13_op", "w2_op"), [("int4", "int8g"), ("int8g", "float")])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_quantised_experts_gathered_match_looped_and_make_no_host_sync(w13_op, w2_op, n):
    """The gathered form over a GGUF's quantised stacks: each (token, slot)'s expert indexed
    out of the packed buffers on the device (the ids never read back), one op each; the
    same sums as one pass per chosen expert (a step of no rows: no rows)."""
    mlp = _quantised_block(w13_op, w2_op)
    kernel = mlp.experts_kernel
    assert set(kernel.ops) == {w for w, op in (("w13", w13_op), ("w2", w2_op)) if op != "float"}
    x, chosen, weights = _routing(n, 8, 2, 64)
    want = moe_experts.quantised_looped(x, kernel, 8, chosen, weights)
    with NoHostSync():
        got = moe_experts.quantised_gathered(x, kernel, chosen, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if n == 0:
        return
    picked = kernel.select(chosen.reshape(-1))  # entry j is expert chosen.flat[j]
    j = 1
    torch.testing.assert_close(picked("w2", j, x[:1, :32]),
                               kernel("w2", int(chosen.reshape(-1)[j]), x[:1, :32]))


def test_the_rule_sends_a_cuda_decode_of_quantised_experts_to_the_gathered_form(monkeypatch):
    mlp = _quantised_block("int4", "int8g")
    x, chosen, weights = _routing(3, 8, 2, 64)
    seen = []
    monkeypatch.setattr(moe_experts, "quantised_gathered",
                        lambda x, k, c, w: seen.append("gathered")
                        or moe_experts.quantised_looped(x, k, 8, c, w))
    monkeypatch.setattr(moe_experts, "choose_form", lambda *a: "gathered")  # a CUDA decode
    moe_experts.run_quantised_experts(x, mlp.experts_kernel, 8, chosen, weights)
    assert seen == ["gathered"]
    plain = _op_kernel(*_experts())  # a kernel that cannot select: the masked form
    moe_experts.run_quantised_experts(x[:, :32], plain, 8, chosen, weights)
    assert seen == ["gathered"]
