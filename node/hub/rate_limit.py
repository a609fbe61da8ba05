"""The Hub's rate limits: what it announces, one gate per process that every request waits on, and
this process's own count of its requests per window.

What the Hub does (https://huggingface.co/docs/hub/rate-limits): it counts requests in fixed
5-minute windows per bucket — `api` (the Hub API), `resolvers` (every URL with a `/resolve/`
segment: file downloads, so every expert fetched from the Hub) and `pages` — anonymous requests
per IP, others per account, with larger quotas for accounts and more for PRO ones. Each answer
says where the client stands, `RateLimit: "resolvers";r=<left>;t=<seconds to reset>` with
`RateLimit-Policy: "fixed window";"resolvers";q=<quota>;w=<window>`, and past the quota it answers
429 with `r=0` and no `Retry-After`. huggingface_hub reads these with `parse_ratelimit_headers`
(used here) and waits `t` + 1 s before asking again (utils/_http.py, `_http_backoff_base`).

What expertmesh adds: one gate per bucket and per process. A 429 that says `r=0` (or carries a
`Retry-After`) closes its bucket until the window reopens, and every request of the process for
that bucket — all the pieces and experts in flight — waits on that one gate, once, instead of
each backing off alone and spending the next window's quota in retries. A wait longer than a
fetch may take is one `RateLimitedError` naming the bucket, the wait and the fix.

Every answer passing through huggingface_hub's session is seen by one response hook
(`observed_session`): it counts this process's requests per bucket and window (shown by `status`
and `doctor`), remembers the quota the Hub announced, and closes the gate on a 429.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import httpx2
from huggingface_hub import constants as hf_constants
from huggingface_hub import get_token
from huggingface_hub.utils import get_session, parse_ratelimit_headers

from expertmesh.node.errors import DownloadError, RateLimitedError
from expertmesh.node.fetching import Deadline

DOCS_URL = "https://huggingface.co/docs/hub/rate-limits"
WINDOW_S = 300.0  # the Hub's fixed window, until it announces one (RateLimit-Policy's `w`)
# Added to the wait a 429 announces, as huggingface_hub adds it, "to avoid rounding issues" (`t`
# is in whole seconds).
MARGIN_S = 1.0
# Buckets always shown (as 0 until used): the two expertmesh's requests count in.
BUCKETS = ("resolvers", "api")
# `doctor` warns when less than this share of a bucket's quota is left in the window.
QUOTA_WARN_SHARE = 0.1


def origin(url: str | httpx2.URL) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port made explicit: what "the same origin" compares."""
    parsed = urllib.parse.urlsplit(str(url))
    default = {"http": 80, "https": 443}.get(parsed.scheme, 0)
    return parsed.scheme, (parsed.hostname or "").lower(), parsed.port or default


def hub_origins(endpoint: str) -> set[tuple[str, str, int]]:
    """The origins that are the Hub itself for a client of `endpoint`: the endpoint's, and the Hub's
    public hosts (huggingface_hub's `_HUB_ORIGINS`, utils/_http.py, forwards the token to these)."""
    return {origin(endpoint), origin("https://huggingface.co"), origin("https://hf.co")}


def bucket_of(url: str | httpx2.URL, endpoint: str) -> str:
    """The bucket a request to `url` counts in: `resolvers` for a file of the Hub (`/resolve/`, and
    the `/api/resolve-cache/` route small files are redirected to), `api` for the rest of the Hub,
    `cdn` for any other origin (a signed CDN URL, which the Hub does not count)."""
    if origin(url) not in hub_origins(endpoint):
        return "cdn"
    path = urllib.parse.urlsplit(str(url)).path
    if "/resolve/" in path or path.startswith("/api/resolve-cache/"):
        return "resolvers"
    return "api"


@dataclass(frozen=True)
class Limit:
    """What one 429 said: the bucket, how long until it reopens, and its quota if announced."""

    bucket: str
    wait_s: float
    quota: int | None = None
    window_s: int | None = None


