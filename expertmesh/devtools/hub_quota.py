"""The Hub's rate limits, as the local Hub emulates them: fixed windows per bucket and per client.

What the real service does, and where it is said:
- Requests are counted in fixed windows of 5 minutes, in buckets: `api` (the Hub API), `resolvers`
  (URLs with a `/resolve/` segment, which serve files) and `pages`; anonymous requests per IP,
  others per account (https://huggingface.co/docs/hub/rate-limits).
- Every answer carries the client's state in its bucket as `RateLimit: "<bucket>";r=<left>;t=<s>`
  and `RateLimit-Policy: "fixed window";"<bucket>";q=<quota>;w=<window s>` (the IETF draft
  huggingface_hub's `parse_ratelimit_headers` reads, utils/_http.py; a real resolve's answer
  quoted in raullenchai/Rapid-MLX issue 1122 carries `"resolvers";r=2999;t=172` and
  `"fixed window";"resolvers";q=3000;w=300`).
- Past the quota the answer is a 429 with those headers, `r=0`, and no `Retry-After`
  (huggingface_hub's `_http_backoff_base` waits on `t` + 1 s for that case).

Where the docs say nothing, this emulation chooses: the `/api/resolve-cache/` route that small
files are redirected to serves file content, so it is counted as `resolvers`, like `/resolve/`.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

BUCKETS = ("api", "resolvers")
WINDOW_S = 300.0  # the Hub's fixed window (docs: "All values are defined over 5-minute windows")
# The anonymous tier's quotas per window (docs); `expertmesh hub --like-huggingface` starts with these.
ANONYMOUS_QUOTAS = {"api": 500, "resolvers": 3000}


def bucket_of(path: str) -> str | None:
    """The bucket a request to the Hub's own origin counts in (None: not counted, e.g. `/_hub/`)."""
    if "/resolve/" in path or path.startswith("/api/resolve-cache/"):
        return "resolvers"
    if path.startswith("/api/"):
        return "api"
    return None


@dataclass
class _Window:
    ends: float  # time.monotonic() when this window closes
    used: int = 0


@dataclass(frozen=True)
class Answer:
    """What one request is told: `allowed` or not, and the headers that say so."""

    allowed: bool
    headers: dict[str, str]


class Quotas:
    """Fixed windows per (client, bucket). Windows start at a client's first request in a bucket
    (the real Hub's start on its own clock: a client learns where it is from `t`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], _Window] = {}

    def reset(self) -> None:
        with self._lock:
            self._windows.clear()

    def take(self, client: str, bucket: str, quota: int, window_s: float) -> Answer:
        """Count one request of `client` in `bucket`, against `quota` per `window_s`."""
        now = time.monotonic()
        with self._lock:
            w = self._windows.get((client, bucket))
            if w is None or now >= w.ends:
                w = self._windows[(client, bucket)] = _Window(now + window_s)
            allowed = w.used < quota
            if allowed:
                w.used += 1
            left = quota - w.used
            reset_s = max(1, math.ceil(w.ends - now))  # whole seconds, as the Hub sends them
        return Answer(
            allowed,
            {
                "RateLimit": f'"{bucket}";r={left};t={reset_s}',
                "RateLimit-Policy": f'"fixed window";"{bucket}";q={quota};w={math.ceil(window_s)}',
            },
        )
