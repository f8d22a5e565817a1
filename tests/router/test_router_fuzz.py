"""Thousands of generated bodies (valid, near-valid, hostile; nested past the depth limit, with
special-token text in object keys and schema property names) against the router: never a 5xx,
every 4xx in the OpenAI envelope, and the fake neurons' ledgers whole afterwards. The default
run sends 250 bodies to each endpoint (13 s on the 2-core box); `-m slow` sends the 1,000
each the issue asked for (52 s, which the default run spent until the suite outgrew its
10 minutes)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from request_bodies import bodies, check_reply

ENDPOINTS = [("chat", "/v1/chat/completions"), ("completion", "/v1/completions")]


@pytest.mark.parametrize("kind,path", ENDPOINTS)
def test_generated_bodies_never_earn_a_5xx(fl, http, kind, path):
    _fuzz(fl, http, kind, path, 250)


@pytest.mark.slow
@pytest.mark.parametrize("kind,path", ENDPOINTS)
def test_thousands_of_generated_bodies_never_earn_a_5xx(fl, http, kind, path):
    """2 x 1,000 bodies: the issue asks for at least 2,000 over both endpoints (the
    default run's test above sends 250 to each)."""
    _fuzz(fl, http, kind, path, 1000)


def _fuzz(fl, http, kind: str, path: str, examples: int) -> None:
    statuses: dict[int, int] = {}
    flaps = [0]
    fives_before = _counted_5xx(http)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies(kind))
    def one(raw: bytes) -> None:
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        for _ in range(3):
            # The fleet marks a neuron unhealthy after 0.6 s without a report (so the health
            # tests run fast); a starved machine can miss that, and the router then rightly
            # answers 503 service_unavailable for every body. That says nothing about the
            # body: wait until the fleet is healthy and send it again (at most 3 times).
            if r.status_code != 503 or json.loads(r.content)["error"]["code"] != \
                    "service_unavailable":
                break
            flaps[0] += 1
            fl.wait_healthy()
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_reply(r.status_code, r.headers, r.content)

    one()
    assert sum(statuses.values()) >= examples
    # The mix is meaningful: both served requests and refusals among them (a tenth each).
    assert statuses.get(200, 0) >= examples // 10 and statuses.get(400, 0) >= examples // 10, \
        statuses
    end = time.monotonic() + 10
    while not fl.ledgers_whole():
        assert time.monotonic() < end, "a reservation never came back"
        time.sleep(0.02)
    # every 5xx the router counted is one of the health flaps retried above
    assert _counted_5xx(http) - fives_before == flaps[0]


def _counted_5xx(http) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
               if line.startswith("helexa_router_requests_total{") and 'code="5' in line)
