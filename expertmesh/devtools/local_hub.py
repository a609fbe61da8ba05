"""`expertmesh hub DIR`: a folder of model repos served over the Hugging Face Hub's HTTP protocol.

For demos, air-gapped households and every test: the real `huggingface_hub` client talks to
it through `HF_ENDPOINT`. It answers what that client uses — `/api/models/{repo}[/revision/{rev}]`,
`HEAD`/`GET /{repo}/resolve/{rev}/{path}` with `Range` (206 + `Content-Range`, 416), the
commit and linked-size/etag headers, and the 302 to a signed CDN-like URL for large files —
and it can behave like a CDN over a home link (bandwidth, time to first byte, faults), with
knobs settable at run time (`POST /_hub/knobs`) and counters of what it served (`GET /_hub/stats`);
with `--require-token`, those `/_hub/*` routes need the token too, and never show it.

`DIR/{namespace}/{name}/` is a repo; its commit sha is a hash of its files' names, sizes and
contents (large files by their size and their first and last MiB), or the 40 hex digits in
`.hub_commit` (a household mirror of a real repo should give its upstream commit there, so caches
agree); `main` and that sha are its revisions.

It serves repos of any size, as a household mirror of a 1.5 TB checkpoint must: start-up reads at
most 2 MiB of each large file, a range request reads only its range (`os.pread`, in chunks), and
each large file's sha256 (its LFS id) is computed once, by one background thread, and kept in
`DIR/.hub_cache/digests.json` so a restart hashes nothing again. Until a file's sha256 is known,
answers that carry it (ETag, LFS metadata) carry a provisional id made of its size and mtime.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import random
import re
import secrets
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlparse

from expertmesh.devtools import hub_quota
from expertmesh.devtools.hub_access import Access, Refusal, bearer, is_gated
from expertmesh.devtools.link_emulation import TokenBucket, take_together
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import parse_size

_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".npz")
_LFS_MIN_BYTES = 10 * 1024 * 1024
_CHUNK = 256 * 1024  # bytes read and sent at a time: bounded memory per connection
# A capped link sends what it carries in this long at a time, at least _MIN_CAPPED_CHUNK: a slow
# link then trickles to each of its connections as TCP does, instead of bursting a whole _CHUNK
# to one after the others' turns, which would read as seconds of silence on a link shared by many.
_CAPPED_SLICE_S = 0.02
_MIN_CAPPED_CHUNK = 1024
_SMALL_HASH_BYTES = 64 * 1024 * 1024  # files up to this size are hashed when first asked; larger ones in the background
_EDGE_BYTES = 1024 * 1024  # a large file enters the commit by its size and its first and last MiB
DIGESTS_FILE = Path(".hub_cache") / "digests.json"
MAX_BODY_BYTES = 1024 * 1024  # a POST body (knobs, paths-info) larger than this is refused
# cut: half the body, then the connection closes; stall: half the body, then silence for
# `stall_s`; wrong_range: a Content-Range one byte off; wrong_bytes: the right headers, flipped bytes
# (flipped differently each time, as damage in transit is: two damaged copies never agree)
FAULT_KINDS = ("429", "503", "500", "cut", "stall", "ignore_range", "wrong_range", "wrong_bytes")
# A connection that sends no request (or reads none of its answer) this long is closed. Without it a
# client that forgets a keep-alive connection holds one of the Hub's threads and descriptors until
# the Hub stops: a household mirror runs for weeks. Clients reopen closed idle connections (the
# real Hub's CDN closes them too).
IDLE_TIMEOUT_S = 60.0
# Distinct (file, byte range) pairs `/_hub/stats` counts one by one; beyond, a range not yet seen
# is counted in `ranges_untracked` only, so a long-lived mirror's memory stays bounded (K3 has
# 82,432 experts; at most four pieces each come close to this only with many clients' pieces).
MAX_TRACKED_RANGES = 100_000
POLL_S = 0.05  # how often a serving loop looks whether it should stop


@dataclass
class Fault:
    """Misbehaviour injected into matching requests: the next `count` of them, or each with `rate`."""

    kind: str
    rate: float = 0.0
    count: int = 0
    retry_after_s: float = 1.0
    stall_s: float = 5.0
    path_glob: str = "*"


@dataclass
class HubKnobs:
    bandwidth_bytes_per_s: float = 0.0  # the whole link, shared by all connections; 0 = unlimited
    per_connection_bytes_per_s: float = 0.0
    ttfb_s: float = 0.0
    connection_cost_s: float = 0.0  # paid once by each new TCP connection
    cdn_url_ttl_s: float = 3600.0
    required_token: str | None = None
    seed: int = 0
    faults: list[Fault] = field(default_factory=list)
    # requests per window by bucket ("api", "resolvers"; hub_quota.py), per client; none: unlimited
    rate_limits: dict[str, int] = field(default_factory=dict)
    rate_window_s: float = hub_quota.WINDOW_S
    tree_page_size: int = 1000  # entries per page of `/tree` (the Hub's, huggingface_hub's hf_api.py says)
    siblings_limit: int = 0  # list at most this many files in model_info's `siblings` (0: all)

    def update(self, doc: dict) -> None:
        """Set knobs from a `POST /_hub/knobs` body, all or none. `required_token` is fixed when
        the Hub starts: a request may not change or drop the token that guards it.

        Raises:
            ValueError: an unknown knob, `required_token`, or a value of the wrong type.
        """
        if not isinstance(doc, dict):
            raise ValueError("the knobs must be a JSON object")
        new: dict = {}
        for k, v in doc.items():
            if k == "required_token":
                raise ValueError("required_token is set when the Hub starts (--require-token), not at run time")
            if k == "faults":
                if not isinstance(v, list):
                    raise ValueError("faults must be a list of objects")
                new[k] = [_fault_from(f) for f in v]
            elif k == "seed":
                if type(v) is not int:
                    raise ValueError("seed must be an integer")
                new[k] = v
            elif k in ("tree_page_size", "siblings_limit"):
                if type(v) is not int or v < (1 if k == "tree_page_size" else 0):
                    raise ValueError(f"{k} must be a {'positive' if k == 'tree_page_size' else 'non-negative'} integer")
                new[k] = v
            elif k == "rate_limits":
                new[k] = _rate_limits_from(v)
            elif k in self.__dataclass_fields__:
                new[k] = _non_negative(k, v)
            else:
                raise ValueError(f"unknown knob {k!r}")
        for k, v in new.items():
            setattr(self, k, v)

    def public(self) -> dict:
        """The knobs as `GET /_hub/knobs` shows them: whether a token is required, never the token."""
        doc = asdict(self)
        del doc["required_token"]
        doc["token_required"] = bool(self.required_token)
        return doc


def _non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a non-negative number")
    return float(value)


def _rate_limits_from(doc: object) -> dict[str, int]:
    if not isinstance(doc, dict) or not all(
        k in hub_quota.BUCKETS and type(v) is int and v >= 0 for k, v in doc.items()
    ):
        raise ValueError(f"rate_limits must map buckets ({', '.join(hub_quota.BUCKETS)}) to request counts")
    return dict(doc)


def _fault_from(doc: object) -> Fault:
    """A Fault from JSON, every field of its type (a bad one would fail later, inside a request)."""
    if not isinstance(doc, dict) or doc.get("kind") not in FAULT_KINDS:
        raise ValueError(f"a fault is an object with a kind in {', '.join(FAULT_KINDS)}")
    fault = Fault(doc["kind"])
    for k, v in doc.items():
        if k == "kind":
            continue
        if k == "path_glob":
            if not isinstance(v, str):
                raise ValueError("a fault's path_glob must be a string")
            fault.path_glob = v
        elif k == "count":
            if type(v) is not int or v < 0:
                raise ValueError("a fault's count must be a non-negative integer")
            fault.count = v
        elif k in ("rate", "retry_after_s", "stall_s"):
            setattr(fault, k, _non_negative(f"a fault's {k}", v))
        else:
            raise ValueError(f"unknown fault setting {k!r}")
    return fault


@dataclass
class _File:
    path: Path
    size: int
    mtime_ns: int

    @property
    def provisional_id(self) -> str:
        """Stands for the sha256 until it is known: changes when the file does."""
        return hashlib.sha256(f"{self.size}:{self.mtime_ns}:{self.path.name}".encode()).hexdigest()


@dataclass
class _Repo:
    repo_id: str
    path: Path
    commit: str
    files: dict[str, _File]


def _is_lfs(name: str, f: _File) -> bool:
    return name.endswith(_LFS_SUFFIXES) or f.size >= _LFS_MIN_BYTES


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(4 * 1024 * 1024):
            h.update(block)
    return h.hexdigest()


def _content_mark(f: _File) -> bytes:
    """What a file adds to its repo's commit: all its bytes if small, else its size and edges."""
    if f.size <= _SMALL_HASH_BYTES:
        return hashlib.sha256(f.path.read_bytes()).digest()
    with open(f.path, "rb") as fh:
        head = os.pread(fh.fileno(), _EDGE_BYTES, 0)
        tail = os.pread(fh.fileno(), _EDGE_BYTES, f.size - _EDGE_BYTES)
    return hashlib.sha256(str(f.size).encode() + head + tail).digest()


