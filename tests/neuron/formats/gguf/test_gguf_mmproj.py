"""A GGUF Qwen3.5 with llama.cpp's mmproj beside it serves images: both files written from
a tiny ``--vision`` checkpoint as llama.cpp's converter writes them, greedy tokens on an
image request equal the HF folder's, the processor's settings come from the mmproj's
metadata, and an mmproj of another projector or the wrong shapes is refused with one
line naming the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.gguf_hybrid_reference import write_hybrid_gguf
from support.mmproj_reference import write_mmproj
from support.vision import greedy_generate_images, hf_inputs, image_inputs, make_image

from helexa.checkpoint.gguf import GgufError, find_gguf, read_config
from helexa.checkpoint.mmproj import find_mmproj
from helexa.neuron.engine.model_runner import ModelRunner
from helexa.neuron.tokenizer import Tokenizer
from helexa.neuron.vision.processor import ImageProcessor

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def vl_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def gguf_pair(src, out, **mmproj):
    """The text GGUF and the mmproj beside it, from one tiny vision checkpoint (F32: the
    same weights as the folder's)."""
    out.mkdir(parents=True, exist_ok=True)
    write_hybrid_gguf(src, out / "model.gguf", lambda name: "F32")
    write_mmproj(src, out / "mmproj-model-f32.gguf", **mmproj)
    return out / "model.gguf"


def runner(path) -> ModelRunner:
    return ModelRunner(path, num_blocks=96, block_size=8, max_num_seqs=4,
                       max_batched_tokens=512, dtype="float32", num_state_slots=4)


@pytest.mark.parametrize("split_qkv", [False, True], ids=["qwen3vl", "split-qkv"])
def test_gguf_and_mmproj_answer_an_image_as_the_folder_does(vl_dir, tmp_path, split_qkv):
    model = gguf_pair(vl_dir, tmp_path / "gguf", split_qkv=split_qkv)
    images = [make_image(100, 70, 1)]  # 96 x 64 under either processor's pixel bounds
    prompt = hf_inputs(vl_dir, ASK, images)["input_ids"][0].tolist()
    ims = image_inputs(vl_dir, prompt, images)
    folder, ours = runner(vl_dir), runner(model)
    ref = greedy_generate_images(folder, [prompt], [ims], NEW_TOKENS)[0]
    assert greedy_generate_images(ours, [prompt], [ims], NEW_TOKENS)[0] == ref
    # the tower itself, parameter by parameter (a still image cannot tell the two time
    # frames of the patch kernel apart, so random patches check them too)
    theirs = dict(folder.model.visual.named_parameters())
    for name, p in ours.model.visual.named_parameters():
        assert torch.equal(p, theirs[name]), name
    patches = torch.randn(4 * 6, ours.model.visual.shape.patch_dim,
                          generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():  # equal weights; the kernels may sum in another order
        torch.testing.assert_close(ours.model.visual(patches, [(1, 4, 6)]),
                                   folder.model.visual(patches, [(1, 4, 6)]))
    # the neuron's prompt side takes images for the pair as for the folder
    ours_vision, folder_vision = Tokenizer.from_dir(model).vision, Tokenizer.from_dir(vl_dir).vision
    assert ours_vision is not None and folder_vision is not None
    assert ours_vision.shape == folder_vision.shape


def test_processor_settings_come_from_the_mmproj(vl_dir, tmp_path):
    pre = json.loads((vl_dir / "preprocessor_config.json").read_text())
    model = gguf_pair(vl_dir, tmp_path / "plain")
    proc = ImageProcessor.from_dir(model)
    assert proc is not None
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (16, 2, 2)
    assert proc.image_mean == tuple(pre["image_mean"]) and proc.image_std == tuple(pre["image_std"])
    assert (proc.min_pixels, proc.max_pixels) == (ImageProcessor().min_pixels,
                                                  ImageProcessor().max_pixels)
    bounded = gguf_pair(vl_dir, tmp_path / "bounded", pixel_bounds=True)
    proc = ImageProcessor.from_dir(bounded)
    assert proc is not None
    assert (proc.min_pixels, proc.max_pixels) == (pre["size"]["shortest_edge"],
                                                  pre["size"]["longest_edge"])
    # a preprocessor_config.json beside the files wins, as every HF file beside a GGUF does
    shutil.copy(vl_dir / "preprocessor_config.json", tmp_path / "plain")
    assert ImageProcessor.from_dir(model) == ImageProcessor.from_dir(vl_dir)


def test_the_mmproj_beside_the_model_is_found_and_is_not_the_model(vl_dir, tmp_path):
    model = gguf_pair(vl_dir, tmp_path / "m")
    assert find_mmproj(model) == tmp_path / "m" / "mmproj-model-f32.gguf"
    assert find_gguf(tmp_path / "m") == model  # the folder's one model, the mmproj aside
    with pytest.raises(GgufError, match="mmproj file holds a vision tower"):
        find_gguf(tmp_path / "m" / "mmproj-model-f32.gguf")
    shutil.copy(tmp_path / "m" / "mmproj-model-f32.gguf", tmp_path / "m" / "mmproj-other.gguf")
    with pytest.raises(GgufError, match="2 mmproj files .* --mmproj"):
        find_mmproj(model)
    (tmp_path / "t").mkdir()
    write_hybrid_gguf(vl_dir, tmp_path / "t" / "model.gguf", lambda name: "F32")
    assert find_mmproj(tmp_path / "t" / "model.gguf") is None
    assert "vision_config" not in read_config(tmp_path / "t" / "model.gguf")  # text only


@pytest.mark.parametrize(("override", "field"), [
    ({"projector": "mlp"}, "clip.projector_type is 'mlp', expected 'qwen3vl_merger'"),
    ({"projection_dim": 48}, "clip.vision.projection_dim is 48, expected 64"),
])
def test_an_mmproj_that_does_not_fit_is_refused_naming_the_file_and_field(
        vl_dir, tmp_path, override, field):
    model = gguf_pair(vl_dir, tmp_path / "bad", **override)
    with pytest.raises(GgufError) as e:
        read_config(model)
    assert str(e.value) == f"{tmp_path / 'bad' / 'mmproj-model-f32.gguf'}: {field}"


def test_an_mmproj_of_another_models_tower_is_refused_by_its_shapes(vl_dir, tiny_checkpoint,
                                                                   tmp_path):
    other = tiny_checkpoint("qwen3_5", vision=True, hidden_size=128)
    write_hybrid_gguf(vl_dir, tmp_path / "model.gguf", lambda name: "F32")
    write_mmproj(other, tmp_path / "mmproj-other.gguf", projection_dim=64)  # metadata fits
    with pytest.raises(GgufError) as e:
        read_config(tmp_path / "model.gguf")
    assert str(e.value) == (f"{tmp_path / 'mmproj-other.gguf'}: mm.2.weight shape is "
                            "(128, 128), expected (64, 128)")
