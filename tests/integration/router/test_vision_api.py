"""Images end to end: real `helexa neuron` and `helexa router` processes on loopback serving
the tiny Qwen3.5 with its vision tower (`vl`) beside a text-only model (`text`).

The openai SDK sends a data: URL (chat, and an input_image in Responses) and the
anthropic SDK a base64 block, and all get answers whose prompt counts the image's tokens; a loopback HTTP server's image is
fetched when its host is allowed and a disallowed host is a 400; hostile images (a
decompression bomb, a truncated PNG, 10,000 × 10,000 pixels, 100 images, a video part)
are refused 400 naming the part while another client's requests are served, and the
pool is whole afterwards."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2
import openai
import pytest
import tomli_w
from router_procs import TOKEN, start_router, wait_for
from support.lazy_import import Lazy
from support.neuron import NeuronClient, ledger_whole, start_neuron, write_neuron_config
from support.vision import make_image

anthropic = Lazy("anthropic")


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def grey_png(width: int, height: int, rows: int | None = None) -> bytes:
    """A black greyscale PNG declaring width x height: every row (a whole, valid image,
    small for its size), or only the first `rows` (a decompression bomb: the header
    promises far more than the file holds). The rows are deflated a block at a time, one
    block compressed once and repeated (a full flush makes each block stand alone), so a
    100-megapixel image takes milliseconds to make."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    n = height if rows is None else rows
    per_block = max(1, min(n, 2**20 // (width + 1)))
    block_raw = b"\0" * ((width + 1) * per_block)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(block_raw) + comp.flush(zlib.Z_FULL_FLUSH)
    full, rest = divmod(n, per_block)
    tail = comp.compress(b"\0" * ((width + 1) * rest)) + comp.flush()  # the final block
    adler = 1
    for _ in range(full):
        adler = zlib.adler32(block_raw, adler)
    adler = zlib.adler32(b"\0" * ((width + 1) * rest), adler)
    data = b"\x78\xda" + block * full + tail + struct.pack(">I", adler)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                              0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


class _Images(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    _Images.body = png(make_image(100, 70, 21))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint, tiny_model_dir) -> Iterator[tuple[str, str]]:
    d = tmp_path_factory.mktemp("vision-int")
    (d / "token").write_text(TOKEN + "\n")
    neuron = start_neuron(write_neuron_config(d / "nv.toml", {
        "server": {"name": "nv", "listen": "127.0.0.1:0", "token_file": "token",
                   "heartbeat_secs": 1.0},
        "engine": {"torch_threads": 1, "max_slots": 4},
        "kv": {"kv_budget_mb": 4, "activation_headroom_mb": 0},
        "models": [{"id": "vl", "path": str(tiny_checkpoint("qwen3_5", vision=True))},
                   {"id": "text", "path": str(tiny_model_dir)}]}), log_path=d / "nv.log")
    (d / "router.toml").write_text(tomli_w.dumps({
        "server": {"listen": "127.0.0.1:0", "max_body_bytes": 8 * 2**20},
        "neurons": {"token_file": "token", "endpoints": [{"name": "nv",
                                                          "address": neuron.address}]},
        "images": {"fetch_urls": True, "fetch_hosts": ["127.0.0.1"], "max_per_request": 8,
                   "max_pixels": 4096 * 4096}}))
    router = start_router(d / "router.toml")
    try:
        wait_for(lambda: len(httpx2.get(router.url + "/v1/models").json()["data"]) == 2, 30)
        yield router.url, neuron.address
    finally:
        router.stop()
        neuron.stop(timeout_secs=15)


@functools.cache
def oa(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(url: str, *parts, model: str = "vl", **kw):
    return oa(url).chat.completions.create(
        model=model, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}], **kw)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(url: str, *parts, model: str = "vl") -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        ask(url, *parts, model=model)
    return e.value


def test_models_say_which_take_images(stack):
    url, _ = stack
    modalities = {m["id"]: m["input_modalities"]
                  for m in httpx2.get(url + "/v1/models").json()["data"]}
    assert modalities == {"vl": ["text", "image"], "text": ["text"]}


def test_openai_sdk_data_url_and_anthropic_sdk_base64(stack):
    url, _ = stack
    img = png(make_image(100, 70, 22))  # 96 x 64 after resizing: 6 image tokens
    with_image = ask(url, image_part(data_url(img)))
    without = ask(url)
    assert with_image.choices[0].message.content is not None
    assert with_image.usage.prompt_tokens == without.usage.prompt_tokens + 6 + 2  # + markers
    streamed = ask(url, image_part(data_url(img)), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        with_image.choices[0].message.content  # greedy, the same tokens streamed or not
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    m = a.messages.create(model="vl", max_tokens=6, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(img).decode()}}]}])
    assert m.content[0].text == with_image.choices[0].message.content
    assert m.usage.input_tokens == with_image.usage.prompt_tokens
    counted = a.messages.count_tokens(model="vl", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(img).decode()}}]}])
    assert counted.input_tokens == m.usage.input_tokens