def _scan(root: Path) -> dict[str, _Repo]:
    repos = {}
    for ns in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for rp in sorted(p for p in ns.iterdir() if p.is_dir() and not p.name.startswith(".")):
            files = {}
            for path in sorted(rp.rglob("*")):
                if path.is_file() and not any(part.startswith(".") for part in path.relative_to(rp).parts):
                    st = path.stat()
                    files[str(path.relative_to(rp))] = _File(path, st.st_size, st.st_mtime_ns)
            commit_file = rp / ".hub_commit"
            if commit_file.is_file():
                commit = commit_file.read_text().strip()
            else:
                h = hashlib.sha1()
                for name, f in files.items():
                    h.update(name.encode() + b"\0" + _content_mark(f))
                commit = h.hexdigest()
            repos[f"{ns.name}/{rp.name}"] = _Repo(f"{ns.name}/{rp.name}", rp, commit, files)
    return repos


class _Digests:
    """The sha256 of served files, each computed once and kept on disk across restarts (keyed by
    path, size and mtime, so a changed file is hashed again). Small files are hashed when first
    asked; large ones by `hash_all`, which a background thread runs."""

    def __init__(self, root: Path):
        self.path = root / DIGESTS_FILE
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        try:
            self._known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self._known = {}

    @staticmethod
    def _key(f: _File) -> str:
        return f"{f.path}|{f.size}|{f.mtime_ns}"

    def get(self, f: _File) -> str | None:
        """The file's sha256, or None while a large file waits for the background hasher."""
        with self._lock:
            known = self._known.get(self._key(f))
        if known is None and f.size <= _SMALL_HASH_BYTES:
            known = self._compute(f)
        return known

    def id_of(self, f: _File) -> str:
        return self.get(f) or f.provisional_id

    def _compute(self, f: _File) -> str:
        digest = _sha256_of(f.path)
        with self._lock:
            self._known[self._key(f)] = digest
        return digest

    def hash_all(self, files: list[_File]) -> None:
        """Hash every large file not known yet, one at a time, saving after each (a background job)."""
        for f in files:
            if self._stop.is_set():
                return
            with self._lock:
                if self._key(f) in self._known or f.size <= _SMALL_HASH_BYTES:
                    continue
            try:
                self._compute(f)
                self._save()
            except OSError as e:
                logging.getLogger(__name__).warning("cannot hash %s: %s", f.path, e)

    def _save(self) -> None:
        with self._lock:
            doc = json.dumps(self._known)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(doc)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only mirror still serves; it hashes again after a restart
            logging.getLogger(__name__).warning("cannot keep file digests in %s: %s", self.path, e)

    def stop(self) -> None:
        self._stop.set()


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.all_sent = threading.Condition(self.lock)
        self.waiting = 0  # requests waiting for their first byte now (not reset: they still wait)
        self.sending = 0  # bodies being sent now: a client may hold every byte before they are counted
        self.reset()

    def reset(self) -> None:
        self.peak_waiting = self.waiting  # the most requests awaiting their first byte at once: a client's concurrency
        self.requests = 0
        self.redirects = 0  # 302s to the CDN: a client that remembers them pays one per shard
        self.bytes_served = 0
        self.connections = 0
        self.faults: dict[str, int] = {}
        self.rate_limited: dict[str, int] = {}  # 429s answered for a used-up quota, by bucket
        self.cdn_requests = 0  # requests to the CDN's origin
        self.cdn_with_token = 0  # of them, carrying an Authorization header: the Hub token leaked
        self.cdn_expired = 0  # signed URLs refused as expired
        self.files: dict[str, dict] = {}  # only files that exist: a request for any name cannot grow it
        self.tracked_ranges = 0
        self.ranges_untracked = 0  # ranges served beyond MAX_TRACKED_RANGES distinct ones

    def count_range(self, key: str, first: int, last: int) -> None:
        """One more answer of bytes `first`..`last` of `key` (under `lock`)."""
        ranges = self.file(key)["ranges"]
        r = (first, last)
        if r in ranges:
            ranges[r] += 1
        elif self.tracked_ranges < MAX_TRACKED_RANGES:
            ranges[r] = 1
            self.tracked_ranges += 1
        else:
            self.ranges_untracked += 1

    def file(self, key: str) -> dict:
        return self.files.setdefault(key, {"requests": 0, "bytes": 0, "ranges": {}})

    def as_json(self, wait_s: float = 2.0) -> dict:
        """The counts, once every body being sent has been counted (at most `wait_s` later): the
        last bytes reach a client before the thread that sent them records them."""
        with self.lock:
            self.all_sent.wait_for(lambda: self.sending == 0, timeout=wait_s)
            files = {
                k: {
                    "requests": v["requests"],
                    "bytes": v["bytes"],
                    "ranges": [[a, b, n] for (a, b), n in sorted(v["ranges"].items())],
                }
                for k, v in self.files.items()
            }
            return {
                "requests": self.requests,
                "bytes_served": self.bytes_served,
                "connections": self.connections,
                "redirects": self.redirects,
                "peak_waiting": self.peak_waiting,
                "faults": dict(self.faults),
                "rate_limited": dict(self.rate_limited),
                "cdn_requests": self.cdn_requests,
                "cdn_with_token": self.cdn_with_token,
                "cdn_expired": self.cdn_expired,
                "files": files,
                "ranges_untracked": self.ranges_untracked,
            }


