"""The router's /status page in headless Chromium, over a router and two real neurons."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import openai
import pytest
from browser_cdp import Browser
from router_procs import wait_for

BARS_JS = """[...document.querySelectorAll('.bar')].map(b => ({
  neuron: b.closest('[data-neuron]').dataset.neuron, model: b.dataset.model,
  parts: Object.fromEntries([...b.children].map(s => [s.dataset.part,
           {bytes: Number(s.dataset.bytes), width: s.getBoundingClientRect().width}])),
  width: b.getBoundingClientRect().width}))"""


def bar_of(page, neuron: str, model: str) -> dict:
    return next(b for b in page.eval(BARS_JS) if (b["neuron"], b["model"]) == (neuron, model))


def test_status_page_shows_both_neurons_and_a_request_moves_the_bar(ops, chromium, tmp_path):
    browser = Browser(chromium, width=900, height=1400)
    stream = None
    try:
        page = browser.open(ops.url + "/status")
        wait_for(lambda: page.eval("document.querySelectorAll('[data-neuron]').length") == 2,
                 timeout=30)
        names = page.eval("[...document.querySelectorAll('[data-neuron]')]"
                          ".map(e => [e.dataset.neuron, e.dataset.up])")
        assert names == [["oa", "true"], ["ob", "true"]]
        assert "2 of 2 neurons up" in page.eval("document.getElementById('summary').textContent")
        bars = page.eval(BARS_JS)
        assert {(b["neuron"], b["model"]) for b in bars} == {("oa", "tiny"), ("ob", "tiny"),
                                                             ("ob", "slow")}
        for b in bars:  # four drawn parts filling the bar
            assert set(b["parts"]) == {"free", "cached", "reserved", "used"}
            assert sum(p["width"] for p in b["parts"].values()) == pytest.approx(b["width"], abs=3)
        idle = bar_of(page, "ob", "slow")
        assert idle["parts"]["reserved"]["bytes"] + idle["parts"]["used"]["bytes"] == 0

        # A long request on `slow`: its reservation must show within 2 s of admission.
        client = openai.OpenAI(base_url=ops.url + "/v1", api_key=ops.keys["alice"], max_retries=0,
                               timeout=60)
        stream = client.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "a long story please"}],
            max_tokens=900, stream=True, extra_body={"ignore_eos": True})
        admitted = time.monotonic()  # headers come after the neuron's first message
        tokens = [0]
        finished = threading.Event()

        def read() -> None:
            with contextlib.suppress(openai.APIConnectionError):  # closed by the test
                for _ in stream:
                    tokens[0] += 1
            finished.set()
        threading.Thread(target=read, daemon=True).start()
        moved = None
        while time.monotonic() - admitted < 5:
            b = bar_of(page, "ob", "slow")
            if b["parts"]["reserved"]["bytes"] + b["parts"]["used"]["bytes"] > 0:
                moved = time.monotonic() - admitted
                break
            time.sleep(0.05)
        assert not finished.is_set(), "the request ended before the bar was read"
        assert moved is not None and moved <= 2.0, f"bar moved after {moved} s"
        b = bar_of(page, "ob", "slow")
        assert b["parts"]["reserved"]["width"] + b["parts"]["used"]["width"] > 1  # drawn, not 0 px
        assert "1 request in progress" in page.eval(
            "document.getElementById('summary').textContent")
        shot = Path(os.environ.get("HELEXA_STATUS_SCREENSHOT") or tmp_path / "status.png")
        page.screenshot(shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        stream.close()  # the client leaves: the reservation comes back, and the page says so
        wait_for(lambda: sum(bar_of(page, "ob", "slow")["parts"][p]["bytes"]
                             for p in ("reserved", "used")) == 0, timeout=10)
    finally:
        if stream is not None:
            stream.close()
        browser.close()