def test_a_declared_type_the_bytes_are_not_is_refused_on_anthropic_served_on_openai(stack):
    url, _ = stack
    img = png(make_image(100, 70, 22))
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's 400: PNG sent as JPEG
        a.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": base64.b64encode(img).decode()}}]}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error"
    assert "messages[0].content[1].source" in err["message"]
    assert "image/jpeg media type" in err["message"] and "an image/png image" in err["message"]
    # OpenAI reads a data: URL's bytes whatever MIME type it declares, and so does helexa
    mislabelled = "data:image/jpeg;base64," + base64.b64encode(img).decode()
    assert ask(url, image_part(mislabelled)).usage.prompt_tokens == \
        ask(url, image_part(data_url(img))).usage.prompt_tokens


def test_image_jpg_is_refused_on_anthropic_and_served_on_openai(stack):
    # Anthropic's media_type is one of four exactly (its SDK's Literal; the API's 400 says
    # "Input should be 'image/jpeg', ..."); OpenAI reads a data: URL's bytes, and clients
    # commonly label a JPEG `data:image/jpg`: served on chat and Responses
    url, _ = stack
    buf = io.BytesIO()
    make_image(100, 70, 22).save(buf, format="JPEG", quality=90)
    jpeg = base64.b64encode(buf.getvalue()).decode()
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    for media in ("image/jpg", "IMAGE/JPEG"):
        with pytest.raises(anthropic.BadRequestError) as e:
            a.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "source": {"type": "base64", "media_type": media,
                                             "data": jpeg}}]}])
        err = e.value.body["error"]
        assert err["type"] == "invalid_request_error", err
        assert "`messages[0].content[1].source.media_type`: Input should be 'image/jpeg', " \
            "'image/png', 'image/gif' or 'image/webp'" in err["message"], err
    jpeg_tokens = ask(url, image_part("data:image/jpeg;base64," + jpeg)).usage.prompt_tokens
    assert ask(url, image_part("data:image/jpg;base64," + jpeg)).usage.prompt_tokens == \
        jpeg_tokens
    r = oa(url).responses.create(model="vl", max_output_tokens=4, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                    {"type": "input_image",
                                     "image_url": "data:image/jpg;base64," + jpeg}]}])
    assert r.usage.input_tokens == jpeg_tokens


def test_openai_sdk_responses_input_image(stack):
    url, _ = stack
    img = png(make_image(100, 70, 22))
    # `detail: original` is OpenAI's fourth value (its SDK's ImageDetail): served, ignored
    chat = ask(url, {"type": "image_url", "image_url": {"url": data_url(img),
                                                        "detail": "original"}})
    r = oa(url).responses.create(model="vl", max_output_tokens=6, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                    {"type": "input_image", "image_url": data_url(img),
                                     "detail": "original"}]}])
    assert r.output_text == chat.choices[0].message.content  # the same prompt, greedy
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_anthropic_sdk_image_in_a_tool_result(stack):
    url, _ = stack
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    img = base64.b64encode(png(make_image(100, 70, 22))).decode()  # 6 image tokens

    def turns(*result):
        return [{"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "here"},
                                                          *result]}]}]
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": img}}
    with_image = a.messages.create(model="vl", max_tokens=4, messages=turns(shot))
    without = a.messages.create(model="vl", max_tokens=4, messages=turns())
    assert with_image.usage.input_tokens == without.usage.input_tokens + 6 + 2  # + markers


def test_openai_sdk_responses_image_in_a_tool_output(stack):
    # codex's view_image answers with the picture as the call's output: the model sees it
    # in the tool turn (its image tokens counted), as an Anthropic tool_result's
    url, _ = stack
    img = data_url(png(make_image(100, 70, 22)))  # 6 image tokens

    def turns(*output):
        return [{"role": "user", "content": "Look at a.png."},
                {"type": "function_call", "call_id": "c1", "name": "view_image",
                 "arguments": '{"path": "a.png"}'},
                {"type": "function_call_output", "call_id": "c1", "output": [
                    {"type": "input_text", "text": "a.png"}, *output]}]
    shot = {"type": "input_image", "image_url": img, "detail": "high"}
    with_image = oa(url).responses.create(model="vl", max_output_tokens=4, input=turns(shot))
    without = oa(url).responses.create(model="vl", max_output_tokens=4, input=turns())
    assert with_image.usage.input_tokens == without.usage.input_tokens + 6 + 2  # + markers


