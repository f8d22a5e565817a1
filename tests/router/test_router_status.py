"""/status and /status.json against the in-process fleet of fake neurons."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from helexa.router.status import CounterWindow

MSG = [{"role": "user", "content": "hello there"}]


def wait_for(cond: Callable[[], Any], timeout: float = 10.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := cond():
            return got
        time.sleep(0.02)
    raise AssertionError(f"not seen within {timeout}s")


def status(fl, **headers: str) -> dict:
    r = httpx2.get(fl.url + "/status.json", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_status_json_lists_every_neuron_model_and_ledger(fl):
    used = 3 * 16 * 1024

    def set_used() -> None:
        fl.n2.models["tiny"].used_bytes = used
        fl.n2.changed()
    fl.lt.call(set_used)

    def reported() -> dict | None:  # the router has the neuron's new report
        s = status(fl)
        n2 = next(n for n in s["neurons"] if n["name"] == "n2")
        tiny = next(m for m in n2["models"] if m["model"] == "tiny")
        return s if tiny["bar"]["used"] == used else None
    s = wait_for(reported)
    by_name = {n["name"]: n for n in s["neurons"]}
    assert set(by_name) == {"n1", "n2"}
    n2 = by_name["n2"]
    assert n2["up"] is True and n2["address"] == fl.n2.address
    assert 0 <= n2["last_report_age_secs"] < 5
    models = {m["model"]: m for m in n2["models"]}
    assert set(models) == {"tiny", "other"}
    tiny = models["tiny"]
    assert tiny["state"] == "ready"
    total = 512 * 16 * 1024
    # the bar's parts are disjoint and add up to the pool
    assert tiny["bar"] == {"free": total - 3 * 16 * 1024, "cached": 0, "reserved": 0,
                           "used": 3 * 16 * 1024}
    assert tiny["kv"]["total_bytes"] == total
    assert tiny["limits"]["context"] == 2048 and models["other"]["limits"]["context"] == 512
    assert {"in_flight", "queued", "decode_tokens_per_sec", "prefill_tokens_per_sec",
            "profile", "admission"} <= set(tiny)


def test_status_page_is_served_from_the_package(fl):
    r = httpx2.get(fl.url + "/status", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "status.json" in r.text and 'name="viewport"' in r.text


def test_status_json_counts_neuron_refusals_by_code(fl):
    def refuse():
        for n in (fl.n1, fl.n2):
            n.b.refuse = ("RESOURCE_EXHAUSTED", "overloaded", 1000)
            n.changed()
    before = status(fl)["refusals"]["neuron"]["by_code"].get("overloaded", 0)
    fl.lt.call(refuse)
    with pytest.raises(openai.APIStatusError):
        fl.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
    s = status(fl)
    # the router tried both neurons: two neuron refusals, one 503 to the client
    assert s["refusals"]["neuron"]["by_code"]["overloaded"] == before + 2
    assert s["refusals"]["http"]["by_code"].get("503", 0) >= 1
    assert all(not r["code"].startswith("2") for r in s["refusals"]["http"]["rows"])


def test_status_json_is_behind_auth_when_required(fl):
    fl.lt.call(lambda: setattr(fl.state.auth, "require_auth", True))
    try:
        r = httpx2.get(fl.url + "/status.json", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx2.get(fl.url + "/status.json", timeout=10,
                        headers={"Authorization": "Bearer sk-alice-test-key"})
        assert ok.status_code == 200 and len(ok.json()["neurons"]) == 2
        # the page holds no data; its script asks for the key
        assert httpx2.get(fl.url + "/status", timeout=10).status_code == 200
    finally:
        fl.lt.call(lambda: setattr(fl.state.auth, "require_auth", False))


def test_counter_window_forgets_what_is_older_than_the_window():
    c = Counter("refusals", "x", ["code"], registry=CollectorRegistry())
    w = CounterWindow(c, keep_secs=60)
    t0 = w.snapshots[0][0]
    c.labels("overloaded").inc(3)
    w.sample(t0 + 30)
    c.labels("overloaded").inc(2)
    c.labels("rate_limit_exceeded").inc()
    w.sample(t0 + 70)
    # the window starts at t0+40: the base is the last sample at or before it (t0+30)
    covered, counts = w.recent(t0 + 100)
    assert covered == pytest.approx(70)
    assert counts == {("overloaded",): 2, ("rate_limit_exceeded",): 1}
    covered, counts = w.recent(t0 + 40)  # younger than the window: everything since start
    assert covered == pytest.approx(40)
    assert counts == {("overloaded",): 5, ("rate_limit_exceeded",): 1}
    w.sample(t0 + 200)
    # only the newest sample at or before the window's start (t0+70) is kept of the old ones
    assert [t - t0 for t, _ in w.snapshots] == pytest.approx([70, 200])
