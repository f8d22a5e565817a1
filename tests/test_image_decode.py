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


def _encoded(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _smooth(width: int, height: int, mode: str) -> Image.Image:
    """Smooth colour with a gradient of transparency where the mode has alpha."""
    import numpy as np
    rng = np.random.RandomState(7)
    small = (rng.rand(height // 50, width // 50, 4) * 255).astype("uint8")
    return Image.fromarray(small, "RGBA").resize((width, height), Image.BILINEAR).convert(mode)


@pytest.mark.parametrize(("fmt", "mode"), [("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "P")])
def test_a_large_image_decodes_no_larger_than_its_resize_needs(fmt, mode):
    # The neuron resizes every image to at most ~1 M pixels: a 2400 x 1600 image it will
    # make 300 x 200 is decoded at 600 x 400 (REDUCING_GAP x), not whole, and resizes to
    # nearly the same pixels as the whole image would.
    from helexa.image_decode import REDUCING_GAP
    data = _encoded(_smooth(2400, 1600, mode), fmt)
    fit = (300, 200)
    small = decode_image(data, ImageLimits(), fit=fit)
    assert small.size == (int(300 * REDUCING_GAP), int(200 * REDUCING_GAP)) and small.mode == "RGB"
    whole = decode_image(data, ImageLimits())
    assert whole.size == (2400, 1600)
    a, b = (im.resize(fit, Image.BICUBIC).tobytes() for im in (small, whole))
    assert sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a) < 2.0  # of 255


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_an_image_near_its_resize_decodes_as_without_fit(fmt):
    data = _encoded(_smooth(500, 400, "RGBA" if fmt == "PNG" else "RGB"), fmt)
    assert decode_image(data, ImageLimits(), fit=(300, 240)).tobytes() == \
        decode_image(data, ImageLimits()).tobytes()


def test_transparency_is_composited_a_band_at_a_time(monkeypatch):
    # Pillow holds the GIL through an alpha_composite: a whole 33 M pixel image held every
    # other thread of the neuron (its event loop, Watch) for a second or more.
    from helexa import image_decode
    sizes: list[int] = []
    real = Image.alpha_composite

    def spy(a, b):
        sizes.append(a.size[0] * a.size[1])
        return real(a, b)
    monkeypatch.setattr(Image, "alpha_composite", spy)
    monkeypatch.setattr(image_decode, "COMPOSITE_BAND_PIXELS", 600 * 50)
    img = _smooth(600, 430, "RGBA")
    got = decode_image(_encoded(img, "PNG"), ImageLimits())
    assert len(sizes) == 9 and max(sizes) <= 600 * 50  # 430 rows, 50 a band
    expected = real(Image.new("RGBA", img.size, (255, 255, 255, 255)), img).convert("RGB")
    assert got.tobytes() == expected.tobytes()  # the same pixels as in one piece