def limit_of(response: httpx2.Response, bucket: str) -> Limit | None:
    """The limit a 429 announces (None: not a 429, or one that says nothing of when to ask again).

    `RateLimit` with `r=0` first, as huggingface_hub reads it; the Hub sets it on every answer,
    so only a 429 with no requests left is taken for the reason. Else `Retry-After` in seconds.
    """
    if response.status_code != 429:
        return None
    info = parse_ratelimit_headers(response.headers)
    if info is not None and info.remaining == 0:
        return Limit(info.resource_type, float(info.reset_in_seconds), info.limit, info.window_seconds)
    after = response.headers.get("retry-after", "").strip()
    if after.isascii() and after.isdigit():
        return Limit(bucket, float(after))
    return None


@dataclass
class Usage:
    """One bucket's current window, as this process counted it and the Hub last announced it."""

    requests: int  # this process's requests in the window
    quota: int | None  # the window's quota (RateLimit-Policy's `q`), if the Hub said
    left: int | None  # requests left, as the Hub last said (all its clients on this IP or account)
    resets_in_s: float  # until the window ends (the Hub's `t`, if it said; else our own guess)
    window_s: float


class RateGate:
    """The gates of one process, one per bucket, and its request counts per window."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, margin_s: float = MARGIN_S):
        self.clock = clock
        self.margin_s = margin_s
        self._lock = threading.Lock()
        self._reopens: dict[str, float] = {}  # bucket -> when its gate opens again
        self._windows: dict[str, _Window] = {}
        self.limited: Counter[str] = Counter()  # 429s for a used-up quota, by bucket
        self.waited_s: defaultdict[str, float] = defaultdict(float)  # seconds each bucket's gate was closed

    def reset(self) -> None:
        """Open every gate and forget every count (a test's fresh start)."""
        with self._lock:
            self._reopens.clear()
            self._windows.clear()
            self.limited.clear()
            self.waited_s.clear()

    def close(self, limit: Limit) -> None:
        """Close `limit.bucket`'s gate until its window reopens (and the margin); a later 429 only
        ever moves the reopening later."""
        now = self.clock()
        reopen = now + limit.wait_s + self.margin_s
        with self._lock:
            self.limited[limit.bucket] += 1
            before = max(now, self._reopens.get(limit.bucket, now))
            if reopen > before:
                self.waited_s[limit.bucket] += reopen - before
                self._reopens[limit.bucket] = reopen
            window = self._window(limit.bucket, now)
            window.left = 0
            window.ends = max(window.ends, now + limit.wait_s)
            if limit.quota is not None:
                window.quota = limit.quota
            if limit.window_s:
                window.window_s = float(limit.window_s)

    def closed_for(self, bucket: str) -> float:
        """Seconds until `bucket`'s gate opens (0: open)."""
        with self._lock:
            reopen = self._reopens.get(bucket)
        return 0.0 if reopen is None else max(0.0, reopen - self.clock())

    def wait(
        self,
        bucket: str,
        deadline: Deadline | None = None,
        cancelled: threading.Event | None = None,
        max_wait_s: float | None = None,
    ) -> None:
        """Return once `bucket`'s gate is open: at once, or after waiting for the window to reopen.

        The wait may take what is left of `deadline`, else `max_wait_s` (default: a whole window
        and the margin, the longest a quota can be used up for).

        Raises:
            RateLimitedError: the gate opens only after that: naming the bucket, the wait and the fix.
            DownloadError: `cancelled` was set while waiting.
        """
        wait = self.closed_for(bucket)
        if wait <= 0:
            return
        budget = deadline.left() if deadline is not None else max_wait_s
        if budget is None:
            budget = self.window_of(bucket) + self.margin_s
        if wait > budget:
            raise RateLimitedError(self._message(bucket, wait, budget, deadline is not None))
        if cancelled is not None:
            if cancelled.wait(wait):
                raise DownloadError(f"cancelled while waiting for the Hub's {bucket!r} rate limit")
        else:
            time.sleep(wait)

    def window_of(self, bucket: str) -> float:
        with self._lock:
            window = self._windows.get(bucket)
        return window.window_s if window is not None else WINDOW_S

    def _message(self, bucket: str, wait: float, budget: float, fetch: bool) -> str:
        usage = self.usage().get(bucket)
        quota = ""
        if usage is not None and usage.quota is not None:
            quota = f" ({usage.quota:,} requests per {_duration(usage.window_s)})"
        whose = "this fetch" if fetch else "a request"
        if get_token() is None:
            fix = "log in for a larger quota (`hf auth login`, or set HF_TOKEN)"
        else:
            fix = "a PRO account has a larger quota"
        return (
            f"the Hub's {bucket!r} rate limit is used up{quota}: it reopens in {_duration(wait)}, longer than "
            f"{whose} may wait ({_duration(budget)}); {fix}, or run again after it reopens ({DOCS_URL})"
        )

    # -- this process's requests per window -------------------------------------------------

    def _window(self, bucket: str, now: float) -> _Window:
        """`bucket`'s current window (under the lock), a new one once the last has ended."""
        window = self._windows.get(bucket)
        if window is None or now >= window.ends:
            length = window.window_s if window is not None else WINDOW_S
            quota = window.quota if window is not None else None
            window = self._windows[bucket] = _Window(now + length, length, quota=quota)
        return window

    def count(self, bucket: str) -> None:
        """One more request of this process in `bucket`."""
        with self._lock:
            self._window(bucket, self.clock()).requests += 1

    def observe(self, bucket: str, left: int, reset_s: float, quota: int | None, window_s: int | None) -> None:
        """What the Hub announced with an answer in `bucket`: the window is aligned to the Hub's,
        and when its count of requests left went up, a new window began there."""
        now = self.clock()
        with self._lock:
            window = self._window(bucket, now)
            if window.left is not None and left > window.left:
                window.requests = min(window.requests, 1)  # the Hub's new window: this answer's request
            window.left = left
            window.ends = now + reset_s
            if quota is not None:
                window.quota = quota
            if window_s:
                window.window_s = float(window_s)

    def usage(self) -> dict[str, Usage]:
        """Every bucket's current window (`BUCKETS` always, as 0 until used)."""
        now = self.clock()
        with self._lock:
            for bucket in BUCKETS:
                self._window(bucket, now)
            return {
                b: Usage(w.requests, w.quota, w.left, max(0.0, w.ends - now), w.window_s)
                for b, w in self._windows.items()
                if now < w.ends
            }


@dataclass
class _Window:
    ends: float
    window_s: float
    requests: int = 0
    quota: int | None = None
    left: int | None = None


def _duration(seconds: float) -> str:
    seconds = math.ceil(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, rest = divmod(seconds, 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


GATE = RateGate()  # the process's one gate: every reader and API call waits on it


def _on_response(response: httpx2.Response) -> None:
    """huggingface_hub's session calls this with every answer (redirects too): count the request,
    note what the Hub announced, and close the gate on a 429 that says when to ask again."""
    endpoint = hf_constants.ENDPOINT
    bucket = bucket_of(response.request.url, endpoint)
    if bucket != "cdn":
        GATE.count(bucket)
    info = parse_ratelimit_headers(response.headers)
    if info is not None:
        GATE.observe(info.resource_type, info.remaining, info.reset_in_seconds, info.limit, info.window_seconds)
    limit = limit_of(response, bucket)
    if limit is not None:
        GATE.close(limit)


_hook_lock = threading.Lock()


def observed_session() -> httpx2.Client:
    """huggingface_hub's shared HTTP session, with `_on_response` among its response hooks.

    The hook is added to the session object (httpx's `event_hooks`), not to a client factory of
    our own: huggingface_hub keeps making its session as it does. If it replaces its session (it
    closes it after a connection error), the next call here adds the hook to the new one.
    """
    client = get_session()
    if _on_response not in client.event_hooks["response"]:
        with _hook_lock:
            hooks = client.event_hooks
            if _on_response not in hooks["response"]:
                client.event_hooks = {**hooks, "response": [*hooks["response"], _on_response]}
    return client
