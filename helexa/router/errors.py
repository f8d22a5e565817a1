"""The router's client-facing errors: one exception type, one envelope.

Every refusal a client sees is an `ApiError`, rendered as the OpenAI error
envelope `{"error": {"message", "type", "code", "param"}}` with the HTTP
status and, where docs/errors.md says so, a `Retry-After` header.
Codes are the ones of that table (tests/test_docs.py keeps the two in step).

A refusal quotes what the client sent where that says what is wrong (an unknown
key, a value out of its enum), and a client's string may be megabytes: `clip`
shortens one (a message to MAX_MESSAGE_CHARS and a param to MAX_ECHO_CHARS
here, whatever built them; a log field where the router logs one). A 4 MB
unknown key was an 8 MB reply and 12 MB of router log.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

# OpenAI's `type` field for each status family (clients branch on the status).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

# Codes that always tell the client when to come back (docs/errors.md).
RETRYABLE_CODES = frozenset(
    {"rate_limit_exceeded", "overloaded", "model_loading", "shutting_down", "service_unavailable",
     "model_failed", "too_many_connections"})
DEFAULT_RETRY_AFTER_SECS = 1
MAX_MESSAGE_CHARS = 2048  # an error's message, longer only by clip's note of what it left out
MAX_ECHO_CHARS = 256  # a client's string quoted on its own: a param, a key, a log field


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """text, or where it is longer than limit its head and tail with the count of characters
    left out between them (the head names the field, the tail often says what is wrong)."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    head = limit - tail
    return f"{text[:head]}…[{len(text) - limit} characters]…{text[len(text) - tail:]}"


class ApiError(Exception):
    """A refusal rendered as the OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 retry_after_secs: float | None = None, close: bool = False) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = clip(param) if param is not None else None
        if retry_after_secs is None and code in RETRYABLE_CODES:
            retry_after_secs = DEFAULT_RETRY_AFTER_SECS
        self.retry_after_secs = retry_after_secs
        # The request's body was not read to its end (a 408, a 413, or one that could not be
        # decoded): its unread rest cannot be skipped safely, so the connection is closed.
        self.closes_connection = close or status in (408, 413)

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_secs is None:
            return {}
        # Retry-After is whole seconds; never 0, which would invite a hot loop.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_secs)))}

    def response(self, extra_headers: dict[str, str] | None = None) -> web.Response:
        headers = {**self.headers(), **(extra_headers or {})}
        resp = web.Response(status=self.status, text=json.dumps(self.body()),
                            content_type="application/json", headers=headers)
        if self.closes_connection:
            resp.force_close()
        return resp


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, code="invalid_request_error", param=param)


def unsupported(param: str, what: str | None = None) -> ApiError:
    return bad_request(f"`{param}` is not supported by helexa yet{': ' + what if what else ''}",
                       param)
