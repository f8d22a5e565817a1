"""The router's image parts (helexa/router/images.py): OpenAI image_url parts and Anthropic
image blocks become ImageParts in order among the text; resolving them decodes data: URLs
and base64 within the [images] limits, refusing with a 400 that names the part and the
limit; URLs are fetched only from allowed hosts; tokens are estimated as the neuron counts.
Decoding runs on the router's work pool as the caller's principal: a key holding its share
is 429 there while another key's images decode."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import pytest
from PIL import Image

from helexa.config.images import ImagesConfig
from helexa.proto import neuron_pb2 as pb
from helexa.router import anthropic, images
from helexa.router.errors import ApiError
from helexa.router.openai_api import parse_request
from helexa.router.work_pool import WorkPool


def png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def chat(*parts) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}


def img_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}


def resolve(req, **cfg) -> None:
    pool = WorkPool(1, 4)
    try:
        asyncio.run(images.resolve(req, ImagesConfig(**cfg), pool, "alice"))
    finally:
        pool.close()


def refusal(req, **cfg) -> ApiError:
    with pytest.raises(ApiError) as e:
        resolve(req, **cfg)
    assert e.value.status == 400
    return e.value


def test_openai_parts_keep_their_order_and_decode():
    req = parse_request(json.dumps(chat({"type": "text", "text": "a"}, img_part(data_url(png(40, 30))),
                                        {"type": "text", "text": "b"})).encode(), "chat")
    turn = req.messages[0]
    assert turn.content == "ab" and [type(p).__name__ for p in turn.parts] == [
        "str", "ImagePart", "str"]
    resolve(req)
    img = turn.parts[1]
    assert (img.width, img.height, img.param) == (40, 30, "messages[0].content[1].image_url")
    assert img.data == png(40, 30)
    vision = pb.VisionInput(pixels_per_token=32 * 32, min_pixels=64 * 64, max_pixels=1024 ** 2)
    assert images.estimated_tokens(req, vision) == 4 + 2  # min_pixels: 2 x 2 tokens, 2 markers


@pytest.mark.parametrize(("cfg", "data", "match"), [
    ({"max_pixels": 1000}, png(40, 30), "40 x 30 = 1200 pixels; at most 1000"),
    ({"max_bytes": 50}, png(40, 30), "at most 50 are accepted"),
    ({}, png(40, 30)[:60], "corrupt or truncated"),
    ({}, b"not an image at all", "not a PNG, JPEG, WebP or GIF"),
])
def test_limits_name_the_part(cfg, data, match):
    req = parse_request(json.dumps(chat({"type": "text", "text": "x"},
                                        img_part(data_url(data)))).encode(), "chat")
    e = refusal(req, **cfg)
    assert e.param == "messages[0].content[1].image_url" and match in e.message


def test_too_many_images_are_refused_before_any_is_decoded():
    parts = [img_part("data:image/png;base64,!!!not base64!!!")] * 17  # never decoded
    e = refusal(parse_request(json.dumps(chat(*parts)).encode(), "chat"))
    assert e.param == "messages" and "17 images; at most 16" in e.message
    bad = refusal(parse_request(json.dumps(chat(*parts[:1])).encode(), "chat"))
    assert "not valid base64" in bad.message


def test_urls_are_fetched_only_from_allowed_hosts():
    req = parse_request(json.dumps(chat(img_part("https://example.com/a.png"))).encode(), "chat")
    assert "does not fetch image URLs" in refusal(req).message
    e = refusal(req, fetch_urls=True, fetch_hosts=["images.example.org"])
    assert "not fetched from `example.com`" in e.message
    assert images.host_allowed("cdn.example.org", ["*.example.org"])
    assert not images.host_allowed("example.org.evil.com", ["*.example.org", "example.org"])


@pytest.mark.parametrize("later", [
    img_part("https://images.example.org/a.png"),  # a URL: not fetched, nor refused first
    img_part(data_url(b"x" * 200)),  # an image over max_bytes: not the one named
])
def test_the_first_failing_image_is_named_and_nothing_after_it_fetched(monkeypatch, later):
    fetched: list[str] = []
    real = images._fetch

    async def fetch(img, cfg):  # an allowed URL "fetched" without a network; others refused
        fetched.append(img.url)
        return png(8, 8) if cfg.fetch_urls else await real(img, cfg)
    monkeypatch.setattr(images, "_fetch", fetch)
    req = parse_request(json.dumps(chat(img_part("data:image/png;base64,!!!not base64!!!"),
                                        later)).encode(), "chat")
    for fetch_urls in (False, True):
        e = refusal(req, max_bytes=100, fetch_urls=fetch_urls,
                    fetch_hosts=["images.example.org"])
        assert e.param == "messages[0].content[0].image_url"
        assert "not valid base64" in e.message
    assert fetched == []


def test_anthropic_image_blocks():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(20, 20)).decode()}},
        {"type": "text", "text": "what?"}]}]}
    req = anthropic.parse_request(json.dumps(body).encode())
    resolve(req)
    part = req.messages[0].parts[0]
    assert (part.width, part.param) == (20, "messages[0].content[0].source")
    body["messages"][0]["content"][0]["source"] = {"type": "file", "file_id": "f"}
    with pytest.raises(ApiError, match="image sources of type `file`"):
        anthropic.parse_request(json.dumps(body).encode())
    body["messages"][0]["content"][0]["source"] = {"type": "base64", "media_type": "image/tiff",
                                                   "data": "AA=="}
    with pytest.raises(ApiError, match="image/tiff"):
        anthropic.parse_request(json.dumps(body).encode())


def test_responses_input_image_parts():
    from helexa.router import responses_api

    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"},
        {"type": "input_image", "image_url": data_url(png(24, 16)), "detail": "auto"}]}]}
    req = responses_api.parse_request(json.dumps(body).encode())
    turn = req.messages[0]
    assert turn.content == "a" and [type(p).__name__ for p in turn.parts] == ["str", "ImagePart"]
    resolve(req)
    assert (turn.parts[1].width, turn.parts[1].param) == (24, "input[0].content[1].image_url")
    e = refusal(responses_api.parse_request(json.dumps(body).encode()), max_per_request=0)
    assert e.param == "input" and "1 images; at most 0" in e.message
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}
    with pytest.raises(ApiError, match="file_id") as f:
        responses_api.parse_request(json.dumps(body).encode())
    assert f.value.param == "input[0].content[1].file_id"
    body["input"][0]["content"][1] = {"type": "input_video", "video_url": "x"}
    with pytest.raises(ApiError, match="video") as v:
        responses_api.parse_request(json.dumps(body).encode())
    assert v.value.param == "input[0].content[1].type"


def test_anthropic_tool_result_images():
    b64 = base64.b64encode(png(20, 12)).decode()
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "here:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}}]}]}]}
    req = anthropic.parse_request(json.dumps(body).encode())
    tool = req.messages[-1]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "t1", "here:")
    resolve(req)
    assert (tool.parts[1].width, tool.parts[1].param) == (
        20, "messages[2].content[0].content[1].source")
    body["messages"][2]["content"][0]["content"][1] = {"type": "document", "source": {}}
    with pytest.raises(ApiError, match="blocks of type `document` here") as e:
        anthropic.parse_request(json.dumps(body).encode())
    assert e.value.param == "messages[2].content[0].content[1].type"


def test_images_decode_on_the_work_pool_within_the_callers_share(monkeypatch):
    decoded_on: list[tuple[str, int]] = []
    real = images.check_image

    def spy(data, limits, media_type=None):
        decoded_on.append((threading.current_thread().name, pool.tasks_of("bob")))
        return real(data, limits, media_type)
    monkeypatch.setattr(images, "check_image", spy)
    req = parse_request(json.dumps(chat(img_part(data_url(png(8, 8))),
                                        img_part(data_url(png(9, 9))))).encode(), "chat")
    gate = threading.Event()
    pool = WorkPool(1, 4, per_principal=1)

    async def main() -> None:
        held = asyncio.ensure_future(pool.run("alice", gate.wait))  # alice holds her share
        await asyncio.sleep(0)  # its task submitted
        try:
            assert pool.tasks_of("alice") == 1
            with pytest.raises(ApiError) as e:
                await images.resolve(req, ImagesConfig(), pool, "alice")
            assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
            assert "limits.schema_per_principal" in e.value.message
            assert decoded_on == []  # refused before a byte was decoded
            gate.set()
            await held
            await images.resolve(req, ImagesConfig(), pool, "bob")
        finally:
            gate.set()
    try:
        asyncio.run(main())
    finally:
        pool.close()
    # On the pool's threads, one image a task, each counted as bob's.
    assert decoded_on == [("router-work-0", 1), ("router-work-0", 1)]
    sizes = [(p.width, p.height) for p in images.parts_of(req)]
    assert sizes == [(8, 8), (9, 9)] and pool.tasks == 0


def test_the_router_reads_an_images_header_never_its_pixels(monkeypatch):
    # Decoding a 144 KB PNG of 5792 x 5792 pixels only to learn its size took the router
    # from 63 MB to 690 MB and seconds of CPU: the size is in the header.
    from PIL import ImageFile

    def no_decode(self):
        raise AssertionError("the router decoded an image's pixels")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    jpeg, rgba = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (300, 200), (9, 9, 9)).save(jpeg, format="JPEG")
    Image.new("RGBA", (120, 80), (9, 9, 9, 9)).save(rgba, format="PNG")
    req = parse_request(json.dumps(chat(img_part(data_url(jpeg.getvalue(), "image/jpeg")),
                                        img_part(data_url(rgba.getvalue())))).encode(), "chat")
    resolve(req)
    assert [(p.width, p.height) for p in images.parts_of(req)] == [(300, 200), (120, 80)]
    # a PNG cut short is still refused here, from its chunks (a cut JPEG: by the neuron)
    cut = parse_request(json.dumps(chat(img_part(data_url(rgba.getvalue()[:-20])))).encode(),
                        "chat")
    assert "corrupt or truncated" in refusal(cut).message
