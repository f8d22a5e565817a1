"""Weight-only quantisation at load: the layout, the op, the bytes, the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helexa.kernels import quant as qk
from helexa.neuron.formats.base import open_checkpoint
from helexa.neuron.formats.loader import load_model, weight_bytes
from helexa.neuron.formats.quantise import (
    QuantConfigError,
    QuantiseAtLoad,
    QuantSpec,
    quantize_int4,
    quantize_int8,
)
from helexa.neuron.models.llama import LlamaForCausalLM


def test_int8_op_equals_dequantized_matmul():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 80, generator=g), torch.randn(5, 80, generator=g)
    q, s = quantize_int8(w, dtype=torch.float32)
    assert q.dtype == torch.int8 and s.shape == (96,)
    deq = qk.dequantize_int8(q, s)
    assert (deq - w).abs().max() <= s.max() / 2 + 1e-6  # rounding error at most half a step
    torch.testing.assert_close(qk.int8_linear(x, q, s, None), x @ deq.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_op_equals_dequantized_matmul(group):
    g = torch.Generator().manual_seed(group)
    w, x = torch.randn(48, 256, generator=g), torch.randn(3, 256, generator=g)
    b = torch.randn(48, generator=g)
    q, s, z = quantize_int4(w, group, torch.float32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15 and s.shape == (48, 256 // group)
    deq = qk.dequantize_int4(q, s, z, group)
    step = s.repeat_interleave(group, 1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-5).all())
    y = qk.int4_linear(x, qk.int4_pack(q), group, 48, qk.int4_scales_zeros(s, z, torch.float32), b)
    torch.testing.assert_close(y, x @ deq.T + b, rtol=1e-5, atol=1e-4)
    # a rank's columns of a wider input (the MTP head's fc at tp > 1): a strided view
    wide = torch.randn(3, 512, generator=g)
    cols = wide[:, 256:]
    y = qk.int4_linear(cols, qk.int4_pack(q), group, 48, qk.int4_scales_zeros(s, z, torch.float32),
                       b)
    torch.testing.assert_close(y, cols @ deq.T + b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("kind", "shrink"), [("int8", 3.5), ("int4", 4.2)])
def test_quantized_load_frees_float_weights(tiny_checkpoint, kind, shrink):
    model_dir = tiny_checkpoint("qwen3")
    base = load_model(model_dir, dtype="float32")
    model = load_model(model_dir, dtype="float32", quantize=QuantSpec(kind, 32))
    proj = model.model.layers[0].mlp.down_proj
    assert proj.weight.numel() == 0 and proj.kernel is not None
    assert proj.qweight.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    # fp32 -> 1 byte (int8) or half a byte + group scales (int4; its int8 head and embedding
    # are half this model); norms stay fp32
    assert weight_bytes(base) / weight_bytes(model) > shrink
    x = torch.randn(2, 128)
    assert F.linear(x, proj.weight.new_zeros(64, 128)).abs().sum() == 0  # float weight gone
    assert proj(x).abs().sum() > 0


def test_int4_groups_straddling_ranks_are_refused(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("qwen3"))
    model = LlamaForCausalLM(ckpt.config, tp_rank=0, tp_size=2)
    with pytest.raises(QuantConfigError,
                       match=r"o_proj: int4 groups of 64 would straddle ranks: 64 input features"
                             r" / tp=2 = 32 per rank, not a multiple of 64"):
        QuantiseAtLoad(ckpt, QuantSpec("int4", 64)).attach(model)


def test_int4_groups_straddling_an_experts_rows_are_refused(tiny_checkpoint):
    """A routed expert's down projection reads moe_intermediate_size inputs (96 here):
    groups of 64 would run from one expert's row into the next's."""
    from helexa.neuron.models.hybrid import HybridForCausalLM
    ckpt = open_checkpoint(tiny_checkpoint("qwen3_moe", intermediate_size=192))
    model = HybridForCausalLM(ckpt.config, tp_rank=0, tp_size=1)
    with pytest.raises(QuantConfigError,
                       match=r"mlp\.w2: int4 groups of 64 would straddle ranks or experts' "
                             r"rows: 96 input features per rank, not a multiple of 64"):
        QuantiseAtLoad(ckpt, QuantSpec("int4", 64)).attach(model)
    QuantiseAtLoad(ckpt, QuantSpec("int4", 32)).attach(  # 96 holds three: accepted
        HybridForCausalLM(ckpt.config, tp_rank=0, tp_size=1))


def test_bad_quant_settings_are_refused():
    with pytest.raises(QuantConfigError, match="expected one of"):
        QuantSpec("int3")
    with pytest.raises(QuantConfigError, match="quant_group_size.*got 48"):
        QuantSpec("int4", 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_on_cuda_runs_bf16_whatever_the_models_dtype(dtype):
    """torch's int4 CUDA op takes bf16 scales and activations only: on CUDA the operand is
    bf16 for any model (fp16 AWQ / GPTQ files load as they are, their activations rounded to
    bf16 for these products); elsewhere the model's own dtype."""
    assert qk.int4_operand_dtype(torch.device("cuda"), dtype) == torch.bfloat16
    assert qk.int4_operand_dtype(torch.device("cpu"), dtype) == dtype
    s, z = torch.rand(48, 2), torch.rand(48, 2)
    assert qk.int4_scales_zeros(s, z, dtype).dtype == dtype  # on CPU
    meta = qk.int4_scales_zeros(s.to("meta"), z.to("meta"), dtype)
    assert meta.dtype == dtype and meta.shape == (2, 48, 2)


