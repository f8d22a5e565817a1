"""CORS through a real router (docs/http.md, "CORS"): a listed origin's preflight is
answered without a key, and its replies (errors and event streams too) carry
Access-Control-Allow-Origin; any other origin gets none of it."""

from __future__ import annotations

import httpx2
from router_procs import CORS_ORIGIN, key_of

AUTH = {"Authorization": f"Bearer {key_of('alice')}"}
CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def preflight(router, origin: str) -> httpx2.Response:
    return httpx2.request("OPTIONS", router.url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_a_listed_origins_preflight_needs_no_key(router):
    r = preflight(router, CORS_ORIGIN)  # require_auth is on, and no key is sent
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization, content-type"
    other = preflight(router, "https://evil.example")
    assert other.status_code == 405 and "access-control-allow-origin" not in other.headers


def test_replies_errors_and_streams_carry_the_origin(router):
    at = {"Origin": CORS_ORIGIN}
    ok = httpx2.post(router.url + "/v1/chat/completions", json=CHAT, headers={**at, **AUTH})
    no_key = httpx2.post(router.url + "/v1/chat/completions", json=CHAT, headers=at)
    missing = httpx2.get(router.url + "/v1/nope", headers={**at, **AUTH})
    with httpx2.stream("POST", router.url + "/v1/chat/completions",
                       json={**CHAT, "stream": True}, headers={**at, **AUTH}) as s:
        body = s.read()
        stream_headers = s.headers
    assert (ok.status_code, no_key.status_code, missing.status_code) == (200, 401, 404)
    assert b"data: [DONE]" in body
    for headers in (ok.headers, no_key.headers, missing.headers, stream_headers):
        assert headers["access-control-allow-origin"] == CORS_ORIGIN
        assert headers["access-control-expose-headers"] == "*"
        assert "Origin" in headers.get_list("vary")
    plain = httpx2.post(router.url + "/v1/chat/completions", json=CHAT,
                        headers={"Origin": "https://evil.example", **AUTH})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
