"""A quantised GGUF on CPU with dtype auto: its activation dtype measured and chosen
(helexa/neuron/activation.py, helexa/neuron/formats/gguf/activation.py)."""

from __future__ import annotations

import asyncio

import pytest
from support.gguf_reference import write_gguf

from helexa.config.schema import load_neuron_config
from helexa.neuron import activation
from helexa.neuron.engine.model_runner import ModelRunner, SeqInput
from helexa.neuron.formats.base import open_checkpoint
from helexa.neuron.formats.gguf import activation as measurer

TINY = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
        "num_layers": 2}


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory, tiny_checkpoint):
    path = tmp_path_factory.mktemp("act") / "tiny-q4.gguf"
    write_gguf(tiny_checkpoint("qwen3", **TINY), path,
               lambda name: "Q6_K" if name.startswith("output") else "Q4_K")
    return path


def entry_of(tmp_path, model, dtype="auto"):
    cfg_path = tmp_path / "n.toml"
    cfg_path.write_text(f'[[models]]\nid = "m"\npath = "{model}"\ndtype = "{dtype}"\n')
    cfg = load_neuron_config(cfg_path)
    return cfg, cfg.models[0], cfg_path


def test_bf16_is_chosen_only_when_it_saves_a_tenth_of_fp32s_step():
    near = activation.decide({"fp32": {"1": 1000.0, "8": 3000.0},
                              "bf16": {"1": 950.0, "8": 2800.0}})
    assert near.dtype == "fp32"  # 3750 is not under 0.9 x 4000: the exact scales stay
    assert near.status() == ("fp32 (measured on this CPU, a decode step at 1 row: fp32 "
                             "1.00 ms, bf16 0.95 ms; 8 rows: fp32 3.00 ms, bf16 2.80 ms)")
    fast = activation.decide({"fp32": {"1": 1000.0, "8": 3000.0},
                              "bf16": {"1": 700.0, "8": 2800.0}})
    assert fast.dtype == "bf16"


def test_only_an_auto_dtype_quantised_gguf_on_cpu_is_measured(tmp_path, q4_file,
                                                               tiny_model_dir):
    _, auto, path = entry_of(tmp_path, q4_file)
    assert activation.measured_gguf(auto, path, ["cpu"]) == q4_file
    assert activation.measured_gguf(auto, path, ["cuda:0"]) is None
    _, fixed, path = entry_of(tmp_path, q4_file, "fp32")
    assert activation.measured_gguf(fixed, path, ["cpu"]) is None
    _, st, path = entry_of(tmp_path, tiny_model_dir)
    assert activation.measured_gguf(st, path, ["cpu"]) is None  # safetensors


def test_a_16_bit_float_gguf_keeps_its_dtype_and_an_f32_one_is_measured(tmp_path,
                                                                          tiny_checkpoint):
    src = tiny_checkpoint("qwen3", **TINY)
    write_gguf(src, tmp_path / "f16.gguf", lambda name: "F16")
    cfg, entry, cfg_path = entry_of(tmp_path, tmp_path / "f16.gguf")
    assert asyncio.run(activation.choose(cfg, entry, cfg_path, ["cpu"])) is None
    write_gguf(src, tmp_path / "f32.gguf", lambda name: "F32")
    cfg, entry, cfg_path = entry_of(tmp_path, tmp_path / "f32.gguf")
    got = asyncio.run(activation.choose(cfg, entry, cfg_path, ["cpu"]))
    assert got is not None and got.why.startswith("measured on this CPU"), got


def test_a_failed_measurement_keeps_the_files_dtype_and_says_why(tmp_path, q4_file,
                                                                 monkeypatch):
    monkeypatch.setattr(activation, "MEASURER", "helexa.no_such_measurer")
    monkeypatch.setattr(activation, "_cache", {})
    cfg, entry, cfg_path = entry_of(tmp_path, q4_file)
    got = asyncio.run(activation.choose(cfg, entry, cfg_path, ["cpu"]))
    assert got is not None and got.dtype == "bf16"  # what the GGUF says
    assert "measuring fp32 against bf16 failed: the measurer exited with 1" in got.why


def test_the_measurer_times_both_dtypes_at_one_and_eight_rows(q4_file):
    got = measurer.measure(q4_file)
    assert got["layers"] == [2]  # a small file is timed whole
    for dtype in ("fp32", "bf16"):
        assert set(got[dtype]) == {"1", "8"} and all(us > 0 for us in got[dtype].values())
    assert activation.decide(got).dtype in ("fp32", "bf16")


def test_a_big_file_is_timed_by_its_first_layers(q4_file, monkeypatch):
    monkeypatch.setattr(measurer, "WHOLE_BYTES", 0)
    got = measurer.measure(q4_file)
    assert got["layers"] == [1, 2]  # one layer, then two: the rest and a layer's time
    assert all(us > 0 for d in ("fp32", "bf16") for us in got[d].values())


def test_a_truncated_model_holds_and_runs_only_its_first_layers(q4_file):
    ckpt = open_checkpoint(q4_file)
    whole = ModelRunner(ckpt, dtype="fp32", num_blocks=4, block_size=16, max_num_seqs=1,
                        max_batched_tokens=16)
    one = ModelRunner(measurer.truncated(ckpt, 1), dtype="fp32", num_blocks=4, block_size=16,
                      max_num_seqs=1, max_batched_tokens=16)
    try:
        assert len(one.model.model.layers) == 1 and len(whole.model.model.layers) == 2
        assert one.weight_bytes < whole.weight_bytes
        logits = one.execute([SeqInput([1, 2, 3], 0, [0], True)])
        assert logits.shape == (1, one.vocab_size) and bool(logits.isfinite().all())
    finally:
        one.close()
        whole.close()
