"""Headless Chromium driven over the DevTools protocol (a websocket, with aiohttp).

No selenium or playwright: Debian's `chromium` package and one websocket.
`find_chromium()` installs the package when it is absent and we are root
(apt-get), else says why it cannot; the `chromium` fixture in tests/conftest.py
skips with that reason. `Browser(path).open(url)` gives a `Page` whose
`eval(js)` returns the expression's value and `screenshot(path)` writes a PNG.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import aiohttp

NAMES = ("chromium", "chromium-browser")


def find_chromium() -> tuple[str | None, str]:
    """(path to chromium, "") or (None, why not)."""
    for name in NAMES:
        if path := shutil.which(name):
            return path, ""
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing it needs root (apt-get install chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    why = ""
    # An install from the lists as they are; if that fails, the lists may be stale: update once.
    for cmds in ([install], [["apt-get", "update", "-q"], install]):
        for cmd in cmds:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            except (OSError, subprocess.TimeoutExpired) as e:
                return None, f"`{' '.join(cmd)}` failed: {e}"
            if r.returncode != 0:
                last = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
                why = f"`{' '.join(cmd)}`: {last[0]}"
                break
        for name in NAMES:
            if path := shutil.which(name):
                return path, ""
    return None, f"chromium could not be installed: {why}"


class Page:
    """One tab, attached over a flat DevTools session."""

    def __init__(self, browser: Browser, session_id: str) -> None:
        self.browser = browser
        self.session_id = session_id

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.call(method, params, self.session_id)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path: str | Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        Path(path).write_bytes(base64.b64decode(data["data"]))
        return Path(path)


class Browser:
    """A headless chromium process and its DevTools websocket, on a loop thread of its own."""

    def __init__(self, executable: str, width: int = 1000, height: int = 900) -> None:
        self.profile = tempfile.mkdtemp(prefix="helexa-chromium-")
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ws_url = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # chromium prints the address once it listens
            if line.startswith("DevTools listening on "):
                ws_url = line.split()[-1]
                break
        if not ws_url:
            raise RuntimeError(f"chromium did not start (exit {self.proc.wait()})")
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._run(self._connect(ws_url))

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    def _run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self, ws_url: str) -> None:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(ws_url, max_msg_size=0)
        self.reader = self.loop.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = msg.json()
            fut = self._waiting.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)

    async def _call(self, method: str, params: dict[str, Any], session_id: str | None
                    ) -> dict[str, Any]:
        i = next(self._ids)
        fut = self.loop.create_future()
        self._waiting[i] = fut
        msg: dict[str, Any] = {"id": i, "method": method, "params": params}
        if session_id:
            msg["sessionId"] = session_id
        await self.ws.send_json(msg)
        data = await fut
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data["result"]

    def call(self, method: str, params: dict[str, Any] | None = None,
             session_id: str | None = None) -> dict[str, Any]:
        return self._run(self._call(method, params or {}, session_id))

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, session["sessionId"])
        page.send("Runtime.enable")
        return page

    def close(self) -> None:
        async def shut() -> None:
            self.reader.cancel()
            await self.ws.close()
            await self.http.close()
        try:
            self._run(shut(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)
