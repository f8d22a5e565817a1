"""helexa/image_decode.py refuses what it should, fast, and says which limit: a truncated
PNG, a decompression bomb (refused from its header, before any pixel is decoded), too
many bytes or pixels, a format outside PNG/JPEG/WebP/GIF, a strip too long; it takes an
animated GIF's first frame."""

from __future__ import annotations

import io
import struct
import time
import zlib

import pytest
from PIL import Image

from helexa.image_decode import ImageError, ImageLimits, decode_image, image_size


def png(width: int, height: int, colour: tuple[int, int, int] = (10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height grey pixels, all zero: a few hundred KB
    that would decode to width x height bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    row = b"\0" * (width + 1)
    comp = zlib.compressobj(9)
    data = b"".join(comp.compress(row) for _ in range(min(height, 64))) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                              0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def test_a_plain_png_decodes_to_rgb():
    img = decode_image(png(30, 20), ImageLimits())
    assert (img.mode, img.size, img.getpixel((0, 0))) == ("RGB", (30, 20), (10, 200, 30))


def test_truncated_png_is_corrupt():
    data = png(300, 200)
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(data[: len(data) // 2], ImageLimits())


@pytest.mark.parametrize(("w", "h"), [(10_000, 10_000), (50_000, 50_000)])
def test_a_bomb_is_refused_from_its_header(w, h):
    data = bomb_png(w, h)
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match="pixels"):
        decode_image(data, ImageLimits(max_pixels=4096 * 4096))
    assert image_size(bomb_png(300, 200), ImageLimits()) == (300, 200)
    assert time.perf_counter() - t0 < 1.0  # a header parse, not a 100-megapixel decode


def test_bytes_pixels_format_and_aspect_limits_name_themselves():
    with pytest.raises(ImageError, match="at most 20 are accepted"):
        decode_image(png(30, 20), ImageLimits(max_bytes=20))
    with pytest.raises(ImageError, match="30 x 20 = 600 pixels; at most 599"):
        decode_image(png(30, 20), ImageLimits(max_pixels=599))
    with pytest.raises(ImageError, match="aspect ratio"):
        decode_image(png(1000, 4), ImageLimits())
    for fmt in ("BMP", "TIFF"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format=fmt)
        with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
            decode_image(buf.getvalue(), ImageLimits())
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"", ImageLimits())
    with pytest.raises(ImageError, match="not a PNG"):
        decode_image(b"GIF89a but not really", ImageLimits())


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    r, g, b = decode_image(buf.getvalue(), ImageLimits()).getpixel((8, 8))
    assert r > 200 and b < 50
