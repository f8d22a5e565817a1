"""A checkpoint's image processor (preprocessor_config.json), without transformers.

Qwen2-VL's processor, which Qwen3-VL and Qwen3.5 use: an image is resized so both sides
are multiples of patch_size × merge_size and its area lies within [min_pixels,
max_pixels], keeping the aspect ratio as near as it can (`target_size`, transformers'
`smart_resize`); it is then cut into patch_size² patches, each repeated
temporal_patch_size times (an image is a one-frame video), and every merge_size² block
of patches becomes one image token in the language model.

`prepare` does the part that needs Pillow (resize, with the checkpoint's resample
filter, on 8-bit RGB as transformers' PIL backend does) and gives the engine a
`PreparedImage`: the resized pixels, the patch grid, the number of image tokens and a
content hash. Normalisation and the patch layout are torch, in the engine
(patches.py), so the float pixels are made where the tower runs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helexa.checkpoint.vision_shape import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    pixel_bounds,
    processor_settings,
)

# transformers' Qwen2VLImageProcessor defaults, for keys a preprocessor_config.json omits.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PreparedImage:
    """One image resized for the tower: what the engine needs of it."""

    pixels: bytes  # uint8 RGB, row-major [height, width, 3]
    grid_h: int  # patches down and across (before the spatial merge)
    grid_w: int
    num_tokens: int  # image tokens in the prompt: grid_h × grid_w / merge²
    content_hash: bytes  # of the resized pixels and grid: equal hashes give equal tokens

    def llm_grid(self, merge: int) -> tuple[int, int]:
        return self.grid_h // merge, self.grid_w // merge


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3  # PIL.Image.Resampling.BICUBIC

    @property
    def max_patches(self) -> int:
        """Patches of the largest image it makes: what one tower call holds at most."""
        return self.max_pixels // (self.patch_size * self.patch_size)

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessor | None:
        """The checkpoint's processor, or None when it has no preprocessor_config.json (nor,
        for a GGUF model, an mmproj beside it: its settings are the mmproj's)."""
        settings = processor_settings(model_dir)
        return None if settings is None else cls.from_dict(settings)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageProcessor:
        min_pixels, max_pixels = pixel_bounds(d)
        base = cls()
        out = cls(
            patch_size=int(d.get("patch_size", base.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(d.get("merge_size", base.merge_size)),
            min_pixels=min_pixels, max_pixels=max_pixels,
            image_mean=_triple(d.get("image_mean", base.image_mean)),
            image_std=_triple(d.get("image_std", base.image_std)),
            rescale_factor=float(d.get("rescale_factor", base.rescale_factor)),
            do_resize=bool(d.get("do_resize", True)), do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            resample=int(d.get("resample", base.resample)))
        if out.min_pixels > out.max_pixels:
            raise ValueError(f"preprocessor_config.json: min_pixels {out.min_pixels} > "
                             f"max_pixels {out.max_pixels}")
        return out

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image is resized to (transformers' smart_resize)."""
        f = self.factor
        if not self.do_resize:
            if height % f or width % f:
                raise ValueError(f"the image is {width} x {height}: without resizing both "
                                 f"sides must be multiples of {f}")
            return height, width
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def num_tokens(self, height: int, width: int) -> int:
        """Image tokens an image of this size becomes."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def fitted(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an image of this size is resized to; its own size when the
        processor does not resize (prepare then says why it cannot take it)."""
        if not self.do_resize:
            return width, height
        h, w = self.target_size(height, width)
        return w, h

    def prepare(self, image: Any, size: tuple[int, int] | None = None) -> PreparedImage:
        """An RGB PIL image (image_decode.decode_image's) resized for the tower; size: the
        (width, height) the image was sent at, where it was decoded smaller (`fitted` of
        that size is what it becomes)."""
        width, height = size or image.size
        h, w = self.target_size(height, width)
        # transformers resizes even to the same size: PIL then copies, the pixels stay
        resized = image.resize((w, h), resample=self.resample)
        pixels = resized.tobytes()
        grid_h, grid_w = h // self.patch_size, w // self.patch_size
        digest = hashlib.sha256(f"{grid_h}x{grid_w}:".encode())
        digest.update(pixels)
        return PreparedImage(pixels=pixels, grid_h=grid_h, grid_w=grid_w,
                             num_tokens=grid_h * grid_w // self.merge_size ** 2,
                             content_hash=digest.digest()[:16])


def _triple(v: Any) -> tuple[float, ...]:
    values = [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * 3
    if len(values) != 3:
        raise ValueError(f"preprocessor_config.json: expected 3 channel values, got {v!r}")
    return tuple(values)
