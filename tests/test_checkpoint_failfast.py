"""Corrupt checkpoints fail at once with one line naming what is wrong, no traceback:
config.json asking for 1e9 layers, and GGUF files whose header counts or string lengths
point past the end of the file — from `helexa config check`, `helexa up` and the neuron."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from helexa.checkpoint.gguf import GgufError, check_header, reader
from helexa.checkpoint.shape import read_model_shape


def tiny_gguf(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def corrupt(path: Path, offset: int, value: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = value.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.fixture(params=["tensor_count", "metadata_kv_count", "key_length"])
def bad_gguf(request, tmp_path) -> tuple[Path, str]:
    path = tiny_gguf(tmp_path / "model.gguf")
    reader.cache_clear()
    if request.param == "tensor_count":
        return corrupt(path, 8, 10**15), "tensor_count 1,000,000,000,000,000 cannot fit"
    if request.param == "metadata_kv_count":
        return corrupt(path, 16, 2**62), "metadata_kv_count"
    return corrupt(path, 24, 2**40), "corrupt GGUF header"  # the first key's length


def test_a_corrupt_gguf_header_is_one_error_naming_it(bad_gguf):
    path, says = bad_gguf
    with pytest.raises(GgufError, match=says):
        reader(path)


def test_a_sound_gguf_passes_the_header_check(tmp_path):
    path = tiny_gguf(tmp_path / "ok.gguf")
    check_header(path)
    assert reader(path).get_field("qwen3.block_count") is not None


def helexa(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "helexa.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def neuron_toml(tmp_path: Path, model_path: Path) -> Path:
    path = tmp_path / "neuron.toml"
    path.write_text(f'[kv]\nkv_budget_mb = 1\n[[models]]\nid = "m"\npath = "{model_path}"\n')
    return path


def one_line_error(out: subprocess.CompletedProcess, says: str) -> None:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    assert says in out.stderr, out.stderr


# The three CLIs' handling is one path whatever field is corrupt (each catches the one
# GgufError the reader raises; which field says what is tested above, in process): by
# default one field, three interpreters; `-m slow` all three fields (~20 s of CPU each).
@pytest.mark.parametrize("bad_gguf", ["tensor_count", *(
    pytest.param(f, marks=pytest.mark.slow) for f in ("metadata_kv_count", "key_length"))],
    indirect=True)
def test_config_check_up_and_neuron_name_a_corrupt_gguf(bad_gguf, tmp_path):
    path, says = bad_gguf
    cfg = neuron_toml(tmp_path, path)
    one_line_error(helexa("config", "check", str(cfg)), says)
    one_line_error(helexa("up", "--model", str(path), "--start-timeout", "30", timeout=90), says)
    one_line_error(helexa("neuron", "--config", str(cfg), timeout=90), says)


def test_a_billion_layers_fails_at_once_naming_the_field(tiny_model_dir, tmp_path):
    model = tmp_path / "huge"
    shutil.copytree(tiny_model_dir, model)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1e9}))
    with pytest.raises(ValueError, match=r"num_hidden_layers: expected a whole number from 1 "
                                         r"to 4096, got 1000000000.0"):
        read_model_shape(model / "config.json")
    one_line_error(helexa("config", "check", str(neuron_toml(tmp_path, model))),
                   "num_hidden_layers")


def test_more_layers_than_the_tensors_hold_fails_naming_both(tiny_model_dir, tmp_path):
    model = tmp_path / "deep"
    shutil.copytree(tiny_model_dir, model)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 4000}))
    one_line_error(helexa("config", "check", str(neuron_toml(tmp_path, model))),
                   f"num_hidden_layers is 4,000, but the checkpoint's tensors hold "
                   f"{raw['num_hidden_layers']} layers")
