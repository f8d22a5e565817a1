"""GPTQ checkpoints (4 and 8 bits, desc_act false and true): unpacked bit-exactly against a
reference written from the format's spec, decoded as transformers decodes the same
weights dequantised."""

from __future__ import annotations

import pytest
import torch
from support.gptq_reference import gptq_checkpoint, layer_tensors, pack_words

from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.engine.tp_messages import TpError
from helexa.neuron.formats.gptq import dequantize_gptq, unpack_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_packing_known_vector():
    # AutoGPTQ's pack(): value j of a word at bits 4j: 1..8 -> 0x87654321
    word = pack_words(torch.arange(1, 9).view(1, 8))
    assert word.item() == 0x87654321 - 2**32
    assert unpack_rows(word.view(1, 1), 8).flatten().tolist() == list(range(1, 9))
    # 8 bits: value j at bits 8j: 0x01, 0x80, 0xfe, 0x7f -> 0x7ffe8001
    word = pack_words(torch.tensor([[1, 128, 254, 127]]), 8)
    assert word.item() == 0x7FFE8001
    assert unpack_rows(word.view(1, 1), 4, 8).flatten().tolist() == [1, 128, 254, 127]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_unpacking_is_bit_exact(desc_act, sym, bits):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 128, generator=g)
    g_idx = torch.arange(128) // 32
    if desc_act:
        g_idx = g_idx[torch.randperm(128, generator=g)]
    tensors, ref = layer_tensors(w, 32, g_idx, sym, bits)
    q = unpack_rows(tensors["qweight"], 128, bits)
    zeros = unpack_rows(tensors["qzeros"].t(), 24, bits).t().to(torch.int16) + 1
    got = dequantize_gptq(q, zeros, tensors["scales"], tensors["g_idx"])
    assert torch.equal(got, ref)


