"""`helexa up --model x.gguf` finds llama.cpp's mmproj beside the model, or takes the one
`--mmproj FILE` names (linked beside the model in the run folder, where the neuron finds
it), and refuses an mmproj that does not fit in one line before starting anything."""

from __future__ import annotations

import pytest
from support.gguf_hybrid_reference import write_hybrid_gguf
from support.mmproj_reference import write_mmproj

from helexa.checkpoint.gguf import GgufError, read_config
from helexa.cli import up


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def test_the_mmproj_beside_the_model_is_found(vl_dir, tmp_path):
    write_hybrid_gguf(vl_dir, tmp_path / "model.gguf", lambda name: "F32")
    write_mmproj(vl_dir, tmp_path / "mmproj-model-f32.gguf")
    (tmp_path / "run").mkdir()
    served, mmproj = up.with_mmproj(tmp_path / "model.gguf", None, tmp_path / "run")
    assert (served, mmproj) == (tmp_path / "model.gguf", tmp_path / "mmproj-model-f32.gguf")
    assert "vision_config" in read_config(served)
    # a folder's model: the same
    assert up.with_mmproj(tmp_path, None, tmp_path / "run")[1] == mmproj


def test_a_named_mmproj_is_linked_beside_the_model(vl_dir, tmp_path):
    (tmp_path / "text").mkdir()
    write_hybrid_gguf(vl_dir, tmp_path / "text" / "model.gguf", lambda name: "F32")
    write_mmproj(vl_dir, tmp_path / "tower.gguf")  # not llama.cpp's name, not beside it
    (tmp_path / "run").mkdir()
    assert up.with_mmproj(tmp_path / "text" / "model.gguf", None, tmp_path / "run")[1] is None
    served, mmproj = up.with_mmproj(tmp_path / "text" / "model.gguf", tmp_path / "tower.gguf",
                                    tmp_path / "run")
    assert served == tmp_path / "run" / "model" / "model.gguf" and mmproj == tmp_path / "tower.gguf"
    assert read_config(served)["vision_config"]["depth"] == 2
    with pytest.raises(GgufError, match="is not a GGUF model"):
        up.with_mmproj(vl_dir, tmp_path / "tower.gguf", tmp_path / "run")


def test_up_refuses_an_mmproj_that_does_not_fit_in_one_line(vl_dir, tmp_path, capsys):
    write_hybrid_gguf(vl_dir, tmp_path / "model.gguf", lambda name: "F32")
    write_mmproj(vl_dir, tmp_path / "other.gguf", projector="mlp")
    code = up.main(["--model", str(tmp_path / "model.gguf"), "--mmproj",
                    str(tmp_path / "other.gguf"), "--device", "cpu", "--kv-budget-mb", "16"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"helexa up: {tmp_path / 'other.gguf'}: clip.projector_type is 'mlp', "
        "expected 'qwen3vl_merger'"]