class HubServer:
    """The local Hub, serving in background threads; use as a context manager.

    It listens on two origins, as the real service does: the Hub's own (the API, `/resolve/`) and
    a CDN's (another port), to which large files are redirected by signed URLs that need no token.
    """

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        knobs: HubKnobs | None = None,
        hash_in_background: bool = True,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        like_huggingface: bool = False,
        user_tokens: tuple[str, ...] = (),
        cdn_port: int = 0,
    ):
        """`hash_in_background`: start hashing large files' sha256 when serving starts (tests turn
        it off to see the provisional ids). `idle_timeout_s`: see IDLE_TIMEOUT_S.
        `like_huggingface`: answer as huggingface.co does where it differs from the simpler rules
        (small files by a relative 307 to `/api/resolve-cache/`, the account and gating answers of
        hub_access.py, the anonymous tier's rate limits unless `knobs` set others);
        `user_tokens`: the tokens of the accounts it knows. `cdn_port`: the CDN's (0: any free one)."""
        self.root = Path(root)
        self.hash_in_background = hash_in_background
        self.like_huggingface = like_huggingface
        self.repos = _scan(self.root)
        self.digests = _Digests(self.root)
        self.knobs = knobs or HubKnobs()
        if like_huggingface and knobs is None:
            self.knobs.rate_limits = dict(hub_quota.ANONYMOUS_QUOTAS)
        self.user_tokens = tuple(user_tokens)
        self.quotas = hub_quota.Quotas()
        # signs CDN URLs, a key per Key-Pair-Id; a restart voids the URLs handed out
        self._cdn_keys = {_key_pair_id(0): secrets.token_bytes(32)}
        self._cdn_key_id = _key_pair_id(0)
        self.stats_ = _Stats()
        self.link = TokenBucket()
        self.rng = random.Random(self.knobs.seed)
        self.fault_lock = threading.Lock()
        self._damaged = 0  # wrong_bytes answers so far (each flips its bytes its own way)
        # `timeout` is the socket's: a request line, header or send waiting longer ends the connection
        handler = type("Handler", (_Handler,), {"hub": self, "timeout": idle_timeout_s})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        bound, self.port = self.httpd.server_address[:2]
        self.host = bound.decode() if isinstance(bound, (bytes, bytearray)) else bound
        self.url = f"http://{self.host}:{self.port}"
        self.cdn_httpd = ThreadingHTTPServer((host, cdn_port), handler)
        self.cdn_httpd.daemon_threads = True
        self.cdn_port = self.cdn_httpd.server_address[1]
        self.cdn_url_base = f"http://{self.host}:{self.cdn_port}"  # where the signed URLs point
        self._threads: list[threading.Thread] = []

    @property
    def access(self) -> Access:
        """The rules a request is checked by now (hub_access.py)."""
        return Access(self.like_huggingface, self.knobs.required_token, self.user_tokens)

    def cdn_url(self, repo_id: str, commit: str, name: str) -> str:
        """A CDN URL for one file, CloudFront-style: valid until its `Expires` (`cdn_url_ttl_s` from
        now), its path naming the file, its `Signature` an HMAC-SHA256 of both under the key its
        `Key-Pair-Id` names, so only URLs this Hub handed out (to a client that passed
        `/resolve/`'s access check) are served."""
        token = base64.urlsafe_b64encode(json.dumps([repo_id, commit, name]).encode()).decode()
        expires = str(int(time.time() + self.knobs.cdn_url_ttl_s))
        key_id = self._cdn_key_id
        signature = self._cdn_mac(self._cdn_keys[key_id], token, expires)
        return f"{self.cdn_url_base}/_cdn/{token}?Expires={expires}&Signature={signature}&Key-Pair-Id={key_id}"

    @staticmethod
    def _cdn_mac(key: bytes, token: str, expires: str) -> str:
        return hmac.new(key, f"{token}|{expires}".encode(), hashlib.sha256).hexdigest()

    def expire_cdn_urls(self) -> None:
        """Make every CDN URL handed out so far expired, as if the clock had passed their
        `Expires`: the signing key is replaced, and URLs signed with an old one get a 403
        "Request has expired" (a test's way to expire URLs mid-generation without waiting)."""
        key_id = _key_pair_id(len(self._cdn_keys))
        self._cdn_keys[key_id] = secrets.token_bytes(32)
        self._cdn_key_id = key_id

    def cdn_verify(self, token: str, query: dict) -> tuple[str, str, str] | str:
        """`(repo_id, commit, name)` of a valid, unexpired CDN URL, else why it is refused.

        The signature is checked (in constant time) before the token is decoded, and the decoded
        values are checked for their types anyway: a request can make this fail, never raise.
        """
        expires, sig = query.get("Expires", [""])[0], query.get("Signature", [""])[0]
        key_id = query.get("Key-Pair-Id", [""])[0]
        key = self._cdn_keys.get(key_id)
        if key is None or not (expires.isascii() and expires.isdigit() and len(expires) <= 12):
            return "Access denied"
        if not hmac.compare_digest(sig.encode(), self._cdn_mac(key, token, expires).encode()):
            return "Access denied"
        if time.time() > int(expires) or key_id != self._cdn_key_id:
            return "Request has expired"
        try:
            doc = json.loads(base64.urlsafe_b64decode(token))
        except ValueError:  # binascii.Error, bad JSON and bad UTF-8 are ValueErrors
            return "Access denied"
        if not (isinstance(doc, list) and len(doc) == 3 and all(isinstance(x, str) for x in doc)):
            return "Access denied"
        return doc[0], doc[1], doc[2]

    def start(self) -> HubServer:
        for server, name in ((self.httpd, "expertmesh-hub"), (self.cdn_httpd, "expertmesh-hub-cdn")):
            # each loop notices `stop` within its poll interval: tests start and stop many Hubs
            thread = threading.Thread(target=server.serve_forever, args=(POLL_S,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.hash_in_background:
            threading.Thread(
                target=self.digests.hash_all, args=(self.large_files(),), name="expertmesh-hub-hash", daemon=True
            ).start()
        return self

    def large_files(self) -> list[_File]:
        return [f for repo in self.repos.values() for name, f in repo.files.items() if _is_lfs(name, f)]

    def stop(self) -> None:
        self.digests.stop()
        for server in (self.httpd, self.cdn_httpd):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def rescan(self) -> None:
        """Serve the repos under the root as they are now (a repo written after the Hub started)."""
        self.repos = _scan(self.root)

    def stats(self) -> dict:
        return self.stats_.as_json()

    def bytes_served(self) -> int:
        """Bytes sent so far; cheap enough to ask after every token (`stats` copies every range)."""
        return self.stats_.bytes_served

    def damage_mask(self) -> int:
        """The byte a `wrong_bytes` answer XORs its body with: another one for each answer, so
        two damaged copies of a range never agree (as two fresh copies from the Hub that agree
        are taken as the truth by the digest book, node/store/integrity.py)."""
        with self.fault_lock:
            self._damaged += 1
            return self._damaged % 255 + 1

    def pick_fault(self, path: str, kinds: tuple[str, ...]) -> Fault | None:
        with self.fault_lock:
            for f in self.knobs.faults:
                if f.kind not in kinds or not fnmatch.fnmatch(path, f.path_glob):
                    continue
                if f.count > 0:
                    f.count -= 1
                elif not (f.rate > 0 and self.rng.random() < f.rate):
                    continue
                with self.stats_.lock:
                    self.stats_.faults[f.kind] = self.stats_.faults.get(f.kind, 0) + 1
                return f
        return None


def _capped_chunk(knobs: HubKnobs) -> int:
    """Bytes sent at a time on a capped link: `_CAPPED_SLICE_S` of its slowest cap, within bounds."""
    rate = min(r for r in (knobs.bandwidth_bytes_per_s, knobs.per_connection_bytes_per_s) if r > 0)
    return int(min(_CHUNK, max(_MIN_CAPPED_CHUNK, rate * _CAPPED_SLICE_S)))


def _git_blob_id(f: _File) -> str:
    """A small file's git blob id: what the Hub gives as its ETag and tree `oid`."""
    data = f.path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _key_pair_id(n: int) -> str:
    """The name of the `n`th CDN signing key (CloudFront names its key pairs `K...`)."""
    return f"KEXPERTMESH{n:04d}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes: Nagle would stall each response ~40 ms
    hub: HubServer
    _more_headers: dict[str, str]  # sent with this request's answer, whatever it is (RateLimit)

    def log_message(self, format: str, *args) -> None:  # quiet: tests and demos read stdout
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass  # the client hung up (a cancelled fetch, a closed keep-alive connection) or went silent

    def setup(self) -> None:
        super().setup()
        self.bucket = TokenBucket()
        self._more_headers = {}
        with self.hub.stats_.lock:
            self.hub.stats_.connections += 1
        if self.hub.knobs.connection_cost_s:
            time.sleep(self.hub.knobs.connection_cost_s)

    # -- plumbing ----------------------------------------------------------------------------

    def end_headers(self) -> None:
        for k, v in self._more_headers.items():
            self.send_header(k, v)
        super().end_headers()

    def _send(
        self, status: int, body: bytes = b"", headers: dict | None = None, content_type: str = "application/json"
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers)

    @property
    def _token(self) -> str | None:
        return bearer(self.headers.get("Authorization", ""))

    def _hub_route_authorized(self) -> bool:
        """The `/_hub/*` routes (knobs, stats) need the Hub's `--require-token` whenever one is set."""
        wanted = self.hub.knobs.required_token
        if not wanted or hmac.compare_digest(
            self.headers.get("Authorization", "").encode(), f"Bearer {wanted}".encode()
        ):
            return True
        if self.headers.get("Authorization"):
            self._error(401, None, "Invalid credentials in Authorization header")
        else:
            self._error(401, "RepoNotFound", "Repository not found")
        return False

    def _repo(self, repo_id: str, files: bool) -> _Repo | None:
        """The repo, if this request may see it (`files`: its content, which a gating guards);
        else None, after answering as the Hub does (hub_access.py)."""
        repo = self.hub.repos.get(repo_id)
        refusal = self.hub.access.check(self._token, repo.path if repo else None, repo_id, files, self.hub.url)
        if refusal is None:
            return repo
        self._refuse(refusal)
        return None

    def _refuse(self, refusal: Refusal) -> None:
        self._error(refusal.status, refusal.code, refusal.message)

    def _count(self, key: str | None) -> None:
        with self.hub.stats_.lock:
            self.hub.stats_.requests += 1
            if key:
                self.hub.stats_.file(key)["requests"] += 1

    def _revision(self, repo: _Repo, rev: str) -> bool:
        if rev in ("main", repo.commit) or (len(rev) >= 7 and repo.commit.startswith(rev)):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    def _within_quota(self, path: str) -> bool:
        """Count this request against its bucket's quota (hub_quota.py), its state going out with
        the answer; False after answering 429 when the quota is used up (no Retry-After, as the Hub)."""
        self._more_headers = {}
        bucket = hub_quota.bucket_of(path)
        quota = self.hub.knobs.rate_limits.get(bucket) if bucket else None
        if bucket is None or quota is None:
            return True
        client = self._token or self.client_address[0]  # anonymous requests per IP, others per account
        answer = self.hub.quotas.take(client, bucket, quota, self.hub.knobs.rate_window_s)
        self._more_headers = answer.headers
        if answer.allowed:
            return True
        with self.hub.stats_.lock:
            self.hub.stats_.rate_limited[bucket] = self.hub.stats_.rate_limited.get(bucket, 0) + 1
        self._error(429, None, f"You have exceeded our {bucket} rate limit. Try again later or log in for more quota.")
        return False

    @property
    def _on_cdn(self) -> bool:
        return self.server is self.hub.cdn_httpd

    # -- routes ------------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self.do_GET()

    def _body(self) -> bytes | None:
        """The request body, or None after answering 400 for a Content-Length that is not a
        decimal number of at most MAX_BODY_BYTES (the connection then closes: its body is unread)."""
        text = self.headers.get("Content-Length") or "0"
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_BODY_BYTES:
            self.close_connection = True
            self._error(400, None, f"bad Content-Length {text[:20]!r}")
            return None
        return self.rfile.read(int(text))

    def do_POST(self) -> None:
        url = urlparse(self.path)
        self._more_headers = {}
        body = self._body()
        if body is None:
            return
        path = unquote(url.path)
        if self._on_cdn:
            return self._error(404, None, "not found")
        if path.startswith("/_hub/") and not self._hub_route_authorized():
            return
        if path == "/_hub/knobs":
            try:
                self.hub.knobs.update(json.loads(body or b"{}"))
            except (ValueError, TypeError) as e:  # JSON errors are ValueErrors too
                return self._error(400, None, str(e))
            return self._send(200, json.dumps(self.hub.knobs.public()).encode())
        if path == "/_hub/cdn/expire":
            self.hub.expire_cdn_urls()
            return self._send(200, b"{}")
        if path == "/_hub/stats/reset":
            with self.hub.stats_.lock:
                self.hub.stats_.reset()
            self.hub.quotas.reset()
            return self._send(200, b"{}")
        if not self._within_quota(path):
            return
        if m := re.match(r"^/api/models/([^/]+/[^/]+)/paths-info/([^/]+)$", path):
            ctype = self.headers.get("Content-Type", "")
            try:
                form = json.loads(body) if "json" in ctype else dict(parse_qs(body.decode()))
            except ValueError:  # bad JSON, or bytes that are not UTF-8
                return self._error(400, None, "malformed paths-info request")
            paths = form.get("paths", []) if isinstance(form, dict) else None
            paths = [paths] if isinstance(paths, str) else paths
            if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths):
                return self._error(400, None, "paths must be a list of strings")
            return self._paths_info(m.group(1), m.group(2), paths)
        self._error(404, None, "not found")

    def do_GET(self) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        self._more_headers = {}
        if self._on_cdn:
            with self.hub.stats_.lock:
                self.hub.stats_.cdn_requests += 1
                self.hub.stats_.cdn_with_token += "Authorization" in self.headers
            self._await_first_byte()
            if m := re.match(r"^/_cdn/([A-Za-z0-9_=-]+)$", path):
                return self._cdn(m.group(1), parse_qs(url.query))
            self._count(None)
            return self._error(404, None, "not found")
        if path.startswith("/_hub/") and not self._hub_route_authorized():
            return
        if path == "/_hub/stats":
            return self._send(200, json.dumps(self.hub.stats()).encode())
        if path == "/_hub/knobs":
            return self._send(200, json.dumps(self.hub.knobs.public()).encode())
        if path == "/_hub/health":
            return self._send(200, b'{"status":"ok"}')
        if not self._within_quota(path):
            return
        self._await_first_byte()
        self._answer(url, path)

    def _await_first_byte(self) -> None:
        """The emulated time to first byte, counting the requests that wait in it at once.

        Counted before any byte is sent, so a client cannot have finished a request and started
        its next one while the first is still counted: the peak is exactly the client's concurrency
        (counting until the last byte would overlap a request's tail with the next one's head).
        """
        stats = self.hub.stats_
        with stats.lock:
            stats.waiting += 1
            stats.peak_waiting = max(stats.peak_waiting, stats.waiting)
        try:
            if self.hub.knobs.ttfb_s:
                time.sleep(self.hub.knobs.ttfb_s)
        finally:
            with stats.lock:
                stats.waiting -= 1

    def _answer(self, url, path: str) -> None:
        if m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)/?(.*)$", path):
            return self._tree(m.group(1), m.group(2), m.group(3), parse_qs(url.query))
        if m := re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/(.+))?/?$", path):
            return self._model_info(m.group(1), m.group(2) or "main", parse_qs(url.query))
        if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
            return self._resolve(m.group(1), m.group(2), m.group(3))
        if m := re.match(r"^/api/resolve-cache/models/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)$", path):
            return self._resolve_cache(m.group(1), m.group(2), m.group(3))
        if path == "/api/whoami-v2" and self.hub.like_huggingface:  # only this mode knows accounts
            return self._whoami()
        self._count(None)
        self._error(404, None, "not found")

    def _whoami(self) -> None:
        self._count(None)
        if not self.hub.access.knows(self._token):
            return self._error(401, None, "Invalid credentials in Authorization header")
        self._send(200, json.dumps({"type": "user", "name": "expertmesh-user"}).encode())

    def _model_info(self, repo_id: str, rev: str, query: dict) -> None:
        self._count(None)
        if fault := self.hub.pick_fault(f"{repo_id}/", ("429", "503", "500")):
            return self._fault_status(fault)
        repo = self._repo(repo_id, files=False)
        if repo is None or not self._revision(repo, rev):
            return
        siblings = []
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")  # HfApi's files_metadata=True
        for name, f in repo.files.items():
            sib: dict = {"rfilename": name}
            if blobs:
                sib["size"] = f.size
                if _is_lfs(name, f):
                    sib["lfs"] = {"sha256": self.hub.digests.id_of(f), "size": f.size, "pointerSize": 134}
            siblings.append(sib)
        if self.hub.knobs.siblings_limit:
            siblings = siblings[: self.hub.knobs.siblings_limit]
        doc = {
            "_id": repo_id,
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.commit,
            "private": (repo.path / ".hub_private").is_file(),
            "gated": "manual" if is_gated(repo.path) else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "lastModified": "2026-01-01T00:00:00.000Z",
            "siblings": siblings,
        }
        self._send(200, json.dumps(doc).encode())

    def _tree(self, repo_id: str, rev: str, folder: str, query: dict) -> None:
        """One page of a folder's listing (recursive if asked), and a `Link` to the next page.

        As the Hub pages it: at most `tree_page_size` entries, then `Link: <...&cursor=...>;
        rel="next"`, the cursor opaque (huggingface_hub's `paginate` follows `next`, hf_api.py's
        `_iter_repo_tree_pages`)."""
        self._count(None)
        repo = self._repo(repo_id, files=False)
        if repo is None or not self._revision(repo, rev):
            return
        folder = folder.strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, dirs = [], set()
        for name, f in repo.files.items():
            if folder and not name.startswith(folder + "/"):
                continue
            rel = name[len(folder) + 1 :] if folder else name
            parents = rel.split("/")[:-1]
            for depth in range(1, (len(parents) if recursive else min(1, len(parents))) + 1):
                dirs.add((f"{folder}/" if folder else "") + "/".join(parents[:depth]))
            if recursive or not parents:
                entries.append(self._file_entry(name, f))
        entries += [
            {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0}
            for d in sorted(dirs)
        ]
        size = self.hub.knobs.tree_page_size
        cursor = query.get("cursor", [""])[0]
        try:
            first = int(base64.urlsafe_b64decode(cursor.encode()).decode()) if cursor else 0
        except ValueError:
            return self._error(400, None, "invalid cursor")
        headers = {}
        if first + size < len(entries):
            nxt = base64.urlsafe_b64encode(str(first + size).encode()).decode()
            link = f"{self.hub.url}/api/models/{repo_id}/tree/{rev}{'/' + folder if folder else ''}"
            headers["Link"] = f'<{link}?recursive={str(recursive).lower()}&cursor={nxt}>; rel="next"'
        self._send(200, json.dumps(entries[first : first + size]).encode(), headers)

    def _paths_info(self, repo_id: str, rev: str, paths: list[str]) -> None:
        """The named paths' entries (POST `paths-info`)."""
        self._count(None)
        repo = self._repo(repo_id, files=False)
        if repo is None or not self._revision(repo, rev):
            return
        entries = [self._file_entry(name, f) for name, f in repo.files.items() if name in paths]
        self._send(200, json.dumps(entries).encode())

    def _file_entry(self, name: str, f: _File) -> dict:
        if _is_lfs(name, f):
            sha = self.hub.digests.id_of(f)
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {f.size}\n".encode()
            oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
            return {
                "type": "file",
                "path": name,
                "size": f.size,
                "oid": oid,
                "lfs": {"oid": sha, "size": f.size, "pointerSize": len(pointer)},
            }
        return {"type": "file", "path": name, "size": f.size, "oid": _git_blob_id(f)}

    def _fault_status(self, fault: Fault) -> None:
        code = int(fault.kind)
        headers = {"Retry-After": str(int(fault.retry_after_s))} if code in (429, 503) else {}
        self._send(code, json.dumps({"error": f"injected {code}"}).encode(), headers)

    def _resolve(self, repo_id: str, rev: str, name: str) -> None:
        """A file of a revision: a large (LFS) one by a 302 to a signed URL on the CDN's origin; a
        small (git) one served here, or, `like_huggingface`, by a relative 307 to the resolve
        cache (as huggingface.co answers `curl -I .../resolve/main/config.json`: the `Location`
        huggingface/swift-transformers pull request 209 quotes)."""
        key = f"{repo_id}/{name}"
        known = self.hub.repos.get(repo_id)
        self._count(key if known is not None and name in known.files else None)  # a missing name: no entry
        if fault := self.hub.pick_fault(key, ("429", "503", "500")):
            return self._fault_status(fault)
        repo = self._repo(repo_id, files=True)
        if repo is None or not self._revision(repo, rev):
            return
        f = repo.files.get(name)
        if f is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {rev}")
        common = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if _is_lfs(name, f):
            sha = self.hub.digests.id_of(f)
            headers = {
                **common,
                "ETag": f'"{sha}"',
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(f.size),
                "Location": self.hub.cdn_url(repo_id, repo.commit, name),
            }
            with self.hub.stats_.lock:
                self.hub.stats_.redirects += 1
            return self._send(302, b"", headers)
        etag = _git_blob_id(f)
        if self.hub.like_huggingface:
            original = quote(f"/{repo_id}/resolve/{rev}/{name}", safe="")
            location = f"/api/resolve-cache/models/{repo_id}/{repo.commit}/{quote(name)}?{original}=&etag=%22{etag}%22"
            body = f"Temporary Redirect. Redirecting to {location}".encode()
            return self._send(307, body, {**common, "Location": location}, content_type="text/plain; charset=utf-8")
        self._serve_file(key, f, {**common, "ETag": f'"{etag}"'})

    def _resolve_cache(self, repo_id: str, commit: str, name: str) -> None:
        """A small file of a pinned commit, where `_resolve` redirects it (same origin, same access
        check: the token must come along, as huggingface_hub sends it on a same-origin redirect)."""
        key = f"{repo_id}/{name}"
        known = self.hub.repos.get(repo_id)
        self._count(key if known is not None and name in known.files else None)
        repo = self._repo(repo_id, files=True)
        if repo is None:
            return
        f = repo.files.get(name)
        if repo.commit != commit or f is None or _is_lfs(name, f):
            return self._error(404, "EntryNotFound", f"{name} does not exist on {commit}")
        headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes", "ETag": f'"{_git_blob_id(f)}"'}
        self._serve_file(key, f, headers)

    def _cdn(self, token: str, query: dict) -> None:
        """A signed URL this Hub issued (`HubServer.cdn_url`), before it expires; nothing else.
        A refusal is a 403 as S3 and CloudFront give it (an XML `<Error>`), "Request has expired"
        for a URL past its `Expires`."""
        signed = self.hub.cdn_verify(token, query)
        if isinstance(signed, str):
            self._count(None)
            if signed == "Request has expired":
                with self.hub.stats_.lock:
                    self.hub.stats_.cdn_expired += 1
            body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>{signed}</Message></Error>"
            return self._send(403, body.encode(), {"X-Error-Message": signed}, content_type="application/xml")
        repo_id, commit, name = signed
        key = f"{repo_id}/{name}"
        self._count(key)
        if fault := self.hub.pick_fault(key, ("429", "503", "500")):
            return self._fault_status(fault)
        repo = self.hub.repos.get(repo_id)
        if repo is None or repo.commit != commit or name not in repo.files:
            return self._error(404, None, "not found")
        f = repo.files[name]
        sha = f'"{self.hub.digests.id_of(f)}"'
        self._serve_file(key, f, {"ETag": sha, "Accept-Ranges": "bytes"})

    def _serve_file(self, key: str, f: _File, headers: dict) -> None:
        """The file, or the range asked for, read in chunks as it is sent (never the whole file)."""
        size = f.size
        status, start, end = 200, 0, size
        rng = self.headers.get("Range")
        body_faults = ("cut", "stall", "ignore_range", "wrong_range", "wrong_bytes")
        fault = self.hub.pick_fault(key, body_faults) if self.command == "GET" else None
        if rng and not (fault and fault.kind == "ignore_range"):
            m = re.match(r"^bytes=(\d*)-(\d*)$", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})  # multi-range: unsupported
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                start, end = max(0, size - int(m.group(2))), size
            if start >= size or start >= end:
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
            status = 206
            shift = 1 if fault and fault.kind == "wrong_range" else 0
            headers = {**headers, "Content-Range": f"bytes {start + shift}-{end - 1 + shift}/{size}"}
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        length = end - start
        limit = length // 2 if fault and fault.kind in ("cut", "stall") else length
        sent, mask = 0, 0
        knobs = self.hub.knobs
        with self.hub.stats_.lock:
            self.hub.stats_.sending += 1
        try:
            capped = bool(knobs.bandwidth_bytes_per_s or knobs.per_connection_bytes_per_s)
            with open(f.path, "rb") as fh:
                chunk_bytes = _capped_chunk(knobs) if capped else limit
                while sent < limit:
                    want = min(chunk_bytes, limit - sent)
                    take_together(
                        want,
                        (self.hub.link, knobs.bandwidth_bytes_per_s),
                        (self.bucket, knobs.per_connection_bytes_per_s),
                    )
                    if fault and fault.kind == "wrong_bytes":
                        mask = mask or self.hub.damage_mask()
                        chunk = bytes(b ^ mask for b in os.pread(fh.fileno(), want, start + sent))
                        self.wfile.write(chunk)
                        n = len(chunk)
                    else:
                        # the kernel copies file pages to the socket: no Python buffer, GIL released
                        n = self.connection.sendfile(fh, offset=start + sent, count=want)
                    if not n:
                        break  # the file shrank under us: the client sees a short body and retries
                    sent += n
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            self.close_connection = True  # the client went away (a cancelled fetch) or stopped reading
            return
        finally:
            with self.hub.stats_.lock:
                self.hub.stats_.bytes_served += sent
                self.hub.stats_.file(key)["bytes"] += sent
                self.hub.stats_.count_range(key, start, start + sent - 1)
                self.hub.stats_.sending -= 1
                self.hub.stats_.all_sent.notify_all()
        if fault is not None and limit < length:
            self.wfile.flush()
            if fault.kind == "stall":
                time.sleep(fault.stall_s)
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


