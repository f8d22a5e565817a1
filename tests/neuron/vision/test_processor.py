"""The image processor (helexa/neuron/vision/) gives the tower exactly what transformers'
image processor gives it, for the checkpoint's own preprocessor_config.json and for
Qwen2-VL's defaults: the same patch grid and the same pixel values, bit for bit, whether
the image is upscaled to min_pixels, downscaled to max_pixels, grey, paletted or
transparent, and whatever format it came in."""

from __future__ import annotations

import io

import pytest
import torch
from support.vision import make_image

from helexa.image_decode import ImageLimits, decode_image
from helexa.neuron.vision.patches import pixel_patches, value_table
from helexa.neuron.vision.processor import ImageProcessor

SIZES = [(100, 70), (64, 64), (10, 12), (1500, 1100), (33, 900), (1024, 768)]


@pytest.fixture(scope="module")
def vision_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5", vision=True)


def _reference(config: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    return Qwen2VLImageProcessorPil(**config)


def _ours(proc: ImageProcessor, img) -> tuple[torch.Tensor, list[int]]:
    prepared = proc.prepare(img)
    return pixel_patches(prepared, proc, value_table(proc)), [1, prepared.grid_h, prepared.grid_w]


def _encoded(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return buf.getvalue()


@pytest.mark.parametrize("size", SIZES)
def test_checkpoint_processor_matches_transformers(vision_dir, size):
    import json
    raw = json.loads((vision_dir / "preprocessor_config.json").read_text())
    ref = _reference({k: v for k, v in raw.items()
                      if k not in ("image_processor_type", "processor_class")})
    proc = ImageProcessor.from_dir(vision_dir)
    img = make_image(*size, seed=sum(size))
    expected = ref(images=[img], return_tensors="pt")
    values, grid = _ours(proc, img)
    assert grid == expected["image_grid_thw"][0].tolist()
    assert proc.num_tokens(size[1], size[0]) == grid[1] * grid[2] // 4
    assert torch.equal(values, expected["pixel_values"])


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA"])
def test_defaults_and_colour_modes_match_transformers(mode):
    # Qwen2-VL's defaults (patch 14, CLIP mean and std): what a config that omits them gets
    ref = _reference({})
    proc = ImageProcessor.from_dict({})
    img = make_image(90, 61, seed=3, mode=mode)
    if mode == "P":
        img.info["transparency"] = 0
    expected = ref(images=[img], return_tensors="pt")
    decoded = decode_image(_encoded(img, "PNG"), ImageLimits())
    values, grid = _ours(proc, decoded)
    assert grid == expected["image_grid_thw"][0].tolist()
    assert torch.equal(values, expected["pixel_values"])


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_every_accepted_format_decodes_as_pillow_opens_it(vision_dir, fmt):
    from PIL import Image
    img = make_image(120, 80, seed=5)
    data = _encoded(img, fmt)
    ref = _reference({"size": {"shortest_edge": 64 * 64, "longest_edge": 1024 * 1024},
                      "patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    expected = ref(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    values, _ = _ours(ImageProcessor.from_dir(vision_dir), decode_image(data, ImageLimits()))
    assert torch.equal(values, expected["pixel_values"])


def test_legacy_min_max_pixels_keys_and_content_hash(vision_dir):
    proc = ImageProcessor.from_dict({"min_pixels": 3136, "max_pixels": 12544, "patch_size": 14})
    assert (proc.min_pixels, proc.max_pixels) == (3136, 12544)
    assert proc.target_size(1000, 1000) == (112, 112)
    ckpt = ImageProcessor.from_dir(vision_dir)
    a, b = make_image(100, 70, seed=1), make_image(100, 70, seed=2)
    assert ckpt.prepare(a).content_hash == ckpt.prepare(a.copy()).content_hash
    assert ckpt.prepare(a).content_hash != ckpt.prepare(b).content_hash
    with pytest.raises(ValueError, match="min_pixels"):
        ImageProcessor.from_dict({"min_pixels": 10, "max_pixels": 5})


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_large_image_decoded_small_keeps_its_full_sizes_tokens(vision_dir, fmt):
    # The neuron decodes an image no larger than twice what the processor resizes it to
    # (image_decode.py, `fit`); the grid, and so the prompt's tokens and the router's
    # estimate, stay those of the size the client sent; the pixels differ by rounding.
    import dataclasses

    from helexa.neuron.vision.prompt import VisionPrompt
    proc = ImageProcessor.from_dict({"min_pixels": 3136, "max_pixels": 12544,
                                     "patch_size": 16, "merge_size": 2})
    vp = dataclasses.replace(VisionPrompt.from_dir(vision_dir), processor=proc)
    from PIL import Image
    img = make_image(151, 99, seed=8).resize((1210, 790), Image.BILINEAR)  # smooth at 1/10
    data = _encoded(img, fmt)
    ours, whole = vp.prepare_one(data), proc.prepare(decode_image(data, ImageLimits()))
    assert (ours.grid_h, ours.grid_w, ours.num_tokens) == (whole.grid_h, whole.grid_w,
                                                          whole.num_tokens)
    assert proc.num_tokens(790, 1210) == ours.num_tokens
    diff = sum(abs(a - b) for a, b in zip(ours.pixels, whole.pixels, strict=True))
    assert diff / len(ours.pixels) < 2.0  # of 255
