"""A MoE step's expert products read in place (helexa/kernels/cuda/moe_routed.py): the Triton
kernel run here on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET) over float, grouped int8 and torch's CUDA int4 stacks (the last through
a replica of torch's packing, tests/support/tinygemm.py), against each pair's product with
its expert dequantised; and its probe."""

from __future__ import annotations

import os

import pytest
import torch
from support import tinygemm

from helexa.kernels.cuda import moe_routed as mr

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "Triton's interpreter is off (tests/conftest.py: a CUDA host, where the card runs it)"))

E, N, K = 5, 40, 512  # 40 outputs: a ragged last block of 32; K of four BLOCK_K steps


def _stack(kind: str, group: int, seed: int, zeros: bool = True, inner: int = 8,
           K: int = K) -> tuple[mr.Stack, torch.Tensor]:  # noqa: N803
    """A seeded stack of ``kind`` and its float experts [E, N, K] as the kernel must read
    them."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "float":
        w = torch.randn(E, N, K, generator=gen).bfloat16()
        return mr.Stack("float", w, n=N, k=K), w.float()
    if kind == "int8":
        q = torch.randint(-128, 128, (E, N, K), generator=gen, dtype=torch.int8)
        s = (torch.rand(E, N, K // group, generator=gen) * 0.02 + 1e-3).bfloat16()
        z = (torch.randn(E, N, K // group, generator=gen) * 0.05).bfloat16() if zeros else None
        w = q.float() * s.float().repeat_interleave(group, -1)
        if z is not None:
            w += z.float().repeat_interleave(group, -1)
        return mr.Stack("int8", q, s, z, group, N, K), w
    q = torch.randint(0, 16, (E, N, K), generator=gen, dtype=torch.int32)
    s = torch.rand(E, N, K // group, generator=gen) * 0.02 + 1e-3
    z = torch.randn(E, N, K // group, generator=gen) * 0.05
    sz = torch.stack([s.transpose(1, 2), z.transpose(1, 2)], -1).bfloat16().contiguous()
    packed = torch.stack([tinygemm.pack(q[e], inner) for e in range(E)])
    w = ((q.float() - 8) * sz[..., 0].float().transpose(1, 2).repeat_interleave(group, -1)
         + sz[..., 1].float().transpose(1, 2).repeat_interleave(group, -1))
    return mr.Stack("int4", packed, sz, None, group, N, K), w


# (kind, group, zeros, inner k-tiles, K): Q8_0 / Q5_K's groups of 32, Q6_K's of 16, one
# group over several steps, a group no step holds whole; torch's int4 at each tiling; K
# ending mid-step (160: a step and a quarter)
CASES = [("float", 1, True, 8, K), ("int8", 32, True, 8, K), ("int8", 16, False, 8, K),
         ("int8", 256, False, 8, K), ("int8", 96, True, 8, 384), ("int4", 32, True, 8, K),
         ("int4", 128, True, 2, K), ("int4", 64, True, 4, K), ("int4", 32, True, 2, 160),
         ("int8", 32, True, 8, 160), ("float", 1, True, 8, 160)]


@pytest.mark.parametrize(("kind", "group", "zeros", "inner", "k"), CASES)
def test_each_pair_is_its_row_times_its_expert(kind, group, zeros, inner, k):
    """Pairs in any order, an expert chosen twice, rows repeated (a token's slots): each
    output row is x[rows[j]] @ W[experts[j]]^T, read from the stack in place."""
    stack, w = _stack(kind, group, seed=len(kind) + group, zeros=zeros, inner=inner, K=k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, k, generator=gen).bfloat16()
    experts = torch.tensor([4, 0, 2, 4, 1, 3], dtype=torch.int32)
    rows = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32)
    got = mr.run(x, rows, experts, stack, interpret=True)
    assert got.dtype == torch.bfloat16 and got.shape == (6, N)
    want = torch.stack([x[r].float() @ w[e].t() for r, e in zip(rows.tolist(), experts.tolist(),
                                                                  strict=True)])
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=4e-3 * want.abs().max())


def test_k_split_over_programs_adds_up_and_no_pairs_is_an_empty_product():
    stack, w = _stack("int8", 32, seed=7)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    one = torch.zeros(1, dtype=torch.int32)
    assert mr.split_k(N, K, 1, sms=16) == 1 < mr.split_k(N, 4 * K, 1, sms=16)
    whole = mr.run(x, one, one + 2, stack, sms=1, interpret=True)
    torch.testing.assert_close(whole.float(), x.float() @ w[2].t(), rtol=2e-2, atol=0.05)
    none = mr.run(x, one[:0], one[:0], stack, interpret=True)
    assert none.shape == (0, N)


def test_the_probe_passes_a_right_stack_and_names_a_wrong_one():
    stack, w = _stack("int4", 32, seed=3)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = torch.stack([x[0].float() @ w[e].t() for e in (0, E - 1)])
    assert mr.probe(x, stack, ref, (0, E - 1), interpret=True) == ""
    why = mr.probe(x, stack, ref.flip(0), (0, E - 1), interpret=True)
    assert why.startswith("the Triton routed expert product is off by"), why
    # the same words read as another inner k-tiling's: every value from the wrong nibble
    broken = mr.Stack("int4", stack.weight[..., :1].contiguous(), stack.scales, None, 32, N,
                      K // 2)
    why = mr.probe(x[:, : K // 2], broken, ref, (0, E - 1), interpret=True)
    assert why.startswith("the Triton routed expert product"), why


def _quant_block(num_experts: int, hidden: int, inter: int, group: int):
    """A MoE block's grouped int8 stacks (w13: gate rows then up rows; w2), as
    helexa/neuron/formats/gguf/experts.py installs a GGUF's, and its QuantExperts."""
    from types import SimpleNamespace

    from helexa.neuron.formats.gguf.experts import QuantExperts

    gen = torch.Generator().manual_seed(11)

    def stack(rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {"qweight": torch.randint(-128, 128, (num_experts, rows, cols), generator=gen,
                                         dtype=torch.int8),
                "qscales": (torch.rand(num_experts, rows, cols // group, generator=gen) * 0.01
                            + 1e-3).bfloat16(),
                "qzeros": (torch.randn(num_experts, rows, cols // group, generator=gen)
                           * 0.01).bfloat16()}

    parts = {f"w13_{k}": v for k, v in stack(2 * inter, hidden).items()}
    parts |= {f"w2_{k}": v for k, v in stack(hidden, inter).items()}
    mlp = SimpleNamespace(gate=torch.zeros(num_experts, hidden, dtype=torch.bfloat16), **parts)
    kernel = QuantExperts(mlp)
    kernel.ops = {"w13": ("int8", group, 2 * inter), "w2": ("int8", group, hidden)}
    return kernel


def test_a_gathered_step_reads_its_experts_in_place_once_they_proved_themselves(monkeypatch):
    """QuantExperts at load (CUDA, here the interpreter): both stacks prove themselves
    against their ops on their first and last expert, and a gathered step then runs on the
    routed kernel, equal to the copies' form: each token's slots weighted and summed."""
    from helexa.kernels import moe_experts
    from helexa.neuron.formats.gguf import experts

    kernel = _quant_block(num_experts=6, hidden=256, inter=128, group=32)
    assert kernel._prove_routed() == {}  # CPU stacks: the CPU keeps its ops
    monkeypatch.setattr(experts.moe_routed, "on_card", lambda t: True)
    kernel.routed = kernel._prove_routed()
    assert set(kernel.routed) == {"w13", "w2"}
    assert (kernel.routed["w13"].n, kernel.routed["w13"].k) == (256, 256)
    assert (kernel.routed["w2"].n, kernel.routed["w2"].k) == (256, 128)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen).bfloat16()
    chosen = torch.tensor([[5, 0], [2, 5], [1, 3]])
    weights = torch.rand(3, 2, generator=gen).bfloat16()
    got = moe_experts.quantised_gathered(x, kernel, chosen, weights)
    routed, kernel.routed = kernel.routed, {}
    want = moe_experts.quantised_gathered(x, kernel, chosen, weights)  # the copies
    assert got.shape == want.shape == (3, 256)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2,
                               atol=2e-2 * want.float().abs().max())
    # a stack that disagrees with its op leaves the block on the copies, and says so
    kernel.routed = routed
    monkeypatch.setattr(experts.moe_routed, "probe", lambda *a, **k: "off by 0.5")
    assert kernel._prove_routed() == {}
    assert experts.moe_routed.describe(torch.device("cpu")).startswith(
        "MoE experts: gathered copies (off by 0.5)")


def test_a_float_moe_blocks_gathered_step_reads_its_experts_in_place(monkeypatch):
    """A MoE block's float stacks (a bf16 checkpoint's) on the kernel once proved at load:
    the same products as the gathered form, which copies each pair's matrices out first;
    run_experts takes it where the rule says gather, and not where it says otherwise."""
    from types import SimpleNamespace

    from helexa.kernels import moe_experts

    gen = torch.Generator().manual_seed(8)
    w13 = (torch.randn(6, 2 * 64, 128, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(6, 128, 64, generator=gen) * 0.1).bfloat16()
    block = SimpleNamespace(w13=w13, w2=w2)
    routed = mr.FloatExperts(block)
    routed.prepare(8)
    assert routed.stacks == {}  # CPU tensors: the CPU keeps its forms
    monkeypatch.setattr(mr, "on_card", lambda t: True)
    routed.prepare(8)
    assert set(routed.stacks) == {"w13", "w2"}
    x = torch.randn(3, 128, generator=gen).bfloat16()
    chosen = torch.tensor([[5, 0], [2, 5], [1, 3]])
    weights = torch.rand(3, 2, generator=gen).bfloat16()
    want = moe_experts.experts_gathered(x, w13, w2, chosen, weights)
    got = routed(x, chosen, weights)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2,
                               atol=2e-2 * want.float().abs().max())
    calls: list[str] = []

    def spy(*args):
        calls.append("routed")
        return routed(*args)

    for form in ("gathered", "masked"):
        monkeypatch.setattr(moe_experts, "choose_form", lambda *a, f=form, **k: f)
        out = moe_experts.run_experts(x, w13, w2, chosen, weights, spy)
        torch.testing.assert_close(out.float(), want.float(), rtol=3e-2,
                                   atol=2e-2 * want.float().abs().max())
    assert calls == ["routed"]
    # a proved routed kernel reads each pair's expert once: the rule gathers while N k <= E,
    # not only while 3 N k <= E as for the copies (a bf16 Qwen3-30B-A3B's batches 6-16)
    seen: list[int] = []
    monkeypatch.setattr(moe_experts, "choose_form",
                        lambda *a, **k: seen.append(a[5] if len(a) > 5 else k["copies"])
                        or "gathered")
    moe_experts.run_experts(x, w13, w2, chosen, weights, routed)
    moe_experts.run_experts(x, w13, w2, chosen, weights, None)
    assert seen == [1, 3]


def test_an_int4_stack_proves_itself_in_an_fp32_model(monkeypatch):
    """torch's CUDA int4 op, the probe's reference, rounds activations and products to
    bf16: an fp32 or fp16 model's int4 stack is held to bf16's tolerance, not its own."""
    stack, w = _stack("int4", 32, seed=9)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3))
    exact = torch.stack([x[0] @ w[e].t() for e in (0, E - 1)])
    rounded = exact * (1 + 5e-3)  # a reference off by bf16's rounding
    assert mr.probe(x, stack, rounded, (0, E - 1), interpret=True) == ""
    assert mr.probe(x, stack, exact * 1.1, (0, E - 1), interpret=True).startswith(
        "the Triton routed expert product is off by")
