"""Proving that a node knows the household secret without sending it: the Prove call.

A zeroconf advertisement costs nothing to forge, so it is a hint of where to look, never a
credential. Before a node sends anything that carries the secret (every call's bearer metadata,
users' prompts, activations) to a peer, the peer answers a challenge: the caller sends 32 fresh
random bytes and the address it dialed, and the peer answers with what it is (id, role, disk
budget, compute) and an HMAC over all of that, keyed by a key derived from the secret. The caller
checks the HMAC in constant time and then believes the attributes of the proof, not the TXT record.

Why each part:
- the nonce is fresh per call, so an answer cannot be replayed;
- `dialed` is signed, and a prover signs only for its own addresses (its port, on an address of its
  interfaces, loopback or the one it advertises): a stranger that advertises a member's id at its
  own address and relays the challenge to the member gets a refusal, and if it rewrites `dialed`
  the caller's check fails;
- the key is scrypt(secret), computed once per process: an answer anyone may ask for cannot be used
  to test guesses of a weak secret quickly offline.

Only TLS (tls.py) protects against an active man in the middle, who can sit on a member's own
address and relay whole connections.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from expertmesh.node.errors import ExpertmeshError
from expertmesh.v1 import node_pb2

NONCE_BYTES = 32
PROVE_DEADLINE_S = 3.0
ROLES = ("full", "cache")
_NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_DOMAIN = b"expertmesh prove v1"  # the scrypt salt and the first field of every signed message
_OWN_ADDRESSES_TTL_S = 10.0  # interfaces come and go (Wi-Fi, DHCP): looked up again after this
_MAX_DIALED_CHARS = 300


def valid_node_id(node_id: str) -> bool:
    """Whether `node_id` is a usable node id: 1 to 64 of [A-Za-z0-9._-], nothing that can forge a log line."""
    return bool(_NODE_ID.fullmatch(node_id))


@dataclass(frozen=True)
class Identity:
    """What a node says it is, signed in its proof."""

    node_id: str
    role: str
    disk_budget_bytes: int
    compute: bool
    protocol_version: int


class ProofError(ExpertmeshError):
    """A node did not prove it knows the household secret (a wrong secret, a forgery, a relay)."""


class ProofRefused(Exception):
    """The prover's side: this request is not signed; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@functools.lru_cache(maxsize=4)
def prove_key(secret: str) -> bytes:
    """The HMAC key of proofs: scrypt of the secret (slow on purpose, once per process and secret)."""
    return hashlib.scrypt(secret.encode(), salt=_DOMAIN, n=2**14, r=8, p=1, dklen=32)


def proof_message(nonce: bytes, dialed: str, identity: Identity) -> bytes:
    """The signed bytes: the domain, then every field length-prefixed (4-byte big-endian length)."""
    fields = (
        _DOMAIN,
        nonce,
        dialed.encode(),
        identity.node_id.encode(),
        identity.role.encode(),
        struct.pack(">Q", identity.disk_budget_bytes),
        struct.pack(">B", int(identity.compute)),
        struct.pack(">I", identity.protocol_version),
    )
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def sign(key: bytes, nonce: bytes, dialed: str, identity: Identity) -> bytes:
    return hmac.new(key, proof_message(nonce, dialed, identity), hashlib.sha256).digest()


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port"; ValueError if it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


class Prover:
    """A node's side of Prove: signs its identity for callers that dialed one of its own addresses.

    Args:
        secret: the household secret.
        port: the port the node's gRPC server listens on.
        advertised: hosts this node is also reached at (the address it advertises, its bound host).
    """

    def __init__(self, secret: str, port: int, advertised: Iterable[str] = ()):
        self._key = prove_key(secret)
        self.port = port
        self._advertised = {h.lower() for h in advertised if h}
        self._lock = threading.Lock()
        self._own: tuple[float, frozenset[str]] | None = None

    def _own_hosts(self) -> frozenset[str]:
        """IP addresses of this machine's interfaces, its host names and the advertised hosts."""
        with self._lock:
            if self._own is not None and time.monotonic() - self._own[0] < _OWN_ADDRESSES_TTL_S:
                return self._own[1]
        import ifaddr

        hosts = set(self._advertised) | {"localhost"}
        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                address = _ip(ip.ip if isinstance(ip.ip, str) else ip.ip[0].split("%")[0])
                if address is not None:
                    hosts.add(str(address))
        name = socket.gethostname().lower()
        hosts.update({name, name.split(".")[0] + ".local"})
        own = frozenset(hosts)
        with self._lock:
            self._own = (time.monotonic(), own)
        return own

    def is_own(self, dialed: str) -> bool:
        """Whether `dialed` (host:port) reaches this node: its port on one of its own hosts."""
        try:
            host, port = split_address(dialed)
        except ValueError:
            return False
        if port != self.port:
            return False
        ip = _ip(host)
        if ip is not None:
            return ip.is_loopback or str(ip) in self._own_hosts()
        return host.lower().rstrip(".") in self._own_hosts()

    def answer(self, request: node_pb2.ProveRequest, identity: Identity) -> node_pb2.ProveResponse:
        """The signed identity, or ProofRefused for a malformed nonce or another host's address."""
        if len(request.nonce) != NONCE_BYTES:
            raise ProofRefused(grpc.StatusCode.INVALID_ARGUMENT, f"the nonce must be {NONCE_BYTES} bytes")
        if len(request.dialed) > _MAX_DIALED_CHARS or not self.is_own(request.dialed):
            raise ProofRefused(grpc.StatusCode.PERMISSION_DENIED, "the dialed address is not one of this node's")
        return node_pb2.ProveResponse(
            node_id=identity.node_id,
            role=identity.role,
            disk_budget_bytes=identity.disk_budget_bytes,
            compute=identity.compute,
            protocol_version=identity.protocol_version,
            mac=sign(self._key, request.nonce, request.dialed, identity),
        )


def dialed_address(address: str) -> str:
    """What a caller says it dialed: `address` with a host name resolved to the IP it names now
    (the prover knows its addresses, not every name it may have); the name itself if it does not
    resolve. ValueError if `address` is not host:port."""
    host, port = split_address(address)
    if _ip(host) is None:
        try:
            host = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError):
            pass
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_proof(secret: str, nonce: bytes, dialed: str, response: node_pb2.ProveResponse) -> Identity:
    """The identity a ProveResponse signs, or ProofError (a bad MAC, id or role)."""
    identity = Identity(
        response.node_id, response.role, response.disk_budget_bytes, response.compute, response.protocol_version
    )
    expected = sign(prove_key(secret), nonce, dialed, identity)
    if not hmac.compare_digest(expected, response.mac):
        raise ProofError(f"the node at {dialed} did not prove it knows the household secret: is the secret the same?")
    if not valid_node_id(identity.node_id) or identity.role not in ROLES:
        raise ProofError(f"the node at {dialed} proved itself with an unusable node id or role")
    return identity


def prove(client, secret: str, timeout: float = PROVE_DEADLINE_S) -> Identity:
    """The identity the node behind `client` (a NodeClient) proves with `secret`; the call
    carries no secret.

    Raises:
        ProofError: no valid proof (another secret, a forgery, a relay), or an unusable address.
        grpc.RpcError: the node did not answer Prove (down, not a node, or not its own address).
    """
    try:
        dialed = dialed_address(client.address)
    except ValueError as e:
        raise ProofError(f"cannot prove the node at {client.address!r}: {e}") from None
    nonce = secrets.token_bytes(NONCE_BYTES)
    return check_proof(secret, nonce, dialed, client.prove(nonce, dialed, timeout=timeout))
