"""Caller authentication for the neuron's gRPC service, and its TLS credentials.

Routers present the neuron's shared token (server.token_file) as metadata
`authorization: Bearer <token>`. The check is one server interceptor, so no
RPC can forget it; a call without the token ends UNAUTHENTICATED with
`helexa-code: invalid_api_key` before any handler runs.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from helexa.neuron.grpc_status import abort
from helexa.refusal import Refusal

# A call without the token (the status and metadata come from grpc_status's one table).
_DENIED = Refusal("invalid_api_key",
                  "missing or wrong neuron token (metadata authorization: Bearer <token>)")
# Server-streaming methods of helexa.neuron.v1.Neuron; the rest are unary.
_STREAMING = ("/Generate", "/Watch")


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents `token`."""
    return (("authorization", f"Bearer {token}"),)


def token_matches(metadata: Any, token: str) -> bool:
    """Whether call metadata presents `token` (constant-time comparison)."""
    presented = ""
    for key, value in metadata or ():
        if key == "authorization":
            presented = value if isinstance(value, str) else value.decode()
            break
    return hmac.compare_digest(presented.encode(), f"Bearer {token}".encode())


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the shared token."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if token_matches(handler_call_details.invocation_metadata, self._token):
            return await continuation(handler_call_details)
        return _deny_handler(handler_call_details.method)


def _deny_handler(method: str) -> grpc.RpcMethodHandler:
    if method.endswith(_STREAMING):
        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await abort(context, _DENIED)
            yield  # pragma: no cover - abort raises

        return grpc.unary_stream_rpc_method_handler(deny_stream)

    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, _DENIED)

    return grpc.unary_unary_rpc_method_handler(deny_unary)


def server_credentials(cert_file: Path, key_file: Path) -> grpc.ServerCredentials:
    """TLS credentials from PEM files named in the config."""
    return grpc.ssl_server_credentials([(key_file.read_bytes(), cert_file.read_bytes())])
