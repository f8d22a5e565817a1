"""CORS: which browser pages may call the API (`server.cors_allowed_origins`).

Off by default: a router listens on 127.0.0.1 and serves callers without a key
unless `auth.require_auth`, so allowing every origin (vLLM's default) would let
any page a user opens spend its neurons and read their replies. With origins
listed, a preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-Method`) from one of them is answered 204 before any
route or key check, and every reply to a request from one of them (errors and
event streams included) carries `Access-Control-Allow-Origin`. docs/http.md,
"CORS" is the contract.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Origins = Callable[[web.Request], list[str]]
ORIGINS: web.AppKey[Origins] = web.AppKey("cors_origins")
MAX_AGE_SECS = 600  # how long a browser may reuse a preflight's answer


def allowed_origin(request: web.Request) -> str | None:
    """The Access-Control-Allow-Origin a request gets (None: no CORS headers)."""
    origin = request.headers.get("Origin")
    origins = request.app[ORIGINS](request)
    if not origin or not origins:
        return None
    return "*" if "*" in origins else origin if origin in origins else None


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A preflight from an allowed origin: 204, no key asked (the browser sends none)."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers \
            and allowed_origin(request) is not None:
        headers = {"Access-Control-Allow-Methods": "GET, HEAD, POST, OPTIONS",
                   "Access-Control-Max-Age": str(MAX_AGE_SECS)}
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:  # named one by one: `*` does not cover Authorization
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)
    return await handler(request)


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every reply, streams and errors alike, before its headers go."""
    origin = allowed_origin(request)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Expose-Headers"] = "*"  # x-request-id, retry-after, ...
    if origin != "*":
        response.headers.add("Vary", "Origin")


def install(app: web.Application, origins: Origins) -> None:
    app[ORIGINS] = origins
    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(add_headers)
