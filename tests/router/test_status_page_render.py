"""The status page's script in headless Chromium over a scripted /status.json: fields a neuron
may add (a backend, a hybrid's fixed state), the requests the router holds for a model,
refusal rows, and the key form on a 401."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from browser_cdp import Browser

from helexa.router.status import page_html

MIB = 1 << 20


def _status() -> dict[str, Any]:
    kv = {"total_bytes": 64 * MIB, "free_bytes": 40 * MIB, "cached_bytes": 8 * MIB,
          "reserved_bytes": 16 * MIB, "used_bytes": 8 * MIB, "block_size": 16,
          "bytes_per_token": 32768, "fixed_bytes_per_request": 39223296,
          "state_total_bytes": 4 * MIB, "state_free_bytes": 2 * MIB}
    model = {"model": "Qwen/Qwen3.5-27B", "state": "ready", "profile": "interactive",
             "attention_backend": "cuda", "kv_dtype": "bf16", "tp": 2, "kv": kv,
             "bar": {"free": 32 * MIB, "cached": 8 * MIB, "reserved": 16 * MIB, "used": 8 * MIB},
             "in_flight": 3, "queued": 1, "running": 3, "decode_tokens_per_sec": 812.5,
             "prefill_tokens_per_sec": 9000.0, "error": "",
             "admission": {"max_in_flight": 16, "max_queue_depth": 512, "max_slots": 16},
             "limits": {"context": 262144, "input": 262143, "output": 262143}}
    return {"router": {"version": "0.1.0", "unix_ms": 0, "uptime_secs": 900.0,
                       "in_progress": 4, "held": {"Qwen/Qwen3.5-27B": 7}},
            "neurons": [{"name": "beast", "address": "beast:7070", "tls": True, "up": True,
                         "connected": True, "last_report_age_secs": 0.2, "draining": False,
                         "seq": 9, "catalogue": ["Qwen/Qwen3.5-27B", "Qwen/Qwen3-8B"],
                         "models": [model]}],
            "refusals": {"neuron": {"window_secs": 300.0, "by_code": {"overloaded": 2},
                                    "rows": [{"neuron": "beast", "model": "Qwen/Qwen3.5-27B",
                                              "code": "overloaded", "count": 2}]},
                         "http": {"window_secs": 300.0, "by_code": {"503": 2},
                                  "rows": [{"model": "Qwen/Qwen3.5-27B", "code": "503",
                                            "count": 2}]}}}


@pytest.fixture
def page_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """/status (the packaged page) and a /status.json that needs `Bearer sk-ok`."""
    seen: dict[str, Any] = {"auth": []}

    async def page(_: web.Request) -> web.Response:
        return web.Response(body=page_html(), content_type="text/html")

    async def data(request: web.Request) -> web.Response:
        seen["auth"].append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer sk-ok":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        return web.json_response(_status())

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/status", page)
    app.router.add_get("/status.json", data)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def _until(page: Any, js: str, timeout: float = 20.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = page.eval(js)
        except RuntimeError:  # the page is still loading
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never true in the page: {js}")


def test_the_page_asks_for_a_key_then_shows_what_a_neuron_reports(page_server, chromium):
    url, seen = page_server
    browser = Browser(chromium)
    try:
        page = browser.open("about:blank")
        page.send("Emulation.setDeviceMetricsOverride", width=390, height=844,
                  deviceScaleFactor=3, mobile=True)  # a phone
        page.send("Page.navigate", url=url + "/status?every_ms=200")
        _until(page, "getComputedStyle(document.getElementById('login')).display === 'block'")
        page.eval("document.getElementById('key').value = 'sk-ok';"
                  "document.getElementById('login').requestSubmit(); true")
        _until(page, "document.querySelectorAll('[data-neuron]').length === 1")
        text = page.eval("document.body.innerText")
        assert "backend cuda" in text and "profile interactive" in text and "tp 2" in text
        assert "fixed per request 37.4 MiB" in text
        assert "state total 4.0 MiB" in text and "state free 2.0 MiB" in text
        assert "loads on demand: Qwen/Qwen3-8B" in text and "beast:7070 (tls)" in text
        assert "3 / 16" in text and "1 / 512" in text and "812.5" in text
        # requests the router holds for the model (helexa_router_held_requests), by its queue
        held = page.eval("[...document.querySelectorAll('dt')].filter(d => d.textContent === "
                         "'held by router').map(d => d.nextSibling.textContent)")
        assert held == ["7"]
        codes = page.eval("[...document.querySelectorAll('[data-code]')].map(r => r.dataset.code)")
        assert codes == ["overloaded", "HTTP 503"]
        widths = page.eval("Object.fromEntries([...document.querySelectorAll('.bar span')]"
                           ".map(s => [s.dataset.part, s.style.width]))")
        assert widths == {"used": "12.5%", "reserved": "25%", "cached": "12.5%", "free": "50%"}
        # nothing wider than the phone's screen
        assert page.eval("[window.innerWidth, document.documentElement.scrollWidth]") == [390, 390]
        assert "Bearer sk-ok" in seen["auth"]
        if shot := os.environ.get("HELEXA_STATUS_PHONE_SCREENSHOT"):
            page.screenshot(shot)
    finally:
        browser.close()
