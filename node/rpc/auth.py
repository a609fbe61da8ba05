"""The household secret behind every gRPC call but health checks and Prove.

A call without a credential made with the right secret is refused with UNAUTHENTICATED before any
handler runs, so it learns nothing about the node or its cache. The secret itself never crosses
the network: each call carries a fresh credential, `v2:<unix time>:<nonce>:<HMAC>`, an HMAC-SHA256
under a key derived from the secret by scrypt (proof.py's, then one more HMAC step for this use)
over the call's method, the time and a random nonce. Someone who watches a plain-TCP LAN therefore
learns no secret, and a credential they copy is worth little: it names its method, so it cannot be
moved to another RPC; the node accepts each nonce once (replay_cache.py), so it cannot be sent
again; and its time must be within CALL_CREDENTIAL_WINDOW_S of the node's clock, so the node need
remember nonces that long only. A node that restarts refuses credentials made (more than a few
seconds) before it started: replay_cache.py says why, and what a caller whose clock is behind pays.
What a copier can still do is race the original: a call it sends first, with the original's request
or its own for the same method, is served and the original is refused. TLS (tls.py) hides the
calls, and so closes that too. The comparison takes constant time, and neither the secret nor a
credential appears in a log line or an error message: the errors below name the file or variable a
secret came from, never its value. A node sends credentials only to peers that first proved they know the
secret (Prove, proof.py), so advertising on zeroconf does not get even those.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

import grpc

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.rpc.proof import prove_key
from expertmesh.node.rpc.replay_cache import ReplayCache
from expertmesh.v1 import node_pb2

AUTH_METADATA_KEY = "x-expertmesh-auth"
# A credential's time may be this far from the node's clock, either way: the household's Macs keep
# their clocks by NTP; `expertmesh doctor` checks this one's. A node remembers nonces this long.
CALL_CREDENTIAL_WINDOW_S = 300
_CALL_VERSION = "v2"
_CALL_DOMAIN = b"expertmesh call v2"
_NONCE_HEX_CHARS = range(16, 65)  # call_metadata sends 32; the bound keeps the replay cache's entries small
_OLD_SECRET_METADATA_KEY = "x-expertmesh-secret"  # protocol 1's: the secret itself (never read, only noticed)
_UPGRADE = "run the same expertmesh release on every Mac of the household"
_NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Node"]
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
            "which every Mac of the household must read alike (`expertmesh secret --create` makes a usable one)"
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


@functools.lru_cache(maxsize=4)
def _call_key(secret: str) -> bytes:
    """The credentials' HMAC key: derived from proof.py's scrypt key (computed once per process),
    kept apart from the proofs' own by its domain."""
    return hmac.new(prove_key(secret), _CALL_DOMAIN, hashlib.sha256).digest()


def node_method(name: str) -> str:
    """The full gRPC name of the Node service's RPC `name` ("Info": "/expertmesh.v1.Node/Info"), as a
    credential names it; a KeyError for a name the service does not have."""
    return f"/{_NODE_SERVICE.full_name}/{_NODE_SERVICE.methods_by_name[name].name}"


def _credential_mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    message = b"|".join((_CALL_DOMAIN, method.encode(), stamp.encode(), nonce.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def call_metadata(secret: str, method: str) -> tuple[tuple[str, str], ...]:
    """The metadata of one call of `method` (its full gRPC name, see `node_method`): a fresh
    credential made with `secret` (never the secret). A node accepts it once: make one per call."""
    stamp, nonce = str(int(time.time())), secrets.token_hex(16)
    mac = _credential_mac(_call_key(secret), method, stamp, nonce)
    return ((AUTH_METADATA_KEY, f"{_CALL_VERSION}:{stamp}:{nonce}:{mac}"),)


def _is_hex(text: str) -> bool:
    return text.isascii() and all(c in "0123456789abcdef" for c in text)


def check_credential(
    key: bytes, credential: str, method: str, now: float, seen: ReplayCache | None = None
) -> str | None:
    """Why `credential`, sent with a call of `method`, is refused (None: it is good): made with
    another secret or for another method, or malformed, or (made with this one) at a time too far
    from `now` — a clock set wrong says so, not "no secret" — or, given the node's `seen` cache,
    already used. Only a credential that passes every other check is remembered in `seen`, so
    only a holder of the secret can fill it."""
    parts = credential.split(":")
    if len(parts) == 4 and parts[0] == "v1":
        return f"the caller made its credential as expertmesh releases of protocol 2 did: {_UPGRADE}"
    if (
        len(parts) != 4
        or parts[0] != _CALL_VERSION
        or not parts[1].isascii()
        or not parts[1].isdigit()
        or len(parts[1]) > 12
        or len(parts[2]) not in _NONCE_HEX_CHARS
        or not _is_hex(parts[2])
    ):
        return "a valid household secret is required"
    _, stamp, nonce, mac = parts
    if not hmac.compare_digest(mac.encode(), _credential_mac(key, method, stamp, nonce).encode()):
        return "a valid household secret is required"
    skew = int(stamp) - now
    if abs(skew) > CALL_CREDENTIAL_WINDOW_S:
        return (
            f"the caller's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} this node's "
            f"(at most {CALL_CREDENTIAL_WINDOW_S} s are allowed): set both clocks right"
        )
    return seen.admit(int(stamp), nonce, now) if seen is not None else None


class SecretInterceptor(grpc.ServerInterceptor):
    """Refuses a call without a good credential (see the module's docstring). One per server: its
    replay cache `seen` starts empty with it, so it refuses credentials made before it was built."""

    def __init__(self, secret: str, seen: ReplayCache | None = None):
        if not secret:
            raise ValueError("a household secret must not be empty")
        self._key = _call_key(secret)
        self.seen = seen if seen is not None else ReplayCache(CALL_CREDENTIAL_WINDOW_S, started=time.time())

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_SERVICES) or method in _OPEN_METHODS:
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get(AUTH_METADATA_KEY, "")
        why = check_credential(self._key, given if isinstance(given, str) else "", method, time.time(), self.seen)
        if why is not None and not given and _OLD_SECRET_METADATA_KEY in metadata:
            why = f"the caller sent the household secret itself, as expertmesh releases of protocol 1 did: {_UPGRADE}"
        if why is None:
            return continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        handler = continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