def test_openai_sdk_chat_image_in_a_tool_message(stack):
    # agents on chat completions (an MCP screenshot tool) answer a call with image parts
    url, _ = stack
    img = data_url(png(make_image(100, 70, 22)))  # 6 image tokens

    def turns(*result):
        return [{"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "shot", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1",
                 "content": [{"type": "text", "text": "here"}, *result]}]
    chat = oa(url).chat.completions
    with_image = chat.create(model="vl", max_tokens=4, messages=turns(image_part(img)))
    without = chat.create(model="vl", max_tokens=4, messages=turns())
    assert with_image.usage.prompt_tokens == without.usage.prompt_tokens + 6 + 2  # + markers
    with pytest.raises(openai.BadRequestError) as e:  # an assistant's own turn takes none
        chat.create(model="vl", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "see"}, image_part(img)]},
            {"role": "user", "content": "and?"}])
    assert e.value.body["param"] == "messages[1].content"


def test_image_urls_are_fetched_from_allowed_hosts_only(stack, image_server):
    url, _ = stack
    fetched = ask(url, image_part(f"http://{image_server}/cat.png"))
    inline = ask(url, image_part(data_url(_Images.body)))
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    port = image_server.split(":")[1]
    e = refused(url, image_part(f"http://localhost:{port}/cat.png"))
    assert e.body["param"] == "messages[0].content[1].image_url"
    assert "not fetched from `localhost`" in e.body["message"]


def test_hostile_images_are_refused_fast_naming_the_part(stack):
    url, address = stack
    huge = grey_png(10_000, 10_000)  # a whole 100-megapixel image, ~100 KB of PNG
    truncated = png(make_image(300, 200, 3))[:2000]
    cases = [
        (image_part(data_url(grey_png(50_000, 50_000, rows=64))), "pixels"),
        (image_part(data_url(huge)), "10000 x 10000 = 100000000 pixels"),
        (image_part(data_url(truncated)), "corrupt or truncated"),
    ]
    done = threading.Event()
    served: list[str] = []

    def other_client() -> None:  # meanwhile, someone else's requests are answered
        while not done.is_set():
            served.append(ask(url, model="text").choices[0].finish_reason)

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(other_client)
        try:
            for part, what in cases:
                t0 = time.monotonic()
                e = refused(url, part)
                assert time.monotonic() - t0 < 5  # a header or a cut file: no long decode
                assert e.body["param"] == "messages[0].content[1].image_url", e.body
                assert what in e.body["message"], e.body
            e = refused(url, *[image_part(data_url(png(make_image(64, 64, 1))))] * 100)
            assert e.body["param"] == "messages" and "100 images; at most 8" in e.body["message"]
            e = refused(url, {"type": "video_url", "video_url": {"url": "http://127.0.0.1/v"}})
            assert e.body["param"] == "messages[0].content[1].type" and "video" in e.body["message"]
            e = refused(url, image_part(data_url(png(make_image(64, 64, 2)))), model="text")
            assert "takes no images" in e.body["message"]
            wait_for(lambda: len(served) >= 2, 60)
        finally:
            done.set()
        other.result()
    assert set(served) <= {"stop", "length"}

    async def whole() -> None:
        async with NeuronClient(address, TOKEN) as c:
            await c.watch_until(lambda st: ledger_whole(st, "vl") and ledger_whole(st, "text"))
    asyncio.run(whole())


def test_a_jpeg_cut_short_passes_the_routers_header_check_and_is_a_400(stack):
    # The router reads an image's header only; the neuron, decoding it, finds it cut short
    # and refuses it as the client's error, not a 5xx.
    url, _ = stack
    buf = io.BytesIO()
    make_image(300, 200, 4).save(buf, format="JPEG", quality=90)
    cut = buf.getvalue()[:len(buf.getvalue()) // 2]
    e = refused(url, image_part("data:image/jpeg;base64," + base64.b64encode(cut).decode()))
    assert e.status_code == 400 and e.body["type"] == "invalid_request_error", e.body
    assert "image 1: the JPEG image is corrupt or truncated" in e.body["message"], e.body
