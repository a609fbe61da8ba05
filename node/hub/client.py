"""Talking to a Hugging Face endpoint: resolve revisions, download small files, read byte ranges.

Everything goes through huggingface_hub: its configured endpoint (`HF_ENDPOINT`), its token
(`HF_TOKEN` or the stored login), its offline switch and its pooled keep-alive HTTP session.
What huggingface_hub does not do for us is the strict range read: a Hub or CDN answer must be
a 206 with exactly the `Content-Range` and length we asked for; anything else is retried or
fails loudly, and a 200 carrying a whole shard is closed before its body is read. Nor does it
give up a connection that is broken: a body arriving below a floor for a window (curl's
--speed-limit/--speed-time) while the node's other connections do better, or while all of them
are below it, is dropped and the rest of its range asked again on another connection (speed.py
says why a connection slow only because the link is full is kept); and a `Deadline` bounds what
one fetch may spend on retries and stalls.
"""

from __future__ import annotations

import contextlib
import email.utils
import logging
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar, overload

import httpx2
from huggingface_hub import HfApi, get_token, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import build_hf_headers

from expertmesh.node import constants
from expertmesh.node.errors import (
    Abandoned,
    AuthError,
    DownloadError,
    EndpointUnreachableError,
    ModelNotFoundError,
    RateLimitedError,
)
from expertmesh.node.fetching import DEMAND, Deadline, FetchContext, fetch_bound_s
from expertmesh.node.hub.rate_limit import GATE, bucket_of, hub_origins, limit_of, observed_session, origin
from expertmesh.node.hub.speed import LinkMeter, LinkTotals, SpeedWindow
from expertmesh.node.model import safetensors_format
from expertmesh.node.model.safetensors_format import TensorEntry

logger = logging.getLogger(__name__)
T = TypeVar("T")

_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
# What a Hub commit id is: a git sha-1. It becomes a folder name, so nothing else is accepted.
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# How often one request is asked again after a rate limit's 429 (each time after its gate reopened):
# more would mean the Hub keeps refusing past the window it announced.
RATE_LIMIT_ROUNDS = 3
# The Hub's X-Error-Message for a token it does not know (huggingface_hub's hf_raise_for_status
# tells this 401 apart by it).
INVALID_TOKEN_MESSAGE = "Invalid credentials in Authorization header"
# A read that may give its link up does so only while at least this much is left: finishing a
# nearly done transfer costs the link less than throwing its bytes away and asking again.
ABANDON_MIN_LEFT_BYTES = 1024 * 1024
# A CDN location without an `expires` query is trusted for this long.
_DEFAULT_REDIRECT_TTL_S = 300.0
# Bytes asked of the socket per read of a response body (httpcore's default is 64 KiB).
SOCKET_READ_BYTES = 1024 * 1024


def _read_bodies_in_larger_pieces() -> None:
    """Let huggingface_hub's HTTP/1.1 connections read up to SOCKET_READ_BYTES per `recv`.

    Every piece read costs h11 an event, a buffer append and two copies in Python; at 64 KiB an
    expert of 17.5 MB takes 270 of them. With 1 MiB reads the client's CPU per GB received fell
    from 1.9 to 1.2 CPU-seconds on a 2-core x86 machine (57 expert-sized ranges from the local Hub,
    httpx2 streaming into one buffer). The setting is a class attribute of httpcore; without it
    (another httpcore) nothing changes but the cost.
    """
    try:
        from httpcore2._sync.http11 import HTTP11Connection
    except ImportError:
        return
    if getattr(HTTP11Connection, "READ_NUM_BYTES", SOCKET_READ_BYTES) < SOCKET_READ_BYTES:
        HTTP11Connection.READ_NUM_BYTES = SOCKET_READ_BYTES


_read_bodies_in_larger_pieces()


class _Retryable(Exception):
    """A failure worth another attempt; `wait_s` is the server's Retry-After, if any; `final` is
    what to raise if no attempt is left (default: a DownloadError that says how often it failed);
    `cut_short`: the fetch's deadline stopped it, so the attempt before says more about the cause;
    `rate_limited`: a 429 that closed its bucket's gate (rate_limit.py), which the next attempt
    waits on: not a failure of the attempt, so not counted as one."""

    def __init__(
        self,
        reason: str,
        wait_s: float | None = None,
        final: Exception | None = None,
        cut_short: bool = False,
        rate_limited: bool = False,
    ):
        super().__init__(reason)
        self.reason = reason
        self.wait_s = wait_s
        self.final = final
        self.cut_short = cut_short
        self.rate_limited = rate_limited


