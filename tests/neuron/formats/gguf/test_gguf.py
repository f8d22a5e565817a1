"""GGUF checkpoints: unpacked bit-exactly against the gguf package's own ``dequantize``,
decoded as transformers decodes the same weights dequantised (alone, in a batch of 8,
at tp 1 and 2), config and tokenizer read from the file's metadata alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from support.gguf_reference import llama_cpp_permute, quantize, reference_dir, write_gguf
from support.greedy import greedy_generate

from helexa.checkpoint.gguf import GgufError, config_from_metadata
from helexa.checkpoint.gguf_layout import layout_of
from helexa.kernels import quant as qk
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.base import open_checkpoint
from helexa.neuron.formats.gguf.format import Gguf
from helexa.neuron.formats.gguf.names import unpermute
from helexa.neuron.formats.gguf.unpack import UNPACKERS, dequantize
from helexa.neuron.models.config import parse_model_config
from helexa.neuron.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_BYTES = {"Q8_0": 34, "Q6_K": 210, "Q5_K": 176, "Q4_K": 144}
SCALE_OFFSETS = {"Q8_0": (0,), "Q6_K": (208,), "Q5_K": (0, 2), "Q4_K": (0, 2)}
# Greedy models: every type in play. Layer 0 mixes types inside fused layers (q/k Q4_K with
# v Q6_K: grouped int8 at 16 with zeros), layer 1 is Q8_0 attention and float MLPs.
LAYER0 = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
LAYER1 = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
          "ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "BF16"}
TINY = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
        "num_layers": 2}


def type_of(name: str) -> str:
    if name.startswith("blk."):
        _, layer, part, _ = name.split(".")
        return (LAYER0 if layer == "0" else LAYER1)[part]
    return {"token_embd": "Q8_0", "output": "Q6_K"}[name.split(".")[0]]


def random_blocks(typ: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 scales: any such block is a valid one."""
    rng = np.random.default_rng(seed)
    nb = BLOCK_BYTES[typ]
    raw = rng.integers(0, 256, (rows, blocks * nb), dtype=np.uint8)
    flat = raw.reshape(-1, nb)
    for off in SCALE_OFFSETS[typ]:
        d = (rng.standard_normal(flat.shape[0]) * 0.01).astype(np.float16)
        flat[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


def op_weight(typ: str, raw: np.ndarray) -> torch.Tensor:
    """The float weight of the op helexa runs the tensor on, in fp32."""
    q, scale, zero = UNPACKERS[typ](raw)
    layout = layout_of([typ], rows=q.shape[0])
    if layout.op == "int4":
        return qk.dequantize_int4(q, scale, 8 * scale + zero, layout.group)
    return qk.dequantize_int8g(q, scale, zero, layout.group)


@pytest.mark.parametrize("typ", ["Q8_0", "Q6_K", "Q5_K", "Q4_K"])
def test_unpacking_is_bit_exact(typ):
    g = torch.Generator().manual_seed(7)
    from_weights = quantize((torch.randn(32, 512, generator=g) * 0.05).numpy(), typ)
    for raw in (random_blocks(typ, 32, 16 if typ == "Q8_0" else 2, 3), from_weights):
        ref = torch.from_numpy(gguf_dequantize(raw, T[typ]))
        assert torch.equal(dequantize(*UNPACKERS[typ](raw)), ref)  # w = q * scale + zero
        if typ != "Q4_K":  # grouped int8 holds the values themselves
            assert torch.equal(op_weight(typ, raw), ref)


def test_q4_k_on_the_int4_op_is_within_an_ulp_or_two():
    # tinygemm's (q - 8) * scale + zero rounds twice where Q4_K's d*q - m rounds once
    raw = random_blocks("Q4_K", 64, 4, 5)
    ref = torch.from_numpy(gguf_dequantize(raw, T.Q4_K))
    err = (op_weight("Q4_K", raw) - ref).abs()
    assert float(err.max()) <= 4 * float(torch.finfo(torch.float32).eps * ref.abs().max())


def test_unpermute_undoes_llama_cpp_permute():
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    for heads, kv in ((8, None), (8, 2)):
        n = heads if kv is None else kv
        assert np.array_equal(unpermute(llama_cpp_permute(w, heads, kv), n), w)


def test_an_unsupported_type_is_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3")
    write_gguf(src, tmp_path / "m.gguf",
               lambda name: "Q4_0" if name == "blk.1.ffn_down.weight" else "Q8_0")
    with pytest.raises(GgufError, match=r"m.gguf: tensor 'blk.1.ffn_down.weight' has type Q4_0"):
        ModelRunner(tmp_path / "m.gguf", num_blocks=8, block_size=8, max_num_seqs=1,
                    max_batched_tokens=64, dtype="float32")


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def gguf_models(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(arch: str, beside: bool = False, **kw):
        """(model path, transformers' reference folder, source checkpoint); ``beside``: the
        path is a folder holding the GGUF and the HF config and tokenizer files."""
        key = (arch, beside, tuple(sorted(kw.items())))
        if key not in made:
            src = tiny_checkpoint(arch, **TINY, **kw)
            base = tmp_path_factory.mktemp(f"gguf-{arch}")
            (base / "m").mkdir()
            deq = write_gguf(src, base / "m" / "model.gguf", type_of, tokenizer=not beside)
            path = base / "m" / "model.gguf"
            if beside:
                for f in src.glob("*.json"):
                    shutil.copy(f, base / "m" / f.name)
                path = base / "m"
            made[key] = (path, reference_dir(src, base / "ref", deq), src)
        return made[key]

    return get


def runner(path, tp: int = 1) -> ModelRunner:
    return ModelRunner(path, num_blocks=256, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", tp_size=tp)


@pytest.mark.parametrize(("arch", "beside"), [("qwen3", False), ("llama", True),
                                              ("qwen2", False)])
def test_greedy_matches_transformers_on_dequantised_weights(gguf_models, greedy_reference,
                                                            prompt_picker, arch, beside):
    # beside: a folder with the GGUF (no tokenizer metadata) and HF config/tokenizer files
    path, ref, _ = gguf_models(arch, beside)
    prompt = prompt_picker(ref, 3, 19)
    greedy_reference(ref, prompt, greedy_generate(runner(path), [prompt], 40)[0])


@pytest.mark.parametrize(("arch", "tp"), [("qwen3", 1), ("llama", 2)])
def test_batch_of_eight(gguf_models, batch_and_alone, prompt_picker, arch, tp):
    # tp = 2: rank processes over gloo, each loading its rows / columns and their groups
    # (llama: the un-permuted q/k rows split by head); alone too, to see both paths
    path, ref, _ = gguf_models(arch)
    prompts = [prompt_picker(ref, 20 + i, 5 + 6 * i) for i in range(8)]
    run = runner(path, tp)
    batch_and_alone(run, ref, prompts, [40 - 3 * i for i in range(8)], shuffle_seed=2)


def test_tied_embeddings(gguf_models, greedy_reference, prompt_picker):
    # no output tensor: the head runs the Q8_0 embedding table through the grouped int8 op
    path, ref, _ = gguf_models("qwen3", tie_word_embeddings=True)
    prompt = prompt_picker(ref, 8, 13)
    greedy_reference(ref, prompt, greedy_generate(runner(path), [prompt], 40)[0])


def test_config_and_tokenizer_from_metadata_alone(gguf_models):
    path, _, src = gguf_models("qwen3")
    assert not (path.parent / "config.json").exists()
    hf = json.loads((src / "config.json").read_text())
    ours, theirs = parse_model_config(config_from_metadata(path)), parse_model_config(hf)
    for field in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings", "qk_norm", "rope"):
        assert getattr(ours, field) == getattr(theirs, field), field
    a, b = Tokenizer.from_dir(src), Tokenizer.from_dir(path)
    for text in ("Hello world! It's 2026.\n\n  tabs\t and  spaces", "über straße 1234567 <|im_end|>"):
        assert b.encode(text) == a.encode(text)
        assert b.decode(a.encode(text)) == a.decode(a.encode(text))
    chat = [{"role": "user", "content": "hi <|im_end|> there"}]
    assert b.encode_chat(chat) == a.encode_chat(chat)
    assert a.eos_token_ids[0] in b.eos_token_ids


def test_groups_that_would_straddle_ranks_are_refused(tiny_checkpoint, tmp_path):
    from helexa.neuron.models.llama import LlamaForCausalLM

    src = tiny_checkpoint("qwen3")  # hidden 64: o_proj at tp = 4 has 16 inputs a rank
    write_gguf(src, tmp_path / "m.gguf", lambda name: "Q8_0", tokenizer=False)
    cfg = parse_model_config(json.loads((src / "config.json").read_text()))
    model = LlamaForCausalLM(cfg, tp_rank=0, tp_size=4)
    with pytest.raises(GgufError, match=r"o_proj: groups of 32 would straddle ranks: 64 input "
                                        r"features / tp=4 = 16 per rank"):
        Gguf(open_checkpoint(tmp_path / "m.gguf")).attach(model)
