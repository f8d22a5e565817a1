"""A neuron's refusal or failure as the client's HTTP error (docs/errors.md's table).

A neuron refuses with a gRPC status plus trailing metadata `helexa-code` (the OpenAI-style
code), `helexa-retry-after-ms` and, where one field is at fault, `helexa-param`;
`map_rpc_error` turns that into the `ApiError` the client sees, with `Retry-After` from the
neuron's estimate. A call that broke without a helexa code maps by its gRPC status.
"""

from __future__ import annotations

import math
import re

import grpc

from helexa.router.errors import ApiError

# Refusals before the first byte that another neuron may well accept. NOT_FOUND too: the
# router only sends where Watch said READY, so it means that report was already stale.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.NOT_FOUND})

# The neuron's helexa-code and the HTTP status it answers.
CODE_STATUS = {
    "rate_limit_exceeded": 429,
    "overloaded": 503,
    "model_loading": 503,
    "shutting_down": 503,
    "service_unavailable": 503,
    "model_failed": 503,
    "upstream_error": 502,
    "context_length_exceeded": 400,
    "invalid_request_error": 400,
    "model_not_found": 404,
}
# A call that broke with no helexa code: its gRPC status, as a status and code.
_FALLBACK = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    # The neuron refused the router's own token: a deployment fault, not the client's.
    grpc.StatusCode.UNAUTHENTICATED: (503, "service_unavailable"),
    grpc.StatusCode.PERMISSION_DENIED: (503, "service_unavailable"),
}

# The gRPC deadline of a call is the request's own plus this margin, for the neuron's abort
# (it checks the deadline between steps) to arrive first (dispatch.py, `_timeout_secs`).
DEADLINE_MARGIN_SECS = 5.0
PAST_DEADLINE = ("the request ran past its deadline (timeouts.request_secs) and the neuron "
                 f"did not end it within {DEADLINE_MARGIN_SECS:g} s of it (one of its steps "
                 "took longer), so the router ended the call")

# A call that ended so with no helexa code is a fault, not a refusal: its words stay in logs.
_UNEXPLAINED = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


def trailing(e: grpc.aio.AioRpcError) -> dict[str, str]:
    md = e.trailing_metadata() or ()
    return {k: v if isinstance(v, str) else v.decode() for k, v in md}


def map_rpc_error(e: grpc.aio.AioRpcError, kind: str = "chat") -> ApiError:
    """The client-facing error for a neuron's refusal or failure."""
    md = trailing(e)
    code = md.get("helexa-code", "")
    refused = code in CODE_STATUS  # the neuron's own refusal, in its own words
    if refused:
        status = CODE_STATUS[code]
    else:
        status, code = _FALLBACK.get(e.code(), (502, "upstream_error"))
    retry_after = None
    if re.fullmatch(r"[0-9]{1,9}", md.get("helexa-retry-after-ms", "")):
        retry_after = max(1, math.ceil(int(md["helexa-retry-after-ms"]) / 1000))
    param = md.get("helexa-param")
    if code == "context_length_exceeded" and not param:
        param = {"chat": "messages", "responses": "input"}.get(kind, "prompt")
    message = e.details() or f"neuron answered {e.code().name}"
    if not refused and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = PAST_DEADLINE  # gRPC's own words ("Deadline Exceeded") name no cause
    elif e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        message = "no neuron accepted the router's credentials"
    elif not refused and e.code() in _UNEXPLAINED:
        # not a refusal but a fault (an exception the neuron did not expect): its text may
        # hold paths and internals, and is the router's log's (request.refused's detail)
        message = (f"the neuron failed on this request ({e.code().name}); the router's log "
                   "has its words (request.refused)")
    return ApiError(status, message, code=code, param=param, retry_after_secs=retry_after)


def withheld(e: grpc.aio.AioRpcError, err: ApiError) -> str | None:
    """The neuron's words that ``err`` (map_rpc_error's) did not pass on, for the router's
    log; None where the client got them."""
    return e.details() if e.details() != err.message else None
