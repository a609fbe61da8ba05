"""Optional TLS for the household's gRPC: one certificate for the household, like its secret.

Macs reach each other by LAN address, which a home certificate cannot name reliably, so every
node presents a certificate for the one name `expertmesh` and every client checks that name
against the household's CA (usually that same self-signed certificate). Make one with

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \\
        -subj /CN=expertmesh -addext subjectAltName=DNS:expertmesh -keyout key.pem -out cert.pem

and give every node `--tls-cert cert.pem --tls-key key.pem` (clients: `--tls-ca cert.pem` or
EXPERTMESH_TLS_CA). The household secret is still checked on every call: TLS hides it and the
experts from the LAN, the secret decides who may ask.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from expertmesh.node import constants
from expertmesh.node.errors import ExpertmeshError

TLS_NAME = "expertmesh"  # the name household certificates carry (CN and subjectAltName)


class TlsConfigError(ExpertmeshError):
    pass


def _read_pem(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise TlsConfigError(f"the TLS {what} {path} is not a PEM file")
    return data


def server_credentials(cert: str | Path, key: str | Path) -> grpc.ServerCredentials:
    """Credentials for a node's server from its PEM certificate and key."""
    return grpc.ssl_server_credentials([(_read_pem(key, "key"), _read_pem(cert, "certificate"))])


def load_ca(path: str | Path | None = None) -> bytes | None:
    """The household CA for outgoing calls: `path`, else $EXPERTMESH_TLS_CA, else None (plain TCP)."""
    path = path or constants.household_tls_ca()
    return _read_pem(path, "CA certificate") if path else None


# A ComputeExperts answer can pass gRPC's 4 MB default; channels accept what node servers send.
# A channel to a node that went away retries its connection with a backoff that grows to gRPC's
# default of 120 s, and fails every call (health checks too) in between: a peer restarted after a
# few minutes down would stay unreachable for up to two minutes. On a LAN a connection attempt
# costs nothing, so the backoff stops growing at 1 s: a restarted node is reachable within it.
MAX_RECONNECT_BACKOFF_MS = 1000
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", constants.RPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", constants.RPC_MAX_MESSAGE_BYTES),  # what a node accepts
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]


def open_channel(address: str, ca: bytes | None = None) -> grpc.Channel:
    """A channel to a node: TLS checked against `ca` for the household name, or plain TCP."""
    if ca is None:
        return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    return grpc.secure_channel(
        address,
        grpc.ssl_channel_credentials(root_certificates=ca),
        options=[*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", TLS_NAME)],
    )
