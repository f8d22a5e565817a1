"""Anthropic's error envelope (`{"type": "error", "error": {type, message}}`) for every
error the Messages endpoints answer, its `type` from the HTTP status (docs/errors.md), and
Anthropic's own wording of the context refusals, which Claude Code parses."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

from helexa.router.errors import ApiError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


# The context refusals (helexa/budget.py's wording, and the router's own lower bound).
_PROMPT_TOO_LONG = re.compile(r"maximum context length is (\d+) tokens; the prompt has "
                              r"(?:at least )?(\d+) tokens?")
_OVER_CONTEXT = re.compile(r"maximum context length is (\d+) tokens; the request asks for \d+ "
                           r"tokens \((\d+) in the prompt \+ (\d+) max_tokens\)")


def message_of(e: ApiError) -> str:
    """The error's message in Anthropic's words where a client parses them: Claude Code
    compacts on "prompt is too long: N tokens > C maximum" and lowers max_tokens on "input
    length and `max_tokens` exceed context limit: P + M > C"."""
    if e.code != "context_length_exceeded":
        return e.message
    if m := _PROMPT_TOO_LONG.search(e.message):
        return f"prompt is too long: {m.group(2)} tokens > {int(m.group(1)) - 1} maximum"
    if m := _OVER_CONTEXT.search(e.message):
        return (f"input length and `max_tokens` exceed context limit: {m.group(2)} + "
                f"{m.group(3)} > {m.group(1)}, decrease input length or `max_tokens` and try "
                f"again")
    return e.message


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": message_of(e)}}


def error_response(e: ApiError, extra_headers: dict[str, str] | None = None) -> web.Response:
    resp = web.Response(status=e.status, body=msgspec.json.encode(error_body(e)),
                        content_type="application/json",
                        headers={**e.headers(), **(extra_headers or {})})
    if e.closes_connection:
        resp.force_close()
    return resp