def add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bandwidth", type=parse_size, default=0, help="total link bytes/s, e.g. 100MB (0: unlimited)")
    parser.add_argument("--per-connection-bandwidth", type=parse_size, default=0, help="bytes/s of one connection")
    parser.add_argument("--ttfb", type=float, default=0.0, help="seconds before each response")
    parser.add_argument("--connection-cost", type=float, default=0.0, help="seconds added to each new connection")
    parser.add_argument("--require-token", help="token every request must present (Authorization: Bearer)")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:SPEC",
        type=parse_fault,
        help=f"inject faults, KIND in {', '.join(FAULT_KINDS)}; SPEC e.g. rate=0.1 or count=3,retry_after=2",
    )
    parser.add_argument(
        "--like-huggingface",
        action="store_true",
        help="answer as huggingface.co does: small files by a relative 307 to /api/resolve-cache/, 401 for a "
        "missing repo without a token, gated repos (.hub_gated), unknown tokens refused, the anonymous tier's "
        "rate limits unless --rate-limit says otherwise",
    )
    parser.add_argument(
        "--user-token",
        action="append",
        default=[],
        metavar="TOKEN",
        help="with --like-huggingface: the token of an account the Hub knows (repeat for more)",
    )
    parser.add_argument("--cdn-port", type=int, default=0, help="the CDN origin's port (default: any free one)")
    parser.add_argument("--cdn-url-ttl", type=float, default=3600.0, help="seconds a signed CDN URL stays valid")
    parser.add_argument(
        "--rate-limit",
        type=parse_rate_limits,
        metavar="BUCKET=N[,BUCKET=N]",
        help=f"requests per window and client, by bucket ({', '.join(hub_quota.BUCKETS)}); past it a 429 with "
        "RateLimit headers and no Retry-After",
    )
    parser.add_argument(
        "--rate-window", type=float, default=hub_quota.WINDOW_S, help="seconds of one rate-limit window"
    )
    parser.add_argument("--tree-page-size", type=int, default=1000, help="entries per page of /tree (Link: next)")


