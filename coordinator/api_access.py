"""Who may use the API: a key whenever it listens beyond loopback, and never a foreign web page.

Keys. Beyond loopback every request but `/healthz` needs `Authorization: Bearer KEY`, which is
what every OpenAI client sends for its `api_key`. On loopback the API stays open until a key
exists; from then on loopback needs one too. Keys are API keys of their own, one a line in
`$EXPERTMESH_HOME/api-keys` (mode 0600), not the household secret: the API speaks plain HTTP,
so its key crosses the LAN in clear, and a key that leaks must let its holder generate text, not
join the household as a node (the secret lets a machine serve experts to every peer). Each
person or app may get a key of its own, revoked by deleting its line: the file is read again
when it changes, with no restart. The first `serve` whose API listens beyond loopback creates
the file with one key and says where it is, never the key itself (stdout goes to logs). Keys are
compared in constant time (as SHA-256 digests, so their length leaks nothing either), and no key
is ever logged or quoted in an error.

Host and Origin. A browser runs any web page's scripts against any address it can reach; with
DNS rebinding (a name of the attacker's that resolves to this Mac) it can even read the answers.
So on every path, `/healthz` too, the `Host` header must name this machine with the API's port —
the address the client connected to, the bound address, localhost, 127.0.0.1, [::1], the
machine's host name (and its `.local` name), or a name given with `--http-allow-host` — and an
`Origin`, which browsers send with cross-origin requests and every POST, must be this very origin
(`http://` + that Host). Clients that are not browsers send no Origin; browser pages served from
elsewhere are refused, so the API sends no CORS headers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from expertmesh.coordinator.http_server import Request
from expertmesh.coordinator.openai_request import ApiError

logger = logging.getLogger(__name__)

API_KEYS_FILENAME = "api-keys"
KEY_PREFIX = "em-"
OPEN_PATHS = ("/healthz",)  # what a health probe, holding no key, may ask


def api_keys_path(home: Path) -> Path:
    return home / API_KEYS_FILENAME


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def ensure_api_key(path: Path) -> bool:
    """Give the key file at `path` one new key if it holds none; True if a key was created.

    Written to a temporary file of mode 0600 and renamed, so no reader ever sees it half
    written or readable by others."""
    if _read_keys(path):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (new_api_key() + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return True


def _read_keys(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    except OSError as e:
        logger.warning("cannot read the API key file %s: %s", path, e.strerror or e)
        return []
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    """The keys the API accepts: those of a key file (read again whenever it changes) and `keys`."""

    def __init__(self, path: Path | None = None, keys: Iterable[str] = ()):
        self.path = path
        self._fixed = [_digest(k) for k in keys]
        self._file: list[bytes] = []
        self._seen: tuple | None = None

    def _digests(self) -> list[bytes]:
        if self.path is not None:
            try:
                st = self.path.stat()
                seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                seen = None
            if seen != self._seen:
                self._seen = seen
                self._file = [_digest(k) for k in _read_keys(self.path)] if seen else []
        return self._fixed + self._file

    def __bool__(self) -> bool:
        return bool(self._digests())

    def accepts(self, key: str) -> bool:
        """Whether `key` is one of the keys, in time that depends on neither."""
        given, ok = _digest(key), False
        for known in self._digests():
            ok |= hmac.compare_digest(given, known)
        return ok


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the API on this machine (a name other than localhost: no)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _machine_names() -> set[str]:
    """This machine's own names: its host name, the first label of it, and that label + .local
    (the Bonjour name macOS answers to). No DNS lookup: one could take seconds."""
    name = socket.gethostname().lower().rstrip(".")
    short = name.split(".")[0]
    return {n for n in (name, short, f"{short}.local") if n}


def _split_authority(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header or an origin's authority, lower case; None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
    else:
        host, sep, port = value.partition(":")
        rest = sep + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    return host.rstrip("."), int(rest[1:]) if rest else None


def key_space(key: str) -> str:
    """An API key's prefix space: a domain-separated hash, never the key."""
    return hashlib.sha256(b"expertmesh prefix space\0" + key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class AccessPolicy:
    """The checks of every request; `bind_host` is the address the API listens on."""

    bind_host: str
    keys: KeyRing = field(default_factory=KeyRing)
    allowed_hosts: Iterable[str] = ()  # more names clients may use for this machine

    def __post_init__(self) -> None:
        self.loopback = is_loopback(self.bind_host)
        if not self.loopback and not self.keys:
            raise ValueError(
                f"an API on {self.bind_host} (beyond loopback) needs API keys; none is configured"
                + (f" in {self.keys.path}" if self.keys.path else "")
            )
        names = {"localhost", "127.0.0.1", "::1", *_machine_names()}
        names |= {h.lower().rstrip(".").strip("[]") for h in self.allowed_hosts}
        if self.bind_host not in ("", "0.0.0.0", "::"):
            names.add(self.bind_host.lower().strip("[]"))
        self._names = frozenset(names)

    @property
    def needs_key(self) -> bool:
        return not self.loopback or bool(self.keys)

    def describe(self) -> str:
        """One line for `serve`'s output: how clients get in (never a key)."""
        if not self.needs_key:
            return "open to this machine only: no key needed on loopback"
        where = f": keys in {self.keys.path}" if self.keys.path else ""
        return f"clients need an API key (Authorization: Bearer){where}"

    def refusal(self, request: Request, port: int) -> ApiError | None:
        """Why `request` may not be served (an ApiError to answer), or None."""
        host = request.headers.get("host", "")
        authority = _split_authority(host)
        if authority is None or not self._host_ok(*authority, request.local_address, port):
            return ApiError(
                HTTPStatus.FORBIDDEN,
                "the Host header does not name this machine (use its address, or add the name with --http-allow-host)",
                code="forbidden_host",
            )
        origin = request.headers.get("origin")
        if origin is not None and not self._same_origin(origin, authority, port):
            return ApiError(
                HTTPStatus.FORBIDDEN, "requests from other web origins are not allowed", code="forbidden_origin"
            )
        if self.needs_key and request.path.rstrip("/") not in OPEN_PATHS:
            # OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`: either
            scheme, _, key = request.headers.get("authorization", "").partition(" ")
            anthropic_key = request.headers.get("x-api-key")
            bearer_ok = scheme.lower() == "bearer" and self.keys.accepts(key.strip())
            if not bearer_ok and not (anthropic_key is not None and self.keys.accepts(anthropic_key.strip())):
                return ApiError(
                    HTTPStatus.UNAUTHORIZED,
                    "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY; see the api-keys "
                    "file in the node's home)",
                    code="invalid_api_key",
                )
        return None

    def prefix_space(self, request: Request) -> str:
        """Whose stored prompt prefixes `request` may resume from on a node (GenerateRequest's
        `prefix_space`): its API key's, as a hash (the key itself never leaves this process), so a
        caller cannot tell by the time to first token what another key sent; a request with no
        key (loopback while no key exists) is in the one shared space, "". The key is the one
        `refusal` accepted: OpenAI's `Authorization: Bearer`, else Anthropic's `x-api-key`."""
        if not self.needs_key:
            return ""
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() == "bearer" and key and self.keys.accepts(key):
            return key_space(key)
        anthropic_key = (request.headers.get("x-api-key") or "").strip()
        return key_space(anthropic_key) if anthropic_key else ""

    def _host_ok(self, name: str, port: int | None, local_address: str, bound_port: int) -> bool:
        if (port if port is not None else 80) != bound_port:
            return False
        return name in self._names or name == local_address.lower()

    @staticmethod
    def _same_origin(origin: str, authority: tuple[str, int | None], port: int) -> bool:
        scheme, sep, rest = origin.strip().lower().partition("://")
        if scheme != "http" or not sep or "/" in rest:
            return False  # "null", https (not served here), or malformed
        theirs = _split_authority(rest)
        return theirs is not None and (theirs[0], theirs[1] or 80) == (authority[0], authority[1] or 80)
