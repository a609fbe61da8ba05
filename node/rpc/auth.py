"""The household secret on every gRPC call but health checks.

A call without the right secret is refused with UNAUTHENTICATED before any handler runs, so it
learns nothing about the node or its cache. The comparison takes constant time, and the secret
never appears in a log line or an error message: the errors below name the file or variable a
secret came from, never its value.

Without TLS (tls.py) the secret travels in clear with every call, like everything else on the LAN;
it keeps out the neighbours' software, not someone who can watch the network. A node sends it only
to peers that first proved they know it (Prove, proof.py), so advertising on zeroconf does not get
it; only TLS keeps it from a man in the middle.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

from expertmesh.node.errors import ExpertmeshError

SECRET_METADATA_KEY = "x-expertmesh-secret"
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # what a load balancer or a peer table may ask freely
# Prove (rpc/proof.py) is open: a caller asks it before it may send the secret. It answers only a
# proof over what the caller sent and what zeroconf advertises anyway (id, role, disk, compute).
_OPEN_METHODS = ("/expertmesh.v1.Node/Prove",)
# The statuses that mean "this node does not take that secret", as opposed to "it did not answer":
# a node refuses with UNAUTHENTICATED; PERMISSION_DENIED is what a proxy in front may answer.
REFUSED_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def refused(code_name: str) -> bool:
    """Whether a call's status (its lower-case name, as NodeAnswer.error holds it) refused the secret."""
    return code_name.upper() in {c.name for c in REFUSED_CODES}


class SecretError(ExpertmeshError):
    """A secret that cannot be used: one line for the user, naming where it came from, never its value."""


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def check_secret(secret: str, source: str) -> str:
    """`secret` if gRPC metadata can carry it (printable ASCII, not empty), else a SecretError.

    Checked before any call: an unusable value would otherwise fail inside gRPC with a message or
    a traceback that could quote it."""
    if not secret:
        raise SecretError(f"the household secret from {source} is empty")
    if not all(" " <= c <= "~" for c in secret):
        raise SecretError(
            f"the household secret from {source} holds characters other than printable ASCII, "
            "which gRPC metadata cannot carry (`expertmesh secret --create` makes a usable one)"
        )
    return secret


def read_secret_file(path: Path) -> str:
    """The secret in the file at `path` (surrounding whitespace dropped), or a one-line SecretError
    for a missing, unreadable, non-text or empty file."""
    try:
        text = path.read_bytes().decode("ascii")
    except OSError as e:
        raise SecretError(f"cannot read the secret file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SecretError(f"the secret file {path} is not ASCII text (is it the right file?)") from None
    secret = text.strip()
    if not secret:
        raise SecretError(
            f"the secret file {path} is empty: copy the household secret into it (`expertmesh secret` on a node shows it)"
        )
    return check_secret(secret, f"the file {path}")


def loosely_readable(path: Path) -> bool:
    """Whether others than the owner may read `path` (then anyone on the Mac can join the household)."""
    try:
        return bool(path.stat().st_mode & 0o077)
    except OSError:
        return False


def load_or_create_secret(path: Path) -> tuple[str, bool]:
    """The secret kept at `path` (owner-only), creating one if there is none; (secret, created).

    A file that exists but is empty or unreadable is an error, not replaced: it may be a copy in
    progress, or the other Macs may share it."""
    if path.exists() or path.is_symlink():
        return read_secret_file(path), False
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
        method = handler_call_details.method
        if method.startswith(_OPEN_SERVICES) or method in _OPEN_METHODS:
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self._secret):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return self._refuse_stream if handler is not None and handler.response_streaming else self._refuse_unary
