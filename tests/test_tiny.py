"""Tiny checkpoints load in transformers, tokenise any UTF-8, and are deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from helexa.cli import main as helexa_main
from helexa.fixtures.tiny import SPECIAL_TOKENS

SAMPLES = [
    "Hello, world! The quick brown fox.",
    "Zażółć gęślą jaźń — naïve café, Straße, 日本語のテキスト, العربية",
    "emoji 🙂🚀 family 👨‍👩‍👧 flag 🇵🇱 and a lone combining mark e\u0301",
    "def f(x: int) -> int:\n\treturn x ** 2  # square\n\n\n    if a != b: {}\r\n",
    "   leading and trailing spaces   ",
    "\x00\x7f control bytes \u2028 line separator",
]


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_loads_in_transformers_with_every_tensor_used(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, info = _load(path)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]
    names = set(load_file(path / "model.safetensors"))
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The harbour at dawn", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "qwen3_moe", "qwen3_5_moe"])
def test_hybrid_and_moe_load_in_transformers_with_every_tensor_used(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch, num_layers=4)
    model, info = _load(path)
    assert not any(info.values()), info
    assert type(model).__name__ == {"qwen3_5": "Qwen3_5ForCausalLM",
                                    "qwen3_next": "Qwen3NextForCausalLM",
                                    "qwen3_moe": "Qwen3MoeForCausalLM",
                                    "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[arch]
    names = set(load_file(path / "model.safetensors"))
    # Qwen3.5 ships as the multimodal wrapper, as Qwen/Qwen3.5-27B does (text model only here)
    wrapped = arch in ("qwen3_5", "qwen3_5_moe")
    assert ("model.language_model.embed_tokens.weight" in names) == wrapped
    assert any(".linear_attn." in n for n in names) == (arch != "qwen3_moe")
    assert any(".experts.3." in n for n in names) == (arch != "qwen3_5")


def test_greedy_choices_are_rarely_near_ties(tiny_model_dir):
    model, _ = _load(tiny_model_dir)
    ids = torch.arange(3, 259).reshape(4, 64)  # 256 positions of assorted tokens
    with torch.no_grad():
        top2 = model(ids).logits.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    assert (gap < 0.05).float().mean().item() < 0.10


def test_same_seed_same_weights_other_seed_other_weights(tiny_checkpoint, tmp_path):
    a = tiny_checkpoint("llama", seed=3)
    b = tiny_checkpoint("llama", seed=3, hidden_size=64)  # a distinct folder, same args
    assert a != b
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    c = tiny_checkpoint("llama", seed=4)
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_round_trips_utf8_emoji_and_code(tiny_model_dir, text):
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = raw.encode(text).ids
    assert raw.decode(ids, skip_special_tokens=False) == text
    assert hf(text).input_ids == ids  # transformers tokenises it the same way
    assert hf.decode(ids) == text


def test_special_tokens_chat_template_and_eos(tiny_model_dir):
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    special = {t: hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert sorted(special.values()) == list(range(cfg["vocab_size"] - 3, cfg["vocab_size"]))
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id in gen["eos_token_id"]
    assert hf("<|im_start|>user").input_ids[0] == special["<|im_start|>"]
    text = hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n")


def test_config_is_in_todays_format_or_the_legacy_one(tiny_checkpoint):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    new = json.loads((tiny_checkpoint("qwen3", rope_scaling=scaling) / "config.json").read_text())
    assert new["rope_parameters"] == {"rope_theta": 1000000.0, **scaling}
    assert "rope_theta" not in new and new["dtype"] == "float32"
    old_dir = tiny_checkpoint("qwen3", legacy_config=True, rope_scaling=scaling)
    old = json.loads((old_dir / "config.json").read_text())
    assert old["rope_theta"] == 1000000.0 and old["rope_scaling"] == scaling
    assert "rope_parameters" not in old and old["torch_dtype"] == "float32"
    model, info = _load(old_dir)
    assert not info["missing_keys"]
    assert model.config.rope_parameters["rope_theta"] == 1000000.0


def test_tied_embeddings_and_bf16(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", tie_word_embeddings=True, dtype="bfloat16")
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    model, info = _load(path)
    assert not info["missing_keys"]
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_cli_init_tiny(tmp_path, capsys):
    out = tmp_path / "m"
    rc = helexa_main(["model", "init-tiny", str(out), "--arch", "qwen2", "--hidden-size", "32",
                      "--layers", "1", "--vocab-size", "512", "--seed", "7"])
    assert rc == 0 and str(out) in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"]) == ("qwen2", 32, 1)
    with pytest.raises(SystemExit):
        helexa_main(["model", "init-tiny", str(out), "--heads", "4", "--kv-heads", "3"])


def test_cli_init_tiny_mtp_adds_a_head_and_leaves_the_target_as_it_was(tmp_path, tiny_checkpoint):
    out = tmp_path / "m"
    assert helexa_main(["model", "init-tiny", str(out), "--arch", "qwen3_next", "--mtp"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    with_head = load_file(out / "model.safetensors")
    plain = load_file(tiny_checkpoint("qwen3_next") / "model.safetensors")
    head = {k for k in with_head if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.experts.0.gate_proj.weight"} <= head
    assert set(with_head) - head == set(plain)
    assert all(torch.equal(with_head[k], plain[k]) for k in plain)
    with pytest.raises(SystemExit):
        helexa_main(["model", "init-tiny", str(tmp_path / "d"), "--arch", "qwen3", "--mtp"])


def test_vocab_beyond_what_the_corpus_teaches_keeps_spare_rows(tiny_checkpoint):
    path = tiny_checkpoint("llama", vocab_size=16384, hidden_size=32, num_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg["vocab_size"] == 16384 > len(tok)  # as Qwen's checkpoints have spare rows
    model, info = _load(path)
    assert not info["missing_keys"] and model.lm_head.weight.shape[0] == 16384
    assert tok.decode(tok("Straße 🚀").input_ids) == "Straße 🚀"
