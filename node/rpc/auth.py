"""The household secret on every gRPC call but health checks.

A call without the right secret is refused with UNAUTHENTICATED before any handler runs, so it
learns nothing about the node or its cache. The comparison takes constant time, and the secret
never appears in a log line or an error message.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

SECRET_METADATA_KEY = "x-expertmesh-secret"
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # what a load balancer or a peer table may ask freely


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def load_or_create_secret(path: Path) -> tuple[str, bool]:
    """The secret kept at `path` (owner-only), creating one if there is none; (secret, created)."""
    try:
        return path.read_text().strip(), False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = new_secret()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return secret, True


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((SECRET_METADATA_KEY, secret),)


class SecretInterceptor(grpc.ServerInterceptor):
    def __init__(self, secret: str):
        if not secret:
            raise ValueError("a household secret must not be empty")
        self._secret = secret.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid household secret is required")

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_SERVICES):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self._secret):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return self._refuse_stream if handler is not None and handler.response_streaming else self._refuse_unary