def parse_rate_limits(text: str) -> dict[str, int]:
    """`resolvers=3000,api=500` -> {bucket: requests per window} (argparse type)."""
    limits = {}
    for item in filter(None, text.split(",")):
        bucket, _, n = item.partition("=")
        if bucket not in hub_quota.BUCKETS or not (n.isascii() and n.isdigit()):
            raise argparse.ArgumentTypeError(
                f"bad rate limit {item!r}: give BUCKET=N with BUCKET in {', '.join(hub_quota.BUCKETS)}"
            )
        limits[bucket] = int(n)
    return limits


_FAULT_FIELDS = {
    "rate": ("rate", float),
    "count": ("count", int),
    "retry_after": ("retry_after_s", float),
    "stall": ("stall_s", float),
    "path": ("path_glob", str),
}


def parse_fault(text: str) -> Fault:
    """`KIND:rate=0.1` / `KIND:count=3,retry_after=2,path=*.safetensors` -> a Fault (argparse type)."""
    kind, _, spec = text.partition(":")
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"unknown fault {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    fault = Fault(kind)
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        if k not in _FAULT_FIELDS:
            raise argparse.ArgumentTypeError(f"unknown fault setting {k!r}; use {', '.join(_FAULT_FIELDS)}")
        name, convert = _FAULT_FIELDS[k]
        try:
            setattr(fault, name, convert(v))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value in fault setting {item!r}") from None
    return fault