@dataclass(frozen=True)
class RemoteFile:
    """One file of a pinned revision."""

    repo_id: str
    commit: str
    filename: str

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.commit[:8]}/{self.filename}"


def endpoint() -> str:
    """The endpoint huggingface_hub is configured with (read at call time, not import time)."""
    return hf_constants.ENDPOINT.rstrip("/")


def _check_online() -> None:
    if hf_constants.HF_HUB_OFFLINE:
        raise EndpointUnreachableError("HF_HUB_OFFLINE is set: expertmesh cannot reach the Hub")


def _token_source() -> str:
    """Where huggingface_hub takes the token from, for a message (never the token itself)."""
    return "HF_TOKEN" if os.environ.get("HF_TOKEN") else "the stored login (`hf auth login`)"


def access_error(status: int | None, headers, repo_id: str, where: str) -> Exception | None:
    """One line a person can act on for a refusal the Hub explains by its `X-Error-Code` and
    `X-Error-Message` (as huggingface_hub's `hf_raise_for_status` tells them apart, utils/_http.py):
    a token the Hub does not know, a gated repo (logged out, or its licence not accepted), a repo
    that is missing or private (the Hub does not say which), or a token without read access.
    None: not a refusal of access."""
    if status not in (401, 403, 404):
        return None
    code, message = headers.get("x-error-code"), headers.get("x-error-message")
    page = f"{where}/{repo_id}"
    if status == 401 and message == INVALID_TOKEN_MESSAGE:
        return AuthError(
            f"{where} does not accept the token from {_token_source()} (invalid or expired): set HF_TOKEN to "
            "a token from https://huggingface.co/settings/tokens, or run `hf auth login` again"
        )
    if code == "GatedRepo":
        if status == 401 or get_token() is None:
            return AuthError(
                f"{repo_id} is gated: log in (`hf auth login`, or set HF_TOKEN) and accept its licence at {page}"
            )
        return AuthError(
            f"{repo_id} is gated and the account of the token from {_token_source()} has no access yet: "
            f"accept its licence at {page}, then run again"
        )
    if code == "RepoNotFound" or (status == 401 and get_token() is None):
        if get_token() is None:
            return ModelNotFoundError(
                f"{repo_id} was not found at {where}: check the name; if it is private, log in "
                "(`hf auth login`, or set HF_TOKEN) with an account that can see it"
            )
        return ModelNotFoundError(
            f"{repo_id} was not found at {where}, or the account of the token from {_token_source()} cannot "
            "see it: check the name, and the token's access at https://huggingface.co/settings/tokens"
        )
    if status in (401, 403):
        why = f": {_shown(message, 80)}" if message else ""
        return AuthError(
            f"{where} refused {repo_id} to the token from {_token_source()} (HTTP {status}{why}): give the token "
            "read access at https://huggingface.co/settings/tokens, or log in again (`hf auth login`)"
        )
    return None


def _response_of(e: BaseException) -> httpx2.Response | None:
    """The HTTP answer behind an error of huggingface_hub (hf_hub_download wraps a failed HEAD
    in another error, whose cause holds it)."""
    error: BaseException | None = e
    seen = 0
    while error is not None and seen < 5:
        response = getattr(error, "response", None)
        if isinstance(response, httpx2.Response):
            return response
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def translate_hub_error(e: Exception, repo_id: str, revision: str | None = None) -> Exception:
    """Turn huggingface_hub and transport errors into one-line user errors (never with tokens)."""
    where = endpoint()
    if isinstance(e, hf_errors.RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id}: revision {revision!r} not found at {where}")
    if isinstance(e, (hf_errors.EntryNotFoundError, hf_errors.RemoteEntryNotFoundError)):
        return ModelNotFoundError(f"{repo_id}: file not found in revision {revision!r} at {where}")
    if isinstance(e, hf_errors.OfflineModeIsEnabled):
        return EndpointUnreachableError("HF_HUB_OFFLINE is set: expertmesh cannot reach the Hub")
    response = _response_of(e)
    if response is not None:
        refused = access_error(response.status_code, response.headers, repo_id, where)
        if refused is not None:
            return refused
        if response.status_code == 429:
            return RateLimitedError(f"{where} kept answering HTTP 429 (too many requests) for {repo_id}")
        return DownloadError(f"{where} answered HTTP {response.status_code} for {repo_id}")
    if isinstance(e, (httpx2.TransportError, OSError)):
        return EndpointUnreachableError(f"cannot reach {where}: {type(e).__name__}")
    return e


