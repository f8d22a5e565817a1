"""GGUF files of the hybrid and MoE families (llama.cpp's qwen35, qwen35moe, qwen3next,
qwen3moe), written from tiny checkpoints as llama.cpp's converter writes them: every
tensor helexa puts back equals gguf's own dequantize with the converter's transforms
undone, and greedy output matches transformers running those weights (alone, in a
batch of 8, at tp 1 and 2), config read from the file's metadata alone."""

from __future__ import annotations

import json

import pytest
import torch
from support.gguf_hybrid_reference import ARCH, qkvz_parts, reference_dir, write_hybrid_gguf
from support.greedy import greedy_generate

from helexa.checkpoint.gguf import config_from_metadata, metadata, reader
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.gguf.hybrid import as_float
from helexa.neuron.formats.gguf.names import tensor_pieces
from helexa.neuron.models.config import parse_model_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_moe"]
FUSED = "qwen3_5_moe-fused"  # experts as llama.cpp's --fuse-gate-up-exps writes them
TINY = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
        "num_layers": 4}
# Per layer: 0 mixes quantised types inside the fused in_proj (grouped int8 at 16 with
# zeros) and keeps Q4_K experts on the int4 op; 1 is all Q6_K (the flagship's file);
# 2 has a float part in in_proj (the layer goes float) and float experts; 3 is the full
# attention layer (q/k Q4_K beside a Q6_K v) of the hybrids.
LAYERS = [
    {"attn_qkv": "Q4_K", "attn_gate": "Q6_K", "ssm_beta": "Q8_0", "ssm_alpha": "Q8_0",
     "ssm_ba": "Q8_0", "ssm_out": "Q5_K", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K",
     "ffn_down_exps": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
     "attn_output": "Q8_0"},
    {},
    {"attn_qkv": "Q8_0", "attn_gate": "Q8_0", "ssm_beta": "F16", "ssm_alpha": "F16",
     "ssm_ba": "F16", "ssm_out": "BF16", "ffn_gate_exps": "F16", "ffn_up_exps": "F16",
     "ffn_down_exps": "BF16"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0"},
]
OTHERS = {"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "ffn_gate_shexp": "Q5_K",
          "ffn_up_shexp": "Q5_K", "ffn_down_shexp": "Q8_0", "ffn_gate_inp_shexp": "Q8_0"}


def type_of(name: str) -> str:
    if name.startswith("blk."):
        _, layer, part, _ = name.split(".")
        part = part.replace("gate_up_exps", "gate_exps")  # a fused stack: the gate's type
        return LAYERS[int(layer)].get(part, OTHERS.get(part, "Q6_K"))
    return {"token_embd": "Q6_K", "output": "Q8_0"}[name.split(".")[0]]



@pytest.fixture(scope="module")
def hybrid_gguf(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(family: str):
        """(GGUF file, transformers' reference folder, the weights it holds, source);
        a "-fused" family's experts are one ffn_gate_up_exps stack per layer."""
        if family not in made:
            src = tiny_checkpoint(family.removesuffix("-fused"), **TINY)
            base = tmp_path_factory.mktemp(f"gguf-{family}")
            weights = write_hybrid_gguf(src, base / "model.gguf", type_of,
                                        fuse_gate_up=family.endswith("-fused"))
            made[family] = (base / "model.gguf", reference_dir(src, base / "ref", weights),
                            weights, src)
        return made[family]

    return get


def runner(path, tp: int = 1) -> ModelRunner:
    return ModelRunner(path, num_blocks=256, block_size=8, max_num_seqs=8,
                       max_batched_tokens=512, dtype="float32", tp_size=tp, num_state_slots=8)


@pytest.mark.parametrize("family", [*FAMILIES, FUSED])
def test_every_tensor_is_gguf_dequantize_with_the_transforms_undone(hybrid_gguf, family):
    path, _, weights, _ = hybrid_gguf(family)
    ref = {k.replace("model.language_model.", "model."): v for k, v in weights.items()}
    arch = metadata(path, "general.architecture")
    c = json.loads((path.parent / "ref" / "config.json").read_text())
    c = {**c, **c.get("text_config", {})}
    seen = set()
    for t in reader(path).tensors:
        for name, value in tensor_pieces(t.name, t.tensor_type.name, t.data, arch, c):
            got = as_float(value).float()
            if arch == "qwen3next" and "linear_attn.in_proj_" in name and name.endswith(
                    ("qkv.weight", "z.weight")):  # the file's halves of in_proj_qkvz
                qkv, z = qkvz_parts(ref[name.replace(name.split(".")[-2], "in_proj_qkvz")], c)
                want = qkv if "qkv.weight" in name else z
                seen.add(name.replace(name.split(".")[-2], "in_proj_qkvz"))
            else:
                want = ref[name]
                seen.add(name)
            assert torch.equal(got, want.float()), name
    assert seen == set(ref), set(ref) ^ seen


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_metadata_is_the_checkpoints(hybrid_gguf, family):
    path, _, _, src = hybrid_gguf(family)
    ours = parse_model_config(config_from_metadata(path))
    theirs = parse_model_config(json.loads((src / "config.json").read_text()))
    assert ours.architecture.removesuffix("ForCausalLM") in theirs.architecture
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                  "rope", "layer_types", "rotary_dim", "attn_output_gate", "norm_offset",
                  "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "qk_norm"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ARCH[family] == metadata(path, "general.architecture")


@pytest.mark.parametrize("family", [*FAMILIES, FUSED])
def test_alone_matches_transformers(hybrid_gguf, greedy_reference, prompt_picker, family):
    path, ref, _, _ = hybrid_gguf(family)
    prompt = prompt_picker(ref, 3, 19)
    run = runner(path)
    if family != "qwen3_5":  # the experts' stacks: int4, grouped int8 and float ones
        kinds = {op for layer in run.model.model.layers if hasattr(layer.mlp, "experts_kernel")
                 for op, _, _ in (layer.mlp.experts_kernel.ops.values()
                                  if layer.mlp.experts_kernel else [])}
        assert kinds == {"int4", "int8g"}, kinds
    greedy_reference(ref, prompt, greedy_generate(run, [prompt], 40)[0])


@pytest.mark.parametrize(("family", "tp"), [
    ("qwen3_5", 1), ("qwen3_5", 2), ("qwen3_moe", 2),
    # the same paths as the three above (a hybrid's batch at tp 1, MoE stacks split at tp 2)
    pytest.param("qwen3_5_moe", 2, marks=pytest.mark.slow),
    pytest.param("qwen3_next", 1, marks=pytest.mark.slow)])
def test_batch_of_eight(hybrid_gguf, batch_and_alone, prompt_picker, family, tp):
    # tp = 2: rank processes over gloo, each loading its rows / columns, its value heads
    # and their groups; prefill in chunks over a shuffled pool; alone too
    path, ref, _, _ = hybrid_gguf(family)
    prompts = [prompt_picker(ref, 20 + i, 5 + 6 * i) for i in range(8)]
    run = runner(path, tp)
    batch_and_alone(run, ref, prompts, [40 - 3 * i for i in range(8)], prefill_chunk=9,
                    shuffle_seed=2)


def test_qwen35_pre_tokenizer_keeps_combining_marks_in_words(tiny_checkpoint, tmp_path):
    # Qwen3.5's files name the "qwen35" split: [\p{L}\p{M}]+ words, where Qwen2's
    # \p{L}+ would cut a combining mark off its letter
    from tokenizers import Tokenizer as HfTokenizer

    from helexa.neuron.formats.gguf.tokenizer import SPLIT_PATTERNS
    from helexa.neuron.tokenizer import Tokenizer

    src = tiny_checkpoint("qwen3_5", **TINY)
    write_hybrid_gguf(src, tmp_path / "model.gguf", type_of, pre="qwen35")
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = SPLIT_PATTERNS["qwen35"]
    want = HfTokenizer.from_str(json.dumps(spec))
    ours = Tokenizer.from_dir(tmp_path / "model.gguf")
    qwen2 = Tokenizer.from_dir(src)
    text = "cafe\u0301 nai\u0308ve re\u0301sume\u0301, plain words 123"
    assert ours.encode(text) == want.encode(text, add_special_tokens=False).ids
    pieces = [p for p, _ in ours._tok.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces == [p for p, _ in want.pre_tokenizer.pre_tokenize_str(text)]
    assert pieces != [p for p, _ in qwen2._tok.pre_tokenizer.pre_tokenize_str(text)]


def test_hf_config_and_tokenizer_beside_the_file(hybrid_gguf, tmp_path,
                                                 greedy_reference, prompt_picker):
    # Qwen3.5's config.json is the multimodal wrapper's (text under text_config): its text
    # model loads from the GGUF; no tokenizer metadata in the file, tokenizer.json beside it
    import shutil

    _, ref, _, src = hybrid_gguf("qwen3_5")
    write_hybrid_gguf(src, tmp_path / "model.gguf", type_of, tokenizer=False)
    for f in src.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    run = runner(tmp_path)
    assert run.model.cfg.architecture == "Qwen3_5ForConditionalGeneration"
    prompt = prompt_picker(ref, 5, 11)
    greedy_reference(ref, prompt, greedy_generate(run, [prompt], 40)[0])


def test_an_unsupported_type_in_an_expert_stack_is_refused_naming_it(tiny_checkpoint, tmp_path):
    from helexa.checkpoint.gguf import GgufError

    src = tiny_checkpoint("qwen3_5_moe", **TINY)
    write_hybrid_gguf(src, tmp_path / "model.gguf",
                      lambda name: "Q4_0" if name == "blk.2.ffn_down_exps.weight" else "Q8_0")
    with pytest.raises(GgufError, match=r"tensor 'blk.2.ffn_down_exps.weight' has type Q4_0, "
                                        r"which is not supported"):
        runner(tmp_path / "model.gguf")


def test_ssm_out_stays_quantised_only_when_a_value_head_is_whole_sub_blocks():
    from helexa.checkpoint.gguf_layout import stays_quantised

    cfg = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
    assert stays_quantised("qwen35", "ssm_out", "Q6_K", {**cfg, "linear_value_head_dim": 16})
    assert not stays_quantised("qwen35", "ssm_out", "Q8_0", {**cfg, "linear_value_head_dim": 16})
    # no reorder (Qwen3-Next, or as many value heads as key heads): nothing to move
    assert stays_quantised("qwen3next", "ssm_out", "Q8_0", {**cfg, "linear_value_head_dim": 16})
    assert stays_quantised("qwen35", "ssm_out", "Q8_0",
                           {"linear_num_key_heads": 4, "linear_num_value_heads": 4,
                            "linear_value_head_dim": 16})


@pytest.mark.parametrize("dim", [16, 32, 64])
def test_value_head_columns_move_on_the_unpacked_form_or_the_float(dim):
    # Q8_0's groups are 32 columns: heads of 32 or 64 move as whole groups (still
    # quantised), heads of 16 cut a group, so the weight is dequantised and then moved
    from support.gguf_reference import quantize

    from helexa.neuron.formats.gguf.hybrid import _columns, _grouped
    from helexa.neuron.formats.gguf.unpack import UNPACKERS, dequantize

    w = torch.randn(8, 2 * 3 * dim, generator=torch.Generator().manual_seed(dim))
    unpacked = UNPACKERS["Q8_0"](quantize(w.numpy(), "Q8_0"))
    moved = _columns(unpacked, 2, 3, dim)
    assert isinstance(moved, tuple) == (dim % 32 == 0)
    want = dequantize(*unpacked)[:, _grouped(2, 3, dim)]
    assert torch.equal(dequantize(*moved) if isinstance(moved, tuple) else moved, want)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_unpacked_parts_hold_memory_one_layer_at_a_time(hybrid_gguf, monkeypatch, family):
    """A quantised tensor loads through its unpacked form (int8 values, fp32 scales: ~1.25
    bytes a value, more than the op keeps). The form is made as its layer's tensors arrive
    and freed when the layer's op is installed, so loading never holds it for the whole
    model (on a GPU, where allocation commits, making all of it at attach held ~2x the
    served bytes at once: a 27B Q4_K file ~34 GB on its way to ~15 GB)."""
    from helexa.neuron.formats.gguf.format import Gguf
    from helexa.neuron.models import deferred

    def unpacked(model, real: bool) -> dict[str, int]:
        """Bytes of unpacked parts per layer ("model.layers.N") or top-level module."""
        out: dict[str, int] = {}
        for name, p in model.named_parameters():
            if ".gguf_" in name and p.is_meta != real:
                parts = name.split(".")
                group = ".".join(parts[:3] if parts[1] == "layers" else parts[:2])
                out[group] = out.get(group, 0) + p.numel() * p.element_size()
        return out

    seen: dict[str, object] = {"peak": 0}
    real_attach, real_real = Gguf.attach, deferred.real

    def attach(self, model):
        real_attach(self, model)
        seen["model"], seen["at_attach"] = model, unpacked(model, True)
        seen["sizes"] = unpacked(model, False)

    def made(module, name):
        p = real_real(module, name)
        seen["peak"] = max(seen["peak"], sum(unpacked(seen["model"], True).values()))
        return p

    monkeypatch.setattr(Gguf, "attach", attach)
    monkeypatch.setattr(deferred, "real", made)
    run = runner(hybrid_gguf(family)[0])
    sizes = seen["sizes"]
    assert seen["at_attach"] == {} and len(sizes) >= 5, sizes  # nothing real before loading
    assert 0 < seen["peak"] <= max(sizes.values()) < sum(sizes.values()) / 3
    assert not any(".gguf_" in n for n, _ in run.model.named_parameters())  # all installed


def test_a_gguf_moe_layer_on_a_cuda_decode_runs_the_gathered_form(hybrid_gguf, monkeypatch):
    """A layer whose expert stacks stay quantised (its w13 / w2 parameters are empty) counts
    its experts from the router: a CUDA decode step takes the gathered form, with no host
    sync, and answers as the CPU's one pass per chosen expert does. (Counted from the empty
    w13, the rule saw 0 experts and the masked form looped over none: only the shared
    expert was left.)"""
    from support.host_sync import NoHostSync

    from helexa.kernels import moe_experts

    run = runner(hybrid_gguf("qwen3_5_moe")[0])
    block = run.model.model.layers[0].mlp  # Q4_K / Q6_K stacks
    assert block.experts_kernel is not None and block.w13.numel() == 0
    e, k = block.gate.shape[0], block.top_k
    x = torch.randn(e // k, block.gate.shape[1], generator=torch.Generator().manual_seed(5))
    want = block(x)  # CPU: the looped form
    real, seen = moe_experts.choose_form, []

    def on_cuda(device_type, rows, top_k, experts, capturing=False, copies=3):
        form = real("cuda", rows, top_k, experts, capturing, copies)
        seen.append((experts, form))
        return form

    monkeypatch.setattr(moe_experts, "choose_form", on_cuda)
    with NoHostSync():
        got = block(x)
    assert seen == [(e, "gathered")]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
