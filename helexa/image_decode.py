"""Decode one image a client sent, safely: the router and the neuron both use this.

`decode_image(data, limits)` returns a Pillow image in RGB, or raises ImageError saying
which limit the image broke. It never decodes more than it must to find out:
- the encoded size is checked before anything is parsed;
- the format is probed among PNG, JPEG, WebP and GIF only (Pillow's other plugins,
  some with a long history of parser bugs, are never tried), and where the client
  declared one (`media_type`) the one found must be it;
- width × height is read from the header and checked against `max_pixels` before a
  single pixel is decoded, so a decompression bomb (a few KB of PNG declaring
  50,000 × 50,000 pixels) costs a header parse; that check is the guard (its message
  names the limit), Pillow's own error past twice its MAX_IMAGE_PIXELS the backstop;
- a truncated or corrupt file fails in the decode (Pillow is not asked to pad it);
- an animated GIF or WebP gives its first frame;
- transparency is composited onto white, as Qwen's image processor does.

Decoding is CPU-bound (milliseconds to a second for a large photo): callers on an
event loop run it in a worker thread.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
              "image/webp": "WEBP", "image/gif": "GIF"}
FORMAT_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


class ImageError(ValueError):
    """The image cannot be used; the message says why (a limit, a format, corruption)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be."""

    max_bytes: int = 20 * 2**20  # encoded
    max_pixels: int = 8192 * 8192  # width × height as decoded
    max_aspect_ratio: float = 200.0  # Qwen's image processor refuses longer strips


def image_size(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) from the header alone, after the byte and format checks."""
    img = _open(data, limits)
    return img.size


def decode_image(data: bytes, limits: ImageLimits, media_type: str | None = None) -> Any:
    """The image as an RGB PIL.Image (first frame, transparency on white); media_type: the
    type the client declared for it, which must be the format Pillow finds (Anthropic's
    rule for a base64 source's `media_type`), else ImageError naming both."""
    from PIL import Image

    img = _open(data, limits)
    if media_type is not None and MIME_TYPES.get(media_type.lower()) != img.format:
        raise ImageError(f"the image was specified using the {media_type} media type, but "
                         f"the image appears to be an {FORMAT_MIME[img.format]} image")
    try:
        with warnings.catch_warnings():  # max_pixels was checked from the header
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.seek(0)
            img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the {img.format} image is corrupt or truncated ({e})") from None
    has_alpha = "A" in img.getbands() or "transparency" in img.info
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _open(data: bytes, limits: ImageLimits) -> Any:
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; at most {limits.max_bytes} are "
                         "accepted")
    try:
        with warnings.catch_warnings():  # max_pixels is checked below, naming the limit
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError("the image is not a PNG, JPEG, WebP or GIF file (or is corrupt)"
                         ) from None
    except Image.DecompressionBombError:
        raise ImageError(f"the image has more than {Image.MAX_IMAGE_PIXELS} pixels (Pillow's "
                         "decompression-bomb guard)") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"the image cannot be read ({e})") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width} x {height} pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"the image is {width} x {height} = {width * height} pixels; at most "
                         f"{limits.max_pixels} are accepted")
    if max(width, height) / min(width, height) > limits.max_aspect_ratio:
        raise ImageError(f"the image is {width} x {height} pixels: its aspect ratio is over "
                         f"{limits.max_aspect_ratio:g}")
    return img
