"""`helexa generate`: prints what transformers' greedy decode would; seeds reproduce."""

from __future__ import annotations

import pytest
import torch

from helexa.neuron.generate import main
from helexa.neuron.tokenizer import Tokenizer


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_greedy_text_matches_transformers(tiny_model_dir, capsys):
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    out = run(capsys, "--model", str(tiny_model_dir), "--prompt", "The quick brown fox",
              "--max-tokens", "12", "--ignore-eos")
    tok = Tokenizer.from_dir(tiny_model_dir)
    ids = tok.encode("The quick brown fox")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out == tok.decode(ref, skip_special_tokens=True) + "\n"


def test_chat_and_seeded_sampling_reproduce(tiny_model_dir, capsys):
    torch.set_num_threads(1)
    argv = ["--model", str(tiny_model_dir), "--prompt", "hi", "--chat", "--max-tokens", "10",
            "--temperature", "1.0", "--seed", "7", "--ignore-eos"]
    first = run(capsys, *argv)
    assert first.strip() and run(capsys, *argv) == first


def test_not_a_checkpoint(tmp_path, capsys):
    assert main(["--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
