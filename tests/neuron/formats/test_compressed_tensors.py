"""compressed-tensors pack-quantized checkpoints: unpacked bit-exactly, decoded as
transformers decodes the library's own dequantised weights, at TP = 1 and 2."""

from __future__ import annotations

import pytest
import torch
from support.ct_reference import compress, ct_checkpoint
from support.lazy_import import needs

from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.base import UnsupportedQuantization
from helexa.neuron.formats.compressed_tensors import (
    dequantize_ct,
    parse_ct_config,
    unpack_int32,
    unpack_zero_point,
)
from helexa.neuron.formats.loader import load_model
from helexa.neuron.formats.methods import Int8gLinear, Int8Linear

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), needs("compressed_tensors")]

SCHEMES = [(4, True, 32), (4, False, 64), (4, False, None), (4, True, None), (8, True, None),
           (8, True, 32), (8, False, 64), (8, False, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("bits", "sym", "group"), SCHEMES)
def test_unpacking_is_bit_exact(bits, sym, group, dtype):
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(bits), dtype=torch.float32)
    out, ref = compress(w.to(dtype), bits, sym, group)
    zp = None
    if "weight_zero_point" in out:
        zp = unpack_zero_point(out["weight_zero_point"], bits)[:40]
    stored = unpack_int32(out["weight_packed"], bits, 256)
    assert torch.equal(dequantize_ct(stored, out["weight_scale"], zp, bits), ref)


@pytest.fixture(scope="module")
def ct_dirs(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(bits: int, sym: bool, group: int | None):
        if (bits, sym, group) not in made:
            base = tmp_path_factory.mktemp(f"ct{bits}{sym}{group}")
            made[bits, sym, group] = ct_checkpoint(tiny_checkpoint("qwen3"), base / "ct",
                                                   base / "ref", bits, sym, group)
        return made[bits, sym, group]

    return get


@pytest.mark.parametrize(("bits", "sym", "group"), SCHEMES)
def test_loaded_layers_compute_with_the_dequantised_weights(ct_dirs, bits, sym, group):
    ct, ref = ct_dirs(bits, sym, group)
    model = load_model(ct, dtype="float32")
    float_model = load_model(ref, dtype="float32")  # norms folded: compare the unfolded o_proj
    ours, theirs = model.model.layers[1].self_attn.o_proj, float_model.model.layers[1].self_attn.o_proj
    assert ours.weight.numel() == 0 and ours.kernel is not None
    if bits == 8:  # per-channel symmetric: the per-row op; grouped or asymmetric: grouped int8
        assert isinstance(ours.kernel, Int8gLinear if group or not sym else Int8Linear)
    x = torch.randn(3, 64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert model.lm_head.kernel is None  # ignored: stays float


CASES = [(4, True, 32), (4, False, 32), (8, True, None), (8, True, 32), (8, False, 32)]


@pytest.mark.parametrize(("bits", "sym", "group", "tp"), [
    *[(*c, 1) for c in CASES], (4, False, 32, 2), (8, True, None, 2), (8, False, 32, 2),
    # at tp 2 the symmetric groups split as the asymmetric ones above do, zeros aside
    pytest.param(4, True, 32, 2, marks=pytest.mark.slow),
    pytest.param(8, True, 32, 2, marks=pytest.mark.slow)])
def test_greedy_matches_transformers_on_dequantised_weights(ct_dirs, batch_and_alone,
                                                            prompt_picker, bits, sym, group, tp):
    ct, ref = ct_dirs(bits, sym, group)
    grouped_int8 = bits == 8 and (group is not None or not sym)  # a batch of 8 at both tp
    prompts = [prompt_picker(ref, 30 + i, 6 + 5 * i)
               for i in range(8 if tp == 1 or grouped_int8 else 3)]
    run = ModelRunner(ct, num_blocks=256, block_size=8, max_num_seqs=8, max_batched_tokens=512,
                      dtype="float32", tp_size=tp)
    batch_and_alone(run, ref, prompts, 40, shuffle_seed=2)


def test_unsupported_schemes_are_refused():
    int8_group = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group",
                  "group_size": 128}
    scheme = parse_ct_config({"format": "pack-quantized", "config_groups": {"g": {
        "weights": int8_group}}})
    assert (scheme.num_bits, scheme.symmetric, scheme.group_size) == (8, False, 128)
    with pytest.raises(UnsupportedQuantization, match="expected int 4 or 8 bits"):
        parse_ct_config({"format": "pack-quantized", "config_groups": {"g": {"weights": {
            **int8_group, "num_bits": 2}}}})
    with pytest.raises(UnsupportedQuantization, match="expected format pack-quantized"):
        parse_ct_config({"format": "float-quantized", "config_groups": {"g": {}}})


def test_int8_groups_straddling_ranks_are_refused_with_the_numbers(ct_dirs):
    from helexa.neuron.engine.tp_messages import TpError

    ct, _ = ct_dirs(8, False, 64)  # o_proj: 64 inputs, 32 a rank at tp = 2
    with pytest.raises((TpError, ValueError),
                       match=r"groups of 64 would straddle ranks: 64 input features / tp=2 = 32"):
        ModelRunner(ct, num_blocks=8, block_size=8, max_num_seqs=1, max_batched_tokens=64,
                    dtype="float32", tp_size=2).close()
