"""A `Refusal` as a gRPC status: the neuron's one mapping from code to status.

Every RPC that refuses (the servicer's, the token check's) ends its call
with `abort`: the status for the refusal's code, its message as the
details, and trailing metadata `helexa-code` plus `helexa-retry-after-ms`
when the neuron has an estimate (docs/grpc.md). The router maps the code
back to HTTP (helexa/router/rpc_errors.py); docs/errors.md states both, and
tests/test_docs.py checks this table against it.
"""

from __future__ import annotations

import functools
from typing import NoReturn

import grpc

from helexa.refusal import Refusal

# The OpenAI-style code → the gRPC status the router maps back to HTTP
# (docs/errors.md). Codes not listed are INTERNAL.
STATUS_OF_CODE: dict[str, grpc.StatusCode] = {
    "invalid_request_error": grpc.StatusCode.INVALID_ARGUMENT,
    "context_length_exceeded": grpc.StatusCode.INVALID_ARGUMENT,
    "invalid_api_key": grpc.StatusCode.UNAUTHENTICATED,
    "model_not_found": grpc.StatusCode.NOT_FOUND,
    "rate_limit_exceeded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "model_loading": grpc.StatusCode.UNAVAILABLE,
    "model_failed": grpc.StatusCode.UNAVAILABLE,
    "shutting_down": grpc.StatusCode.UNAVAILABLE,
    "service_unavailable": grpc.StatusCode.UNAVAILABLE,
    "model_busy": grpc.StatusCode.FAILED_PRECONDITION,
    "upstream_error": grpc.StatusCode.INTERNAL,
}


def status_of(refusal: Refusal) -> grpc.StatusCode:
    return STATUS_OF_CODE.get(refusal.code, grpc.StatusCode.INTERNAL)


def trailing_metadata(refusal: Refusal) -> tuple[tuple[str, str], ...]:
    """`helexa-code`, and `helexa-retry-after-ms` when there is an estimate."""
    md: list[tuple[str, str]] = [("helexa-code", refusal.code)]
    if refusal.retry_after_ms:
        md.append(("helexa-retry-after-ms", str(refusal.retry_after_ms)))
    return tuple(md)


async def abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> NoReturn:
    """End the call with the refusal's status, message and metadata (raises)."""
    try:
        await context.abort(status_of(refusal), refusal.message, trailing_metadata(refusal))
    except BaseException as e:
        # grpc keeps the AbortError on the call's state, and its traceback holds the
        # handler's frames, which hold the call: a cycle that kept every refused request
        # (its prompt, the refusal's frames) until the collector's rare full pass, ~11 MB a
        # refused 7.8 MB prompt. Once the call is done nothing reads them.
        context.add_done_callback(functools.partial(_forget, e))
        raise
    raise AssertionError("grpc.aio's abort raises")  # pragma: no cover


def _forget(e: BaseException, _context: object) -> None:
    e.__traceback__ = e.__context__ = e.__cause__ = None
