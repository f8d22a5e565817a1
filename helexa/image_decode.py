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

`check_image(data, limits)` is the router's: everything above but the decode, so it
costs a header parse and, for a PNG, a walk over its chunks' checksums (Pillow's
`verify`), never a buffer of the image's pixels. A file that passes it and is still
corrupt (a JPEG cut short, a PNG whose compressed rows are damaged) is refused where it
is decoded, by the neuron, as the same 400.

Where the caller will shrink the image anyway (the neuron resizes every image to the
vision tower's at most ~1 M pixels), `decode_image(..., fit=(width, height))`, the size
it will be resized to, decodes a large one smaller: a JPEG at 1/2, 1/4 or 1/8 scale in libjpeg's own IDCT (`draft`), any image
then averaged down by a whole factor (`reduce`, in premultiplied alpha), and composited
on white at that size. It always keeps at least `REDUCING_GAP` times the final size on
each side, as Pillow's own `resize(reducing_gap=)` does; an image within that of its
final size is decoded exactly as without `fit`.

Decoding is CPU-bound (milliseconds to a second for a large photo): callers on an
event loop run it in a worker thread.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
              "image/webp": "WEBP", "image/gif": "GIF"}
FORMAT_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# A decode with `fit` keeps at least this many times the final size on each side (Pillow's
# resize(reducing_gap=2.0): the final resample then still averages 2x2 or more source
# pixels into one, which hides the box filter's and the scaled IDCT's differences).
REDUCING_GAP = 2.0
# Pixels composited onto white at a time, the GIL held meanwhile (~50 ms on a loaded core).
COMPOSITE_BAND_PIXELS = 1 << 20
# The modes `reduce` averages as they are (the others are converted first, as the tail would).
_REDUCIBLE = ("RGB", "RGBA", "L", "LA")


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


def check_image(data: bytes, limits: ImageLimits, media_type: str | None = None
                ) -> tuple[int, int]:
    """(width, height) of an image that passes every check short of decoding it: bytes,
    format (and the declared `media_type`), header pixels, aspect ratio, and Pillow's
    `verify` (a PNG's chunk checksums and its end: a file cut short is caught here)."""
    img = _open(data, limits)
    _check_type(img, media_type)
    size = img.size
    try:
        img.verify()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the {img.format} image is corrupt or truncated ({e})") from None
    return size


def decode_image(data: bytes, limits: ImageLimits, media_type: str | None = None,
                 fit: tuple[int, int] | None = None) -> Any:
    """The image as an RGB PIL.Image (first frame, transparency on white); media_type: the
    type the client declared for it, which must be the format Pillow finds (Anthropic's
    rule for a base64 source's `media_type`), else ImageError naming both. fit: the (width,
    height) the caller will resize it to; given, a large image comes back smaller, but at
    least REDUCING_GAP times that on each side."""
    from PIL import Image

    img = _open(data, limits)
    _check_type(img, media_type)
    if fit is not None and img.format == "JPEG":
        want = _gap_size(fit)
        if img.size[0] >= 2 * want[0] and img.size[1] >= 2 * want[1]:
            img.draft(None, want)  # decodes at the largest 1/2^k scale at least `want`
    try:
        with warnings.catch_warnings():  # max_pixels was checked from the header
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.seek(0)
            img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"the {img.format} image is corrupt or truncated ({e})") from None
    has_alpha = "A" in img.getbands() or "transparency" in img.info
    if fit is not None:
        img = _reduced(img, fit, has_alpha)
    return _on_white(img) if has_alpha else img.convert("RGB")


def _on_white(img: Any) -> Any:
    """`img` composited onto white, as Qwen's processor does (alpha_composite on an opaque
    white RGBA, then RGB), a band of rows at a time: Pillow holds the GIL through an
    alpha_composite (1.5 s for 33 M pixels on a loaded core, every other thread of the
    process stopped meanwhile, the neuron's event loop and Watch among them), and a
    pixel's result depends on that pixel alone, so the bands give the same image."""
    from PIL import Image

    rgba = img.convert("RGBA")
    width, height = rgba.size
    out = Image.new("RGB", rgba.size)
    rows = max(1, COMPOSITE_BAND_PIXELS // width)
    for top in range(0, height, rows):
        box = (0, top, width, min(height, top + rows))
        band = rgba.crop(box)
        white = Image.new("RGBA", band.size, (255, 255, 255, 255))
        out.paste(Image.alpha_composite(white, band).convert("RGB"), box)
    return out


def _check_type(img: Any, media_type: str | None) -> None:
    if media_type is not None and MIME_TYPES.get(media_type.lower()) != img.format:
        raise ImageError(f"the image was specified using the {media_type} media type, but "
                         f"the image appears to be an {FORMAT_MIME[img.format]} image")


def _gap_size(size: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(size[0] * REDUCING_GAP), math.ceil(size[1] * REDUCING_GAP)


def _reduced(img: Any, fit: tuple[int, int], has_alpha: bool) -> Any:
    """`img` (loaded) averaged down by the largest whole factor that keeps REDUCING_GAP
    times its fitted size on each side; itself where that factor is 1."""
    want = _gap_size(fit)
    factor = min(img.size[0] // want[0], img.size[1] // want[1])
    if factor < 2:
        return img
    if img.mode not in _REDUCIBLE:  # a palette's indices cannot be averaged
        img = img.convert("RGBA" if has_alpha else "RGB")
    return img.reduce(factor)  # LA and RGBA in premultiplied alpha, as resize does


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