@pytest.fixture(scope="module")
def gptq_dirs(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(desc_act: bool, sym: bool, bits: int = 4):
        if (desc_act, sym, bits) not in made:
            base = tmp_path_factory.mktemp(f"gptq{desc_act}{sym}{bits}")
            made[desc_act, sym, bits] = gptq_checkpoint(tiny_checkpoint("llama"), base / "q",
                                                        base / "ref", 32, desc_act, sym, bits)
        return made[desc_act, sym, bits]

    return get


def runner(model_dir, tp: int = 1) -> ModelRunner:
    return ModelRunner(model_dir, num_blocks=256, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", tp_size=tp)


@pytest.mark.parametrize(("desc_act", "sym", "tp", "bits"), [
    (False, True, 1, 4), (False, False, 1, 4), (True, False, 1, 4), (True, True, 1, 4),
    (False, False, 2, 4),
    # 8 bits: the grouped int8 op, a batch of 8 and alone at both tp
    (False, True, 1, 8), (True, False, 1, 8), (False, False, 2, 8),
    pytest.param(False, True, 2, 8, marks=pytest.mark.slow)])  # as (False, False, 2, 8), no zeros
def test_greedy_matches_transformers_on_dequantised_weights(gptq_dirs, batch_and_alone,
                                                            prompt_picker, desc_act, sym, tp,
                                                            bits):
    model_dir, ref = gptq_dirs(desc_act, sym, bits)
    prompts = [prompt_picker(ref, 40 + i, 6 + 5 * i) for i in range(8 if tp == 1 or bits == 8
                                                                    else 3)]
    run = runner(model_dir, tp)
    batch_and_alone(run, ref, prompts, 40, shuffle_seed=4)


def test_act_order_across_ranks_is_refused(gptq_dirs):
    model_dir, _ = gptq_dirs(True, False)
    with pytest.raises((TpError, ValueError), match="act-order with tensor parallelism"):
        runner(model_dir, 2).close()


@pytest.mark.parametrize(("desc_act", "sym"), [(False, True), (True, False)])
def test_8bit_layers_run_the_grouped_int8_op(gptq_dirs, desc_act, sym):
    from helexa.neuron.formats.loader import load_model
    from helexa.neuron.formats.methods import Int8gLinear

    model_dir, ref = gptq_dirs(desc_act, sym, 8)
    model, float_model = load_model(model_dir, dtype="float32"), load_model(ref, dtype="float32")
    ours = model.model.layers[0].mlp.down_proj
    theirs = float_model.model.layers[0].mlp.down_proj
    assert isinstance(ours.kernel, Int8gLinear) and ours.weight.numel() == 0
    assert ours.qweight.dtype == torch.int8
    assert hasattr(ours, "qzeros") != sym  # symmetric: every zero is 128, none stored
    assert (ours.kernel.perm is not None) == desc_act
    # the reference rounds (q - z) * s to fp16, the op keeps it fp32
    torch.testing.assert_close(ours.kernel.dequantized(), theirs.weight, rtol=1e-3, atol=0)
    x = torch.randn(3, ours.kernel.dequantized().shape[1])
    torch.testing.assert_close(ours(x), x @ ours.kernel.dequantized().t(), rtol=1e-5, atol=1e-5)


def test_8bit_layers_choose_their_decode_kernels_at_load(gptq_dirs, monkeypatch):
    from helexa.kernels.cpu import int8g as int8g_cpu
    from helexa.kernels.cpu import native as cpu_native

    monkeypatch.delenv("HELEXA_CPU_INT8G", raising=False)
    monkeypatch.setattr(int8g_cpu, "_choices", {})
    model_dir, _ = gptq_dirs(False, False, 8)
    run = runner(model_dir)  # no step run: only loading measured
    try:
        shapes = {tuple(m.qweight.shape) for m in run.model.modules()
                  if hasattr(m, "qweight") and m.qweight.dtype == torch.int8}
        measured = {(key[0], key[4]) for key in int8g_cpu._choices}
        fit = cpu_native.load() is not None and int8g_cpu.isas(cpu_native.load())
        # every shape at one row and at several; none measured without a native build
        assert measured == ({(s, b) for s in shapes for b in (False, True)} if fit else set())
    finally:
        run.close()


def test_a_packed_checkpoint_never_holds_its_float_weights(gptq_dirs, monkeypatch):
    """A GPTQ file replaces most linear weights by packed ones: the model is built with them
    on meta (models/deferred.py), so what is allocated before the format attaches its
    tensors is no more than the model serves with (on a GPU, CUDA allocates at build: a
    4-bit 32B model would otherwise need its ~64 GB float size to load)."""
    from helexa.neuron.formats import loader
    from helexa.neuron.formats.gptq import Gptq

    held: list[int] = []
    real_attach = Gptq.attach

    def attach(self, model):
        held.append(sum(t.numel() * t.element_size()
                        for t in [*model.parameters(), *model.buffers()] if not t.is_meta))
        return real_attach(self, model)

    monkeypatch.setattr(Gptq, "attach", attach)
    q_dir, ref_dir = gptq_dirs(False, True)
    model = loader.load_model(q_dir, dtype="float32")
    served = loader.weight_bytes(model)
    assert held and held[0] < served
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    # built as before, all float, the model held the float file's bytes at this point
    float_bytes = loader.weight_bytes(loader.load_model(ref_dir, dtype="float32"))
    assert held[0] < served < float_bytes


@pytest.mark.parametrize(("desc_act", "sym", "bits"), [(False, True, 4), (True, False, 8)])
def test_each_layer_packs_as_its_last_piece_loads(gptq_dirs, monkeypatch, desc_act, sym, bits):
    """A layer's unpacked parts (one byte a value, and its zeros and scales) hold memory
    from its first piece to its last, when it packs at once (methods.py PackAsLoaded): the
    load never holds every layer unpacked (on a GPU, where allocating commits, a 72B AWQ
    file held ~70 GB of them before the first packed, against ~42 GB served)."""
    from helexa.neuron.formats import loader
    from helexa.neuron.formats.gptq import _PARTS, Gptq, GptqMethod

    seen: dict[str, object] = {"model": None, "held": [], "in_finish": 0, "finishing": False}
    real_load, real_finish = Gptq.load, Gptq.finish
    real_pack = GptqMethod.process_weights_after_loading

    def unpacked_bytes() -> int:
        return sum(p.numel() * p.element_size() for m in seen["model"].modules()
                   for n, p in m._parameters.items()
                   if n in _PARTS and p is not None and not p.is_meta)

    def load(self, model, progress=None):
        seen["model"] = model
        return real_load(self, model, progress)

    def finish(self, model):
        seen["finishing"] = True
        return real_finish(self, model)

    def pack(self, layer):
        if "qzeros" in layer._parameters:  # a real packing, not a repeat
            seen["held"].append(unpacked_bytes())
            seen["in_finish"] += seen["finishing"]
        return real_pack(self, layer)

    monkeypatch.setattr(Gptq, "load", load)
    monkeypatch.setattr(Gptq, "finish", finish)
    monkeypatch.setattr(GptqMethod, "process_weights_after_loading", pack)
    q_dir, _ = gptq_dirs(desc_act, sym, bits)
    model = loader.load_model(q_dir, dtype="float32")
    layers = [m for m in model.modules() if getattr(m, "kernel", None) is not None]
    assert len(seen["held"]) == len(layers) > 4 and seen["in_finish"] == 0
    # at each packing only the layers in flight are unpacked (q/k/v until v_proj, around
    # o_proj; gate/up): under a third of the model's unpacked values alone
    assert max(seen["held"]) <= sum(_values(m) for m in layers) / 3
    assert unpacked_bytes() == 0


def _values(m) -> int:
    """A packed layer's weight values (its unpacked q's bytes), from its op's buffers."""
    if hasattr(m, "qscales_zeros"):  # int4: [G, N, 2] scales and zeros
        return m.kernel.n * m.qscales_zeros.shape[0] * m.kernel.group_size
    return m.qweight.numel()  # grouped int8 [N, K]