@pytest.mark.parametrize("k,tiles", [(4096, 8), (5120, 8), (2560, 8), (192, 4), (320, 4),
                                     (96, 2)])
def test_the_cuda_int4_layout_takes_the_deepest_k_tiling_the_width_allows(k, tiles):
    # 8 inner k-tiles (16-byte loads) wherever K/16 divides by 8: every hidden size of the
    # served families; narrower layouts only for odd widths. No GPU: the choice alone.
    assert qk.cuda_inner_k_tiles(k) == tiles
    assert k % (tiles * 16) == 0
    with pytest.raises(ValueError, match="divisible by 32"):
        qk.cuda_inner_k_tiles(k + 16)


def test_a_ranks_int8_quantiser_takes_the_rows_absmax_read_on_the_host():
    """At tp > 1 each row's absmax comes from the checkpoint's whole row, read on the host,
    while the rank's columns are on the device (meta stands in for CUDA here: mixing a CPU
    scale into the device's division raised)."""
    w, absmax = torch.randn(6, 8), torch.full((6,), 4.0)
    q, s = quantize_int8(w.to("meta"), absmax=absmax)
    assert q.device.type == s.device.type == "meta"
    torch.testing.assert_close(quantize_int8(w, absmax=absmax)[1],
                               (absmax / 127).to(torch.bfloat16))


def test_a_step_wanting_no_logits_never_launches_the_quantised_head(monkeypatch):
    """A step of prompt chunks that end before their prompt does wants no logits: the head
    gets 0 rows, which torch's int8 and int4 CUDA ops would launch as an invalid grid."""
    def refuse(*args):
        raise AssertionError("launched with 0 rows")

    x = torch.zeros(0, 64)
    q, s = quantize_int8(torch.randn(32, 64), dtype=torch.float32)
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", refuse)
    assert qk.int8_linear(x, q, s, None).shape == (0, 32)
    q4, s4, z4 = quantize_int4(torch.randn(32, 64), 32, torch.float32)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", refuse)
    sz = qk.int4_scales_zeros(s4, z4, torch.float32)
    assert qk.int4_linear(x, qk.int4_pack(q4), 32, 32, sz, None).shape == (0, 32)
    with pytest.raises(AssertionError, match="0 rows"):  # the stand-in is the one reached
        qk.int4_linear(torch.zeros(1, 64), qk.int4_pack(q4), 32, 32, sz, None)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantising_at_load_frees_each_float_weight_as_it_goes(tiny_checkpoint, monkeypatch,
                                                               kind):
    """Each layer's float weight goes as soon as the layer is quantised, so the load peaks
    at the float model and one layer's quantised copy, never every layer's beside it (a
    tied head shares the embedding's float until both are done)."""
    from helexa.neuron.formats import quantise

    still_float: list[int] = []
    real = quantise.AtLoadMethod.process_weights_after_loading

    def process(self, layer):
        done = [m for m in model_box[0].modules() if hasattr(m, "qweight") and m is not layer]
        still_float.append(sum(1 for m in done if m.weight.numel()
                               and m.weight is not layer.weight))
        return real(self, layer)

    model_box: list = []
    real_attach = quantise.QuantiseAtLoad.attach

    def attach(self, model):
        model_box.append(model)
        return real_attach(self, model)

    monkeypatch.setattr(quantise.AtLoadMethod, "process_weights_after_loading", process)
    monkeypatch.setattr(quantise.QuantiseAtLoad, "attach", attach)
    model = load_model(tiny_checkpoint("qwen3"), dtype="float32",
                       quantize=QuantSpec(kind, 32))
    assert len(still_float) > 8 and set(still_float) == {0}
    assert all(m.weight.numel() == 0 for m in model.modules() if hasattr(m, "qweight"))


