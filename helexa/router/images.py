"""Images in a request, on the router: where the client put each one, its bytes, and a 400
naming the part and the limit when it cannot be used.

The front ends (openai_api.py, anthropic.py, responses_api.py) leave an `ImagePart` among a turn's parts
for each image: a data: URL or base64 text still to decode, or an http(s) URL still to
fetch. `resolve(req, cfg, pool, principal)` then, before a neuron is chosen:
1. counts the request's images against `images.max_per_request` (nothing is decoded
   for a request that has too many);
2. takes the images in the request's order, each to its end before the next: checks a
   base64 image's length against `images.max_bytes` or fetches a URL where the
   operator allows it (`images.fetch_urls`, only the hosts in `images.fetch_hosts`, no
   redirects, `fetch_timeout_secs`, `max_bytes`), then turns base64 into bytes and
   checks the image without decoding its pixels (helexa/image_decode.py, `check_image`:
   format, which must be an Anthropic base64 source's declared `media_type`, header
   pixels against `images.max_pixels`, a PNG's chunk checksums and end) as one task on the router's work pool
   (work_pool.py), the caller's principal's: the event loop never waits on Pillow, and
   a key sending many large images has only its share of the pool's threads (429 past
   it, 503 when the pool is full) and takes its turn between the other principals'
   parses, an image at a time. The 400 therefore names the first image that fails,
   and no URL after it is fetched. Each image keeps its size for the router's token
   estimate.
The neuron receives the files themselves and decodes them, no larger than its vision
tower's resize needs, under its own limits; a file the header check passed and the decode
finds corrupt is its 400 (docs/errors.md, "The table"). Decoding here only to learn the size cost a
144 KB PNG of 5792 x 5792 pixels some 630 MB of the router's memory and seconds of CPU.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from helexa.config.images import ImagesConfig
from helexa.image_decode import MIME_TYPES, ImageError, ImageLimits, check_image
from helexa.proto import neuron_pb2 as pb
from helexa.router.errors import ApiError, bad_request, unsupported

if TYPE_CHECKING:
    from helexa.router.openai_api import ParsedRequest
    from helexa.router.work_pool import WorkPool

VIDEO_PART_TYPES = ("video_url", "video", "input_video")
_FETCH_CHUNK_BYTES = 1 << 16


@dataclass
class ImagePart:
    """One image of a request, from where the client put it to its bytes."""

    param: str  # where it is in the body: messages[0].content[1].image_url
    b64: str | None = None  # base64 text still to decode
    url: str | None = None  # an http(s) URL still to fetch
    media_type: str | None = None  # the type declared where it must match (Anthropic's base64)
    data: bytes = b""  # the file, once known
    width: int = 0  # once decoded
    height: int = 0


def from_url(url: str, param: str) -> ImagePart:
    """An OpenAI image_url's `url`: a base64 data: URL, or an http(s) URL to fetch."""
    if url.startswith("data:"):
        head, sep, body = url.partition(",")
        media, _, encoding = head[5:].partition(";")
        if not sep or encoding != "base64":
            raise bad_request(f"`{param}`: expected a data: URL of the form "
                              "data:image/png;base64,...", param)
        check_media_type(media, param)
        return ImagePart(param, b64=body)
    scheme = urlparse(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise bad_request(f"`{param}`: expected a data: URL or an http(s) URL, got a "
                          f"{scheme or 'relative'} URL", param)
    return ImagePart(param, url=url)


def check_media_type(media: str, param: str) -> None:
    if media.lower() not in MIME_TYPES:
        raise unsupported(param, f"images of type `{media or 'unspecified'}` (PNG, JPEG, "
                          "WebP and GIF are)")


def turns_field(req: ParsedRequest) -> str:
    """The body field holding the turns, as a refusal names it (Responses: `input`)."""
    return "input" if req.kind == "responses" else "messages"


def parts_of(req: ParsedRequest) -> Iterator[ImagePart]:
    for turn in req.messages or []:
        for part in turn.parts or []:
            if isinstance(part, ImagePart):
                yield part


async def resolve(req: ParsedRequest, cfg: ImagesConfig, pool: WorkPool,
                  principal: str) -> None:
    """Every image of `req` as bytes and a size, or the ApiError(400) of the first that fails;
    decoded on `pool` as `principal`'s work (its ApiError 429 or 503 where it refuses)."""
    images = list(parts_of(req))
    if not images:
        return
    if len(images) > cfg.max_per_request:
        field = turns_field(req)
        raise bad_request(f"`{field}`: {len(images)} images; at most {cfg.max_per_request} "
                          "are accepted per request", field)
    limits = ImageLimits(max_bytes=cfg.max_bytes, max_pixels=cfg.max_pixels)
    # In order, each image whole before the next: the first that fails is the one named,
    # and nothing after it is fetched; one task at a time, one place of the share.
    for img in images:
        if img.b64 is not None:
            _check_b64_size(img, cfg.max_bytes)
        elif img.url is not None:
            img.data = await _fetch(img, cfg)
        await pool.run(principal, _decode, img, limits)


def _check_b64_size(img: ImagePart, max_bytes: int) -> None:
    size = len(img.b64 or "") * 3 // 4
    if size > max_bytes + 3:  # refused before decoding a byte
        raise bad_request(f"`{img.param}`: the image is about {size} bytes; at most "
                          f"{max_bytes} are accepted", img.param)


def _decode(img: ImagePart, limits: ImageLimits) -> None:
    """On a worker: the image's bytes from its base64, then its size from its header."""
    if img.b64 is not None:
        try:
            img.data = base64.b64decode(img.b64.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"`{img.param}`: the image's base64 data is not valid base64",
                              img.param) from None
    try:
        img.width, img.height = check_image(img.data, limits, img.media_type)
    except ImageError as e:
        raise bad_request(f"`{img.param}`: {e}", img.param) from None


def host_allowed(host: str, allowed: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for a in allowed:
        a = a.lower().rstrip(".")
        if host == a or (a.startswith("*.") and host.endswith(a[1:])):
            return True
    return False


async def _fetch(img: ImagePart, cfg: ImagesConfig) -> bytes:
    import aiohttp

    url, param = img.url or "", img.param
    if not cfg.fetch_urls:
        raise bad_request(f"`{param}`: this server does not fetch image URLs; send the image "
                          "as a data: URL (base64)", param)
    host = urlparse(url).hostname or ""
    if not host_allowed(host, cfg.fetch_hosts):
        raise bad_request(f"`{param}`: images are not fetched from `{host}` (the hosts "
                          "allowed are the router's images.fetch_hosts)", param)
    timeout = aiohttp.ClientTimeout(total=cfg.fetch_timeout_secs)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise bad_request(f"`{param}`: fetching the image answered HTTP {resp.status}"
                                  + (" (redirects are not followed)"
                                     if 300 <= resp.status < 400 else ""), param)
            if (resp.content_length or 0) > cfg.max_bytes:
                raise _too_big(param, resp.content_length or 0, cfg.max_bytes)
            body = bytearray()
            async for chunk in resp.content.iter_chunked(_FETCH_CHUNK_BYTES):
                body += chunk
                if len(body) > cfg.max_bytes:
                    raise _too_big(param, len(body), cfg.max_bytes)
            return bytes(body)
    except TimeoutError:
        raise bad_request(f"`{param}`: fetching the image took over "
                          f"{cfg.fetch_timeout_secs:g} s", param) from None
    except aiohttp.ClientError as e:
        raise bad_request(f"`{param}`: the image could not be fetched ({e})", param) from None


def _too_big(param: str, size: int, limit: int) -> ApiError:
    return bad_request(f"`{param}`: the image is over {limit} bytes ({size} so far)", param)


def estimated_tokens(req: ParsedRequest, vision: pb.VisionInput) -> int:
    """Tokens the request's images take, as the neuron will count them (ModelStatus.vision:
    pixels per token and the model's resize bounds), to the nearest token."""
    total = 0
    for img in parts_of(req):
        pixels = min(max(img.width * img.height, vision.min_pixels), vision.max_pixels)
        total += math.ceil(pixels / max(1, vision.pixels_per_token)) + 2  # + the two markers
    return total


def check_model_takes_images(req: ParsedRequest, model: str, registry: Any
                             ) -> pb.VisionInput | None:
    """The model's VisionInput (how many tokens an image takes) where a READY neuron reports
    one; None where no neuron has it READY (the neuron decides); a 400 when it is READY
    and takes no images. Called only for requests with images."""
    ready = [m for link in registry.healthy_links()
             if (m := link.model_status(model)) is not None
             and m.state == pb.MODEL_STATE_READY]
    if not ready:
        return None
    vision: pb.VisionInput | None = next((m.vision for m in ready if m.HasField("vision")),
                                         None)
    if vision is None:
        field = turns_field(req)
        raise bad_request(f"`{field}`: `{req.model}` takes no images (it has no vision "
                          "tower); send text only", field)
    return vision