def retrying(
    attempt: Callable[[], T],
    what: str,
    max_retries: int = constants.HTTP_MAX_RETRIES,
    backoff_base_s: float = 0.25,
    backoff_max_s: float = 8.0,
    on_retry: Callable[[], None] | None = None,
    cancelled: threading.Event | None = None,
    deadline: Deadline | None = None,
) -> T:
    """`attempt()`, called again after each `_Retryable` it raises: after the server's Retry-After,
    else an exponential backoff with full jitter (so many clients do not retry in lockstep).
    With a `deadline`, no attempt starts once it passed, and no wait runs past it. A rate-limited
    attempt (`_Retryable.rate_limited`) is asked again at once, up to `RATE_LIMIT_ROUNDS` times, and
    not counted as a failure: the next attempt waits on the rate limit's gate itself.

    Raises:
        the `_Retryable`'s `final` error (or a DownloadError) once `max_retries` retries failed,
        at once when `cancelled` is set, or a DownloadError once the `deadline` passed.
    """
    _check_online()
    previous = ""  # the reason of the attempt before, for when the deadline cuts the last one short
    n = rate_limited = 0
    while True:
        if deadline is not None:
            if deadline.passed():  # a piece that waited its turn past its fetch's deadline
                raise DownloadError(f"{what}: not asked, the {deadline.seconds:g} s to fetch it had passed")
            deadline.start()
        try:
            return attempt()
        except _Retryable as e:
            if cancelled is not None and cancelled.is_set():
                raise (e.final or DownloadError(f"{what}: cancelled")) from None
            if e.rate_limited and rate_limited < RATE_LIMIT_ROUNDS:
                rate_limited += 1
                continue
            if n == max_retries:
                raise (e.final or DownloadError(f"{what} failed {n + 1} times, last: {e.reason}")) from None
            wait = e.wait_s if e.wait_s is not None else random.uniform(0, min(backoff_max_s, backoff_base_s * 2**n))
            if deadline is not None and wait >= deadline.left():
                last = f"{previous}; then {e.reason}" if e.cut_short and previous else e.reason
                raise DownloadError(
                    f"{what}: no complete answer within {deadline.seconds:g} s ({n + 1} attempts), last: {last}"
                ) from None
            previous = e.reason
            n += 1
            if on_retry is not None:
                on_retry()
            logger.info("retrying %s in %.2fs: %s", what, wait, e.reason)
            if cancelled is not None and cancelled.wait(wait):
                raise DownloadError(f"{what}: cancelled") from None
            if cancelled is None:
                time.sleep(wait)


def _api_call(fn: Callable[[], T], repo_id: str, revision: str | None, bucket: str = "api") -> T:
    """Call huggingface_hub, retrying rate limits, 5xx and dropped connections (`retrying`); each
    attempt first waits on the rate limit of `bucket` (the one its requests count in)."""

    def attempt() -> T:
        observed_session()
        GATE.wait(bucket)
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - translated, or retried when transient
            response = _response_of(e)
            status = response.status_code if response is not None else None
            final = translate_hub_error(e, repo_id, revision)
            if response is not None and limit_of(response, bucket) is not None:
                raise _Retryable(
                    f"HTTP 429 (the Hub's {bucket!r} rate limit)", final=final, rate_limited=True
                ) from None
            if status in _RETRY_STATUS or isinstance(e, httpx2.TransportError):
                wait = _retry_after(response.headers.get("retry-after")) if response is not None else None
                raise _Retryable(f"HTTP {status}" if status else type(e).__name__, wait, final) from None
            raise final from None

    return retrying(attempt, f"{repo_id}@{revision or 'main'}")


def resolve_commit(repo_id: str, revision: str | None = None) -> str:
    """Pin `revision` (branch, tag or sha; default `main`) to its commit sha.

    Raises:
        ModelNotFoundError, AuthError, EndpointUnreachableError: as the endpoint answers.
    """
    info = _api_call(lambda: HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision), repo_id, revision)
    if not info.sha:
        raise DownloadError(f"{endpoint()} did not report a commit sha for {repo_id}@{revision or 'main'}")
    # The sha names the model's folder (local_models.model_dir): anything but a git commit id
    # (an absolute path, `..`) is a broken or hostile answer, never a path to write to.
    if not isinstance(info.sha, str) or not COMMIT_RE.fullmatch(info.sha):
        raise DownloadError(
            f"{endpoint()} reported {_shown(info.sha)} as the commit of {repo_id}@{revision or 'main'}, "
            "which is not a 40-hex-digit commit sha"
        )
    return info.sha