def test_quantising_onto_a_gpu_stages_the_float_weights_in_host_memory(tiny_checkpoint,
                                                                     monkeypatch):
    """On a device other than the CPU (meta stands in for a GPU here) a float checkpoint's
    linear weights are read into host memory, each packed onto the device as its layer is
    done, and the rest (biases, float layers) moved there after: the card never holds the
    float model, only the quantised one (the float model of a model quantised to fit a card
    would not fit it). The embedding (a lookup, not staged) is packed where it lives."""
    from helexa.neuron.formats import quantise
    from helexa.neuron.models.layers import ParallelLinearBase

    where: list[tuple[str, str, str]] = []
    real = quantise.AtLoadMethod.process_weights_after_loading

    def process(self, layer):
        before = layer.weight.device.type
        real(self, layer)
        kind = "linear" if isinstance(layer, ParallelLinearBase) else "embedding"
        where.append((kind, before, layer.qweight.device.type))

    monkeypatch.setattr(quantise.AtLoadMethod, "process_weights_after_loading", process)
    model = load_model(tiny_checkpoint("qwen3"), device="meta", dtype="float32",
                       quantize=QuantSpec("int8", 32))
    assert ("linear", "cpu", "meta") in where and ("embedding", "meta", "meta") in where
    assert {w for w in where if w[0] == "linear"} == {("linear", "cpu", "meta")}
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_int8_scales_at_tp2_are_tp1s_for_a_float32_file_served_in_bf16(tiny_checkpoint, arch):
    """A row-parallel shard's int8 scales come from the whole row as the model holds it
    (rounded to bf16 first), so rank 0's are tp = 1's: its o_proj, down_proj and (MoE) each
    expert's down projection. From the file's fp32 rows ~1 in 4 scales differed."""
    from helexa.neuron.formats.loader import load_model

    src = tiny_checkpoint(arch)
    one = load_model(src, dtype="bfloat16", quantize=QuantSpec("int8"))
    two = load_model(src, dtype="bfloat16", quantize=QuantSpec("int8"), tp_rank=0, tp_size=2)
    layer1, layer2 = one.model.layers[0], two.model.layers[0]
    pairs = [(layer1.self_attn.o_proj.qscales, layer2.self_attn.o_proj.qscales)]
    if arch == "qwen3_moe":
        pairs.append((layer1.mlp.w2_qscales, layer2.mlp.w2_qscales))
    else:
        pairs.append((layer1.mlp.down_proj.qscales, layer2.mlp.down_proj.qscales))
    for a, b in pairs:
        assert torch.equal(a, b)


def test_quantised_experts_pick_their_kernels_at_load(tiny_checkpoint, monkeypatch):
    """A MoE block's grouped int8 experts run their op once at load (QuantExperts.prepare,
    from the executor's prepare), so its kernel choice (measured on CPU, probed and built on
    CUDA) happens then, not in the first request's step; int4 stacks need none."""
    from helexa.neuron.engine.model_runner import ModelRunner
    from helexa.neuron.formats.gguf.experts import QuantExperts

    calls: list[tuple[str, int]] = []
    real = QuantExperts.__call__

    def call(self, which, expert, x):
        calls.append((which, x.shape[0]))
        return real(self, which, expert, x)

    monkeypatch.setattr(QuantExperts, "__call__", call)
    for kind, want in (("int8", {("w13", 1), ("w13", 2), ("w2", 1), ("w2", 2)}), ("int4", set())):
        calls.clear()
        run = ModelRunner(tiny_checkpoint("qwen3_moe"), num_blocks=8, block_size=8,
                          max_num_seqs=4, max_batched_tokens=64, quantize=kind,
                          quant_group_size=32)
        try:
            assert set(calls) == want, (kind, calls)  # two MoE layers: each stack's op ran
        finally:
            run.close()
