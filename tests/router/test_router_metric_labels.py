"""/metrics answers without a key: a client's model string never becomes one of its labels,
whatever refuses the request, and a scrape renders off the event loop."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time

import httpx2
import pytest
from router_fleet import ALICE_KEY

from helexa.router import images

BAD_PNG = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
TINY_PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
            "2mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def _body(model: str, *urls: str) -> dict:
    parts = [{"type": "text", "text": "hi"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": parts}]}


def _post(fl, body: dict, key: str = ALICE_KEY) -> httpx2.Response:
    return httpx2.post(fl.url + "/v1/chat/completions", json=body, timeout=15,
                       headers={"Authorization": f"Bearer {key}"})


def _model_labels(text: str) -> set[str]:
    return set(re.findall(r'model(?:_name)?="([^"]*)"', text))


def _scrape(fl) -> str:
    return httpx2.get(fl.url + "/metrics").text


def _answered(text: str, model: str, code: str) -> float:
    """Requests answered `code` under the label `model` (a regular expression: summed)."""
    found = re.findall(rf'helexa_router_requests_total{{code="{code}",model="{model}"}} (\S+)',
                       text)
    return sum(map(float, found))


def test_an_unknown_model_refused_for_a_bad_image_is_no_label(fl):
    before = _scrape(fl)
    r = _post(fl, _body("alice-secret-project-ZEBRA", BAD_PNG))
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    for i in range(20):  # many made-up names: the series do not grow with them
        assert _post(fl, _body(f"junk-{i}-" + "x" * 200, BAD_PNG)).status_code == 400
    after = _scrape(fl)
    assert "ZEBRA" not in after and "junk-" not in after
    assert _answered(after, "unknown", "400") == _answered(before, "unknown", "400") + 21
    assert _model_labels(after) <= _model_labels(before) | {"unknown"}
    # a model the fleet knows keeps its own label, an alias its target's
    assert _post(fl, _body("helexa/balanced")).status_code == 200
    assert _answered(_scrape(fl), "tiny", "200") >= 1


def test_an_unknown_model_refused_429_or_left_by_its_client_is_no_label(fl, monkeypatch):
    """A 429 from the work pool after the body was parsed (the caller's other work filled
    its share meanwhile), and a client that left while its image decoded (499)."""
    pool, real = fl.state.work_pool, images._decode
    release, decoding = threading.Event(), threading.Event()
    mode, blockers = ["fill"], []

    def spy(img, limits):
        if mode[0] == "fill":  # alice's other work fills her share: the next image is 429
            mode[0] = ""
            blockers.extend(asyncio.run_coroutine_threadsafe(  # counted, never refused
                pool.run("alice", release.wait, share=False), fl.lt.loop)
                for _ in range(pool.per_principal))
            deadline = time.monotonic() + 5
            while pool.tasks_of("alice") <= pool.per_principal and time.monotonic() < deadline:
                time.sleep(0.005)
        elif mode[0] == "hold":  # the client leaves while this decodes
            decoding.set()
            release.wait(10)
        return real(img, limits)
    monkeypatch.setattr(images, "_decode", spy)
    before = _scrape(fl)
    try:
        r = _post(fl, _body("made-up-429", TINY_PNG, TINY_PNG))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        release.set()
        for b in blockers:
            b.result(5)
        release.clear()
        mode[0] = "hold"
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(fl.url + "/v1/chat/completions", json=_body("made-up-gone", TINY_PNG),
                        headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=1.0)
        assert decoding.is_set()
        deadline = time.monotonic() + 5
        while _answered(_scrape(fl), '[^"]*', "499") < _answered(before, '[^"]*', "499") + 1:
            assert time.monotonic() < deadline, "the client's leaving was never counted"
            time.sleep(0.05)
    finally:
        release.set()
    after = _scrape(fl)
    assert "made-up" not in after
    assert _answered(after, "unknown", "499") == _answered(before, "unknown", "499") + 1
    assert _answered(after, "unknown", "429") == _answered(before, "unknown", "429") + 1


def test_a_slow_scrape_leaves_the_event_loop_free(fl, monkeypatch):
    """/metrics renders on a worker thread: a request beside a scrape still rendering is
    answered (rendered on the loop, the scrape would hold it until the render ended, which
    here waits for that answer)."""
    metrics = fl.state.metrics
    real, started, release = metrics.render, threading.Event(), threading.Event()

    def slow_render() -> bytes:
        started.set()
        release.wait(10)
        return real()
    monkeypatch.setattr(metrics, "render", slow_render)
    scrape = threading.Thread(target=_scrape, args=(fl,))
    scrape.start()
    try:
        assert started.wait(5)
        assert httpx2.get(fl.url + "/health", timeout=5).status_code == 200
        assert scrape.is_alive()  # answered while the scrape was still rendering
    finally:
        release.set()
        scrape.join(10)
