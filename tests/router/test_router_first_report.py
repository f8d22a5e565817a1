"""A router that has not heard a neuron yet waits a bounded moment for its first Watch report
instead of failing a request at once."""

from __future__ import annotations

import concurrent.futures
import time

import msgspec
import openai
import pytest
from router_fake_neuron import FakeNeuron

from helexa.config.schema import RouterConfig
from helexa.router import app as router_app

MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def quiet_router(fleet, request):
    """A fresh router over one fake neuron whose Watch says nothing until told; its
    first_report_secs 5 s, or the test's indirect parameter."""
    lt = fleet.lt
    n = FakeNeuron("q", ["tiny"])
    n.b.silent = True
    address = lt.run(n.start())
    cfg = msgspec.convert({
        "server": {"listen": "127.0.0.1:0"},
        "neurons": {"endpoints": [{"name": "q", "address": address}]},
        # 5 s: room for the report to arrive after the test lets it go, on a loaded machine
        "timeouts": {"first_report_secs": getattr(request, "param", 5.0),
                     "load_wait_secs": 1.0}}, RouterConfig)
    runner, state, addr = lt.run(router_app.start(cfg))
    yield n, state, f"http://{addr}"
    lt.run(router_app.stop(runner, state))
    lt.run(n.stop())


def ask(url: str):
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-x", max_retries=0, timeout=30)
    return c.chat.completions.create(model="tiny", messages=MSG, max_tokens=1)


def test_a_request_before_the_first_report_waits_for_it(fleet, quiet_router):
    n, state, url = quiet_router
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(ask, url)
        end = time.monotonic() + 10  # the request is in and waiting, not refused
        while fleet.lt.call(lambda: state.metrics.in_progress._value.get()) < 1:
            assert not reply.done(), reply.result()
            assert time.monotonic() < end
            time.sleep(0.01)
        fleet.lt.call(lambda: (setattr(n.b, "silent", False), n.changed()))
        assert reply.result().choices[0].message.content == "w0 "


# 1 s: no report ever comes here, so the test waits out the whole bound
@pytest.mark.parametrize("quiet_router", [1.0], indirect=True)
def test_the_wait_for_a_first_report_is_bounded(fleet, quiet_router):
    n, state, url = quiet_router
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        ask(url)
    assert e.value.code == "service_unavailable"
    assert time.monotonic() - t0 < 20  # bounded by first_report_secs, not the 30 s client timeout