def _shown(value: object, limit: int = 60) -> str:
    """A value from the network, quoted and cut short, for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def list_files(repo_id: str, commit: str) -> list[str]:
    """Every file name of a pinned revision, from its whole tree: huggingface_hub's
    `list_repo_files` lists it recursively and follows the Hub's pages (`Link: <...>; rel="next"`,
    at most 1000 entries a page: hf_api.py, `_iter_repo_tree_pages`). `model_info`'s `siblings`
    are not used: the Hub may cut them short for a large repo."""
    return _api_call(lambda: HfApi(endpoint=endpoint()).list_repo_files(repo_id, revision=commit), repo_id, commit)


def download_file(remote: RemoteFile, local_dir: Path) -> Path:
    """Download one (small) file of the pinned revision into `local_dir`."""
    path = _api_call(
        lambda: hf_hub_download(
            remote.repo_id, remote.filename, revision=remote.commit, local_dir=local_dir, endpoint=endpoint()
        ),
        remote.repo_id,
        remote.commit,
        bucket="resolvers",
    )
    return Path(path)


def download_repo(repo_id: str, revision: str | None = None, cache_dir: Path | None = None) -> Path:
    """A whole (small) repository, such as a draft model, pinned to the commit `revision` names
    and downloaded in huggingface_hub's cache layout under `cache_dir` (its own cache if None),
    through the same rate gate, retries and error messages as every other Hub call.

    Offline (HF_HUB_OFFLINE, or an endpoint that cannot be reached) a copy already in the cache is
    used, so a draft pulled once keeps working without the Hub.

    Raises:
        ModelNotFoundError, AuthError, EndpointUnreachableError, DownloadError: as the endpoint answers.
    """
    try:
        commit = resolve_commit(repo_id, revision)
    except EndpointUnreachableError:
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
        except (hf_errors.LocalEntryNotFoundError, ValueError, OSError):
            raise EndpointUnreachableError(
                f"cannot reach {endpoint()} for {repo_id}, and no copy of it was downloaded before"
            ) from None
    path = Path(
        _api_call(
            lambda: snapshot_download(repo_id, revision=commit, cache_dir=cache_dir, endpoint=endpoint()),
            repo_id,
            commit,
            bucket="resolvers",
        )
    )
    # Downloaded by its commit, the cache has no ref for the revision's name; huggingface_hub's
    # documented cache layout keeps one per name (refs/NAME holds the commit): written here, an
    # offline start finds the draft by the name it was asked by.
    ref = path.parent.parent / "refs" / (revision or "main")
    if ref.resolve().is_relative_to(path.parent.parent.resolve()):  # a revision name such as `..` writes nothing
        with contextlib.suppress(OSError):
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
    return path


class RangeReader:
    """Strict, retried byte-range reads of pinned files over huggingface_hub's session.

    The Hub answers a resolve URL of a large file with a redirect to a signed URL on a CDN's
    origin; we remember each file's location until it expires or the CDN refuses it, so a shard
    costs one redirect, not one per range, and the CDN never receives the token. Concurrent first
    reads of a shard wait for the first one's redirect instead of each asking (a cold layer starts
    a dozen at once, and each redirect is a round trip and a request against the Hub's rate
    limit). A redirect that stays on the Hub (a small file's relative 307 to its resolve cache)
    is followed with the token and not remembered, as huggingface_hub does. Every request the
    Hub counts first waits while its bucket's rate limit is used up (rate_limit.py).
    """

    def __init__(
        self,
        max_retries: int = constants.HTTP_MAX_RETRIES,
        timeout_s: float = constants.HTTP_TIMEOUT_S,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 8.0,
        min_bytes_per_s: float = constants.HUB_MIN_BYTES_PER_S,
        speed_window_s: float = constants.HUB_SPEED_WINDOW_S,
        fetch_deadline_s: float = constants.HUB_FETCH_DEADLINE_S,
    ):
        """`min_bytes_per_s` over `speed_window_s`: the floor below which a response is given up
        (0: never); `fetch_deadline_s`: the budget of a `Deadline` for callers that fetch in parts
        (the Hub tier), not applied to a read without one."""
        # Pinned now: a reader belongs to one Hub, even if huggingface_hub is pointed elsewhere later.
        self.endpoint = endpoint()
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.min_bytes_per_s = min_bytes_per_s
        self.speed_window_s = speed_window_s
        self.fetch_deadline_s = fetch_deadline_s
        self._hub_origins = hub_origins(self.endpoint)
        self._locations: dict[RemoteFile, tuple[str, float]] = {}
        self._resolving: dict[RemoteFile, threading.Event] = {}  # set once the first reader's redirect is known
        self._lock = threading.Lock()
        self.retries = 0  # how many attempts failed and were retried, for the summary
        self.slow_responses = (
            0  # responses given up for arriving below the floor (each also a retry or the last failure)
        )
        self._link = LinkMeter()  # what all of this reader's responses receive: what a slow one is judged by
        self._cancelled = threading.Event()

    @property
    def read_timeout_s(self) -> float:
        """The longest one socket read may wait: silence for a whole speed window is below any floor."""
        return min(self.timeout_s, self.speed_window_s) if self.min_bytes_per_s > 0 else self.timeout_s

    def deadline(self) -> Deadline:
        """A new budget for one fetch: `fetch_deadline_s`, plus the time its bytes take at the speed
        floor as they arrive, so a full link's slowness never ends a fetch that goes on receiving;
        it ends, at the latest, `fetch_bound_s(nbytes)` after its first request."""
        return Deadline(self.fetch_deadline_s, self.min_bytes_per_s)

    def fetch_bound_s(self, nbytes: int = 0) -> float:
        """The documented bound on a fetch of `nbytes` with a `deadline()` (node/fetching.py)."""
        return fetch_bound_s(nbytes, self.fetch_deadline_s, self.min_bytes_per_s, self.read_timeout_s)

    def received_bytes(self) -> int:
        """Bytes this reader's responses have received since it was made."""
        return self._link.totals().nbytes

    def cancel(self) -> None:
        """Stop: reads in flight end at their next chunk, and nothing is retried (Ctrl-C, close)."""
        self._cancelled.set()

    def read(self, remote: RemoteFile, start: int, end: int) -> bytearray:
        """Bytes `[start, end)` of `remote`, exactly; clipped at the end of the file.

        Raises:
            DownloadError: still failing after the retries, or a permanent refusal.
            AuthError: the endpoint rejects our token.
        """
        return self.read_with_size(remote, start, end)[0]

    def read_into(
        self,
        remote: RemoteFile,
        start: int,
        end: int,
        out: memoryview,
        ctx: FetchContext = DEMAND,
    ) -> int:
        """`read`, straight into `out` (at least `end - start` bytes): the bytes land once, where
        they are used. Returns how many were written (fewer only at the end of the file).

        `ctx.abandon()` is asked before the request and between chunks: when it says so, the read
        stops and raises Abandoned (not retried). `ctx.deadline`: the budget of the fetch this
        read is part of; once it passed, no attempt starts and the one in progress stops.
        """
        if len(out) < end - start:
            raise ValueError(f"a buffer of {len(out)} bytes for a range of {end - start}")
        return len(self.read_with_size(remote, start, end, out, ctx)[0])

    @overload
    def read_with_size(
        self, remote: RemoteFile, start: int, end: int, out: None = None, ctx: FetchContext = DEMAND
    ) -> tuple[bytearray, int | None]: ...

    @overload
    def read_with_size(
        self, remote: RemoteFile, start: int, end: int, out: memoryview, ctx: FetchContext = DEMAND
    ) -> tuple[bytearray | memoryview, int | None]: ...

    def read_with_size(
        self,
        remote: RemoteFile,
        start: int,
        end: int,
        out: memoryview | None = None,
        ctx: FetchContext = DEMAND,
    ) -> tuple[bytearray | memoryview, int | None]:
        """`read` (into `out` if given), plus the file's total size from the `Content-Range`
        (None if the server hides it). Without `out` the bytes come in a bytearray of their own."""
        if end <= start:
            raise ValueError(f"empty range {start}-{end}")
        # a range under ABANDON_MIN_LEFT_BYTES is fetched whatever `abandon` says, as a nearly done
        # one is finished: giving it up saves the link less than asking for it again costs
        if end - start >= ABANDON_MIN_LEFT_BYTES and ctx.should_abandon():
            raise Abandoned(f"{remote}: bytes {start}-{end - 1} given up before asking")
        got = _Received(bytearray() if out is None else out)
        size = retrying(
            lambda: self._read_once(remote, start, end, got, ctx),
            f"{remote}: bytes {start}-{end - 1}",
            self.max_retries,
            self.backoff_base_s,
            self.backoff_max_s,
            on_retry=self._count_retry,
            cancelled=self._cancelled,
            deadline=ctx.deadline,
        )
        return (got.into if isinstance(got.into, bytearray) else got.into[: got.n]), size

    def _count_retry(self) -> None:
        self.retries += 1

    def _give_up_slow(self, reason: str) -> NoReturn:
        """Give a response up that `SpeedWindow` judged too slow: raising inside the stream closes
        its connection (the body is unread, so it cannot go back to the pool), and the next attempt
        asks for the rest on another one, at once: the slowness belongs to that connection's path,
        not to a server asking us to back off."""
        self.slow_responses += 1
        raise _Retryable(reason, wait_s=0)

    def _location(self, remote: RemoteFile, ctx: FetchContext) -> tuple[str, bool]:
        """The URL to ask, and whether it is a remembered CDN location."""
        for _ in range(2):
            with self._lock:
                cached = self._locations.get(remote)
                if cached and cached[1] > time.time():
                    return cached[0], True
                first = self._resolving.get(remote)
                if first is None:  # this read resolves it; `_resolved` lets the others go
                    self._resolving[remote] = threading.Event()
                    break
            first.wait(ctx.time_left(self.timeout_s))  # then the remembered location, or ask ourselves
        return hf_hub_url(remote.repo_id, remote.filename, revision=remote.commit, endpoint=self.endpoint), False

    def _resolved(self, remote: RemoteFile) -> None:
        with self._lock:
            first = self._resolving.pop(remote, None)
        if first is not None:
            first.set()

    def _remember_redirect(self, remote: RemoteFile, url: str) -> str:
        """Remember `url`, a signed CDN location of `remote`, until a little before it expires."""
        query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
        try:
            expires = float(query.get("expires", query.get("Expires", [""]))[0]) - 30
        except ValueError:
            expires = time.time() + _DEFAULT_REDIRECT_TTL_S
        with self._lock:
            self._locations[remote] = (url, expires)
        self._resolved(remote)
        return url

    def _forget_redirect(self, remote: RemoteFile) -> None:
        with self._lock:
            self._locations.pop(remote, None)

    def _read_once(self, remote: RemoteFile, start: int, end: int, got: _Received, ctx: FetchContext) -> int | None:
        """One attempt at what is still missing of `[start, end)` (bytes from `start + got.n`),
        into `got`; returns the file's size, if the server says it."""
        url, is_cdn = self._location(remote, ctx)
        first = start + got.n
        headers = build_hf_headers(headers={"Range": f"bytes={first}-{end - 1}", "Accept-Encoding": "identity"})
        if is_cdn:  # signed CDN URLs must not receive the Hub token
            headers.pop("authorization", None)
            headers.pop("Authorization", None)
        try:
            with self._session() as session:
                return self._read_redirected(session, remote, url, headers, is_cdn, first, end, got, ctx)
        finally:
            if not is_cdn:
                self._resolved(remote)  # no redirect came (a small file, an error): the others ask themselves

    @contextlib.contextmanager
    def _session(self) -> Iterator[httpx2.Client]:
        """The HTTP client for one read: huggingface_hub's pooled keep-alive session (observed for
        rate limits, rate_limit.py)."""
        yield observed_session()

    def _read_redirected(
        self,
        session,
        remote: RemoteFile,
        url: str,
        headers: dict,
        is_cdn: bool,
        start: int,
        end: int,
        got: _Received,
        ctx: FetchContext,
    ) -> int | None:
        for _ in range(5):  # redirects
            # a request the Hub counts waits while its bucket's rate limit is used up (rate_limit.py)
            GATE.wait(bucket_of(url, self.endpoint), ctx.deadline, self._cancelled)
            # connecting and sending within the per-request timeout; each read within the speed
            # window too (silence that long is below any floor); none past the fetch's deadline
            timeout = httpx2.Timeout(ctx.time_left(self.timeout_s), read=ctx.time_left(self.read_timeout_s))
            try:
                with (
                    self._link.reading() as asked,
                    session.stream("GET", url, headers=headers, follow_redirects=False, timeout=timeout) as r,
                ):
                    if r.status_code in (301, 302, 303, 307, 308) and "location" in r.headers:
                        url = urllib.parse.urljoin(url, r.headers["location"])
                        if self._is_hub(url):
                            # the Hub itself (a small file's relative 307 to its resolve cache): the
                            # token goes along, as huggingface_hub sends it, and nothing is remembered
                            continue
                        url = self._remember_redirect(remote, url)
                        is_cdn = True  # a signed CDN URL: the signature is its credential, never the token
                        headers.pop("authorization", None)
                        headers.pop("Authorization", None)
                        continue
                    return self._check_body(r, remote, start, end, is_cdn, got, asked, ctx)
            except httpx2.TransportError as e:
                raise _Retryable(
                    f"{type(e).__name__}", cut_short=ctx.deadline is not None and ctx.deadline.passed()
                ) from None
        raise _Retryable("too many redirects")

    def _is_hub(self, url: str) -> bool:
        """Whether `url` is the Hub itself: the origin (scheme, host, port) of the endpoint, or one
        of the Hub's public hosts, as huggingface_hub's `_is_same_or_hub_host` decides where the
        token may go (utils/_http.py)."""
        return origin(url) in self._hub_origins

    def _check_body(
        self,
        r: httpx2.Response,
        remote: RemoteFile,
        start: int,
        end: int,
        is_cdn: bool,
        got: _Received,
        asked: LinkTotals,
        ctx: FetchContext,
    ) -> int | None:
        """The body of a strict 206 for `[start, end)` into `got`, and the file's size; raises
        `_Retryable` for anything else worth another try: a wrong or short answer, or one that
        arrives too slowly.

        A 200 to a range from byte 0 is the whole file, which a CDN may send for a small one: it
        is taken when the file is no longer than the range (then it is exactly the bytes asked),
        and refused unread when its `Content-Length` says more."""
        if r.status_code == 200 and start == 0:
            length = r.headers.get("content-length")
            if length is None or (length.isascii() and length.isdigit() and int(length) <= end):
                want = end if length is None else int(length)
                self._stream_body(r, remote, start, end, want, got, asked, ctx, whole=length is None)
                return got.n
        if r.status_code != 206:
            self._refuse(r, remote, start, end, is_cdn)
        want, size = _checked_range(r, start, end)
        self._stream_body(r, remote, start, end, want, got, asked, ctx)
        return size

    def _refuse(self, r: httpx2.Response, remote: RemoteFile, start: int, end: int, is_cdn: bool) -> NoReturn:
        """What an answer other than a 206 means: another try (`_Retryable`), or an error to raise."""
        status = r.status_code
        if status == 200:
            # The server ignored Range: never read (let alone store) a whole shard.
            raise _Retryable("the server ignored the Range header (200 instead of 206)")
        if status in (401, 403) and is_cdn:
            self._forget_redirect(remote)  # an expired or refused signed URL: resolve again
            raise _Retryable(f"CDN refused the signed URL (HTTP {status})", wait_s=0)
        if status == 429 and limit_of(r, bucket_of(str(r.request.url), self.endpoint)) is not None:
            raise _Retryable("HTTP 429 (a rate limit)", rate_limited=True)
        refused = access_error(status, r.headers, remote.repo_id, self.endpoint)
        if refused is not None:
            raise refused
        if status == 404:
            if is_cdn:
                self._forget_redirect(remote)
                raise _Retryable("CDN answered 404", wait_s=0)
            raise DownloadError(f"{remote}: not found at {self.endpoint}")
        if status == 416:
            raise DownloadError(f"{remote}: bytes {start}-{end - 1} are past the end of the file")
        if status in _RETRY_STATUS:
            raise _Retryable(f"HTTP {status}", wait_s=_retry_after(r.headers.get("retry-after")))
        raise DownloadError(f"{remote}: unexpected HTTP {status}")

    def _stream_body(
        self,
        r: httpx2.Response,
        remote: RemoteFile,
        start: int,
        end: int,
        want: int,
        got: _Received,
        asked: LinkTotals,
        ctx: FetchContext,
        whole: bool = False,
    ) -> None:
        """Exactly `want` bytes of `r`'s body into `got`, after what it holds; `whole`: the body
        is a whole file of unknown length, at most `want` bytes.

        Between chunks: a cancelled reader stops, a read that may give its link up does so
        (`Abandoned`), the fetch's deadline ends the attempt, and a window too slow for the link
        gives the connection up (speed.py). What came before an attempt ends stays in `got`, so
        the next asks for the rest only: a connection given up costs its link nothing twice."""
        n, before = 0, got.n
        speed = SpeedWindow(asked, self.speed_window_s, self.min_bytes_per_s, self._link, self._give_up_slow)
        for chunk in r.iter_bytes():
            if self._cancelled.is_set():
                raise DownloadError(f"{remote}: cancelled")
            if want - n >= ABANDON_MIN_LEFT_BYTES and ctx.should_abandon():
                raise Abandoned(f"{remote}: gave bytes {start}-{end - 1} up to a demand")
            if n + len(chunk) > want:
                got.n = before  # an answer that breaks its own promise: none of its bytes is kept
                raise _Retryable(
                    "the server ignored the Range header (200, longer than the range)"
                    if whole
                    else "more bytes than the range"
                )
            got.append(chunk)
            n += len(chunk)
            self._link.received(len(chunk))
            if ctx.deadline is not None:
                ctx.deadline.received(len(chunk))
            if n == want:
                continue  # complete: the stream ends next, and its connection goes back to the pool
            if ctx.deadline is not None and ctx.deadline.passed():
                raise _Retryable(f"{n} of {want} bytes had come when the time was up", cut_short=True)
            speed.count(n)
        if n != want and not whole:
            raise _Retryable(f"connection ended after {n} of {want} bytes")


class _Received:
    """The bytes of one range read so far, kept across its attempts: into `out` when the caller
    gave a buffer, else into a bytearray that grows as they come (a `Content-Range` is only a
    claim, and a server that claims gigabytes and sends 18 bytes must cost 18 bytes)."""

    def __init__(self, into: bytearray | memoryview):
        self.into = into
        self.n = 0

    def append(self, chunk: bytes) -> None:
        if isinstance(self.into, bytearray):
            del self.into[self.n :]  # what an answer that was not kept left behind
            self.into += chunk
        else:
            self.into[self.n : self.n + len(chunk)] = chunk
        self.n += len(chunk)


def _checked_range(r: httpx2.Response, start: int, end: int) -> tuple[int, int | None]:
    """`(bytes the body must hold, the file's size or None)` of a 206 for `[start, end)`: its
    `Content-Range` must be exactly the range asked (clipped at the end of the file), and its
    `Content-Length`, if any, agree."""
    m = _CONTENT_RANGE_RE.match(r.headers.get("content-range", ""))
    if not m:
        raise _Retryable("206 without a valid Content-Range")
    got_start, got_end, total = int(m.group(1)), int(m.group(2)) + 1, m.group(3)
    expected_end = end if total == "*" else min(end, int(total))
    if got_start != start or got_end != expected_end:
        raise _Retryable(f"asked for bytes {start}-{end - 1}, got {got_start}-{got_end - 1}")
    length = r.headers.get("content-length")
    if length is not None and int(length) != got_end - got_start:
        raise _Retryable("Content-Length disagrees with Content-Range")
    return got_end - got_start, None if total == "*" else int(total)


def _retry_after(value: str | None, cap_s: float = 120.0) -> float | None:
    """Seconds to wait from a `Retry-After` header (delay-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), cap_s)
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, min(when - time.time(), cap_s))


def read_safetensors_header(reader: RangeReader, remote: RemoteFile) -> tuple[dict[str, TensorEntry], int]:
    """A remote shard's tensors (absolute offsets) and size.

    Two exact range reads: the 8-byte length, then the header. huggingface_hub's
    `parse_safetensors_file_metadata` reads a 100 kB probe instead, which saves a round trip
    but also downloads the first tensors' bytes — experts, in an expert-bearing shard.
    """
    prefix, size = reader.read_with_size(remote, 0, 8)
    if size is None:
        raise DownloadError(f"{remote}: the server did not report the file size")
    try:
        n = safetensors_format.header_length(prefix)
        if 8 + n > size:
            raise safetensors_format.SafetensorsFormatError("header longer than the file")
        tensors, _ = safetensors_format.parse_header(reader.read(remote, 8, 8 + n), size)
    except safetensors_format.SafetensorsFormatError as e:
        raise DownloadError(f"{remote} is not a valid safetensors file: {e}") from None
    return tensors, size


@contextlib.contextmanager
def using_endpoint(url: str) -> Iterator[None]:
    """Point huggingface_hub at `url` for the duration (it reads `HF_ENDPOINT` at import only)."""
    previous = hf_constants.ENDPOINT, hf_constants.HUGGINGFACE_CO_URL_TEMPLATE
    hf_constants.ENDPOINT = url.rstrip("/")
    hf_constants.HUGGINGFACE_CO_URL_TEMPLATE = hf_constants.ENDPOINT + "/{repo_id}/resolve/{revision}/{filename}"
    try:
        yield
    finally:
        hf_constants.ENDPOINT, hf_constants.HUGGINGFACE_CO_URL_TEMPLATE = previous
