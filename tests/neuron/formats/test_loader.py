"""The one load: config.json read once, the format detected without the models knowing,
an unknown quantisation refused by name, and ModelConfig agreeing with the plan's parse."""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helexa.checkpoint.shape import read_model_shape
from helexa.fixtures.tiny import ARCHS
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.formats.base import UnsupportedQuantization, open_checkpoint
from helexa.neuron.formats.loader import detect, load_model
from helexa.neuron.formats.quantise import QuantiseAtLoad, QuantSpec
from helexa.neuron.formats.unquantised import Unquantised

ROOT = Path(__file__).resolve().parents[3]


def test_a_load_reads_config_json_once(tiny_checkpoint, monkeypatch):
    model_dir = tiny_checkpoint("qwen3")
    reads: list[str] = []
    read_text = pathlib.Path.read_text

    def counting(self, *args, **kwargs):
        if self.name == "config.json":
            reads.append(str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    run = ModelRunner(model_dir, num_blocks=8, block_size=8, max_num_seqs=1,
                      max_batched_tokens=64, dtype="float32")
    run.close()
    assert reads == [str(model_dir / "config.json")]


def test_an_opened_checkpoint_is_not_read_again(tiny_checkpoint, tmp_path):
    for f in tiny_checkpoint("qwen3").iterdir():
        shutil.copy(f, tmp_path / f.name)
    ckpt = open_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    model = load_model(ckpt, dtype="float32")
    assert model.cfg is ckpt.config


def test_the_format_is_detected_from_the_checkpoint_and_the_request(tiny_checkpoint):
    ckpt = open_checkpoint(tiny_checkpoint("qwen3"))
    assert type(detect(ckpt)) is Unquantised
    assert type(detect(ckpt, QuantSpec("none"))) is Unquantised
    assert type(detect(ckpt, QuantSpec("int8"))) is QuantiseAtLoad


def test_an_unknown_quant_method_is_refused_naming_it(tiny_checkpoint, tmp_path):
    for f in tiny_checkpoint("qwen3").iterdir():
        shutil.copy(f, tmp_path / f.name)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedQuantization,
                       match=r"quant_method 'bitsandbytes' is not supported \(compressed-tensors "
                             r"pack-quantized, gptq and awq are\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_config_agrees_with_the_plans_parse(tiny_checkpoint, arch):
    ckpt = open_checkpoint(tiny_checkpoint(arch))
    cfg, shape = ckpt.config, read_model_shape(ckpt.raw)
    pairs = {"num_layers": "num_layers", "num_heads": "num_heads",
             "num_kv_heads": "num_kv_heads", "head_dim": "head_dim",
             "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
             "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
             "tie_word_embeddings": "tie_word_embeddings", "num_experts": "num_experts",
             "linear_num_key_heads": "linear_num_key_heads",
             "linear_num_value_heads": "linear_num_value_heads",
             "linear_key_head_dim": "linear_key_head_dim",
             "linear_value_head_dim": "linear_value_head_dim",
             "linear_conv_kernel_dim": "linear_conv_kernel_dim",
             "shared_expert_intermediate_size": "shared_expert_intermediate_size",
             "mtp_num_layers": "mtp_layers", "attn_output_gate": "attn_output_gate"}
    for ours, theirs in pairs.items():
        assert getattr(cfg, ours) == getattr(shape, theirs), ours
    full = sum(1 for t in cfg.layer_types if t == "full_attention") or cfg.num_layers
    assert full == shape.full_attention_layers


def test_the_models_import_no_checkpoint_format():
    for path in sorted((ROOT / "helexa" / "neuron" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("helexa.neuron.formats") for n in names), path.name


def test_the_gguf_tokenizer_loads_without_torch():
    # the daemon builds a GGUF model's tokenizer, and the daemon never imports torch
    code = ("import sys, helexa.neuron.formats.gguf.tokenizer, helexa.neuron.tokenizer; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