def knobs_from_args(args: argparse.Namespace) -> HubKnobs:
    if args.rate_limit is not None:
        rate_limits = args.rate_limit
    else:
        rate_limits = dict(hub_quota.ANONYMOUS_QUOTAS) if args.like_huggingface else {}
    return HubKnobs(
        bandwidth_bytes_per_s=args.bandwidth,
        per_connection_bytes_per_s=args.per_connection_bandwidth,
        ttfb_s=args.ttfb,
        connection_cost_s=args.connection_cost,
        cdn_url_ttl_s=args.cdn_url_ttl,
        required_token=args.require_token,
        faults=list(args.fault),
        rate_limits=rate_limits,
        rate_window_s=args.rate_window,
        tree_page_size=max(1, args.tree_page_size),
    )


def server_options_from_args(args: argparse.Namespace) -> dict:
    """What `HubServer` is made with besides its knobs (fixed while it runs)."""
    return {"like_huggingface": args.like_huggingface, "user_tokens": tuple(args.user_token), "cdn_port": args.cdn_port}


def serve_forever_cli(root: Path, host: str, port: int, knobs: HubKnobs, **options) -> None:
    """Serve until SIGINT or SIGTERM, announcing the address on one line; `options`: HubServer's."""
    if not root.is_dir():
        raise ExpertmeshError(f"{root} is not a folder of repos")
    hub = HubServer(root, host, port, knobs, **options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with hub:
        print(f"expertmesh hub: serving {len(hub.repos)} repos from {root} at {hub.url}", flush=True)
        print(f"expertmesh hub: large files redirected to its CDN at {hub.cdn_url_base}", flush=True)
        stop.wait()
