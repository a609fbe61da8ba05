"""A node's Prometheus metrics, declared here next to their help text.

Counts that the store, the caches and the peer table already keep are read from them at scrape
time by one custom collector, so `/metrics` shows exactly the numbers a generation's summary is
made of and no code path can forget to count. Only what needs one observation per event is
observed as it happens: the latency histograms (`token_seconds`, `time_to_first_token_seconds`,
`request_seconds`, `expert_fetch_seconds{source}`, and `batch_size` of the batch engine's steps) and the token and speculation counters, through two small hooks —
the store's `StoreStats.observer` and the model's `token_observer`, both set by expertmesh/assembly.py.

Every node has its own `CollectorRegistry`, so several nodes in one process (tests) never collide.
A node with the API registers the coordinator's collector (coordinator/api_metrics.py) here too, so
the API's numbers come from the same target Prometheus already scrapes. Labels are fixed, small
sets (LABELS): never an expert id, a prompt or the household secret, and never a target label
(observability/prometheus_targets.py's TARGET_LABELS), which Prometheus would rename.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from expertmesh.node.store.stats import (
    AUDIT_OUTCOMES,
    COMPUTE_AUDIT_OUTCOMES,
    PREFETCH_OUTCOMES,
    REMOTE_COUNTS,
    SOURCES,
    StoreStats,
)

if TYPE_CHECKING:
    from expertmesh.node.engine.streamed_core import StreamedCore
    from expertmesh.node.household.membership import PeerTable
    from expertmesh.node.hub.client import RangeReader
    from expertmesh.node.store.tiers.disk import DiskCache
    from expertmesh.node.store.tiers.ram import RamCache

logger = logging.getLogger(__name__)

PREFIX = "expertmesh_"
# A token takes milliseconds on a warm Mac and minutes on a cold one (25.8 GB of K3 experts at 100 MB/s).
TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# The first token also pays the prefill: from a tenth of a second to half an hour.
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
# A whole request: as long as its first token, and up to its last one (32,768 cold K3 tokens would be days).
REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
# Rows of one batched decode step: 1 up to a few dozen (`serve --max-batch`).
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# An expert use: microseconds from RAM, milliseconds from SSD or the LAN, seconds from the Hub.
FETCH_BUCKETS_S = (
    1e-6,
    5e-6,
    2.5e-5,
    1e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
ROLES = ("full", "cache")
# Every label name a node's own metrics use (`le` is the histograms'); the API's are in
# coordinator/api_metrics.py's LABELS.
LABELS = ("source", "tier", "outcome", "role", "reason", "direction", "kind", "state", "bucket", "le")
TIERS = ("ram", "disk")
# Reasons always exported (as 0 until they happen), so an "errors by reason" panel has data on a
# healthy household; others (gRPC status names) appear when they first happen.
PEER_ERROR_REASONS = (
    "unavailable",
    "deadline_exceeded",
    "unauthenticated",
    "wrong_size",
    "bad_digest",
    "bad_bytes",
    "oversized",
    "hung",  # went quiet mid-fetch and failed its health check (node/rpc/call_watch.py)
)
HUB_ERROR_REASONS = ("retried", "slow")
DISK_ERROR_KINDS = ("write", "read", "refused")
SPECULATIVE_OUTCOMES = ("drafted", "accepted")


@dataclass
class MetricsSources:
    """What a node's numbers are read from; any part may be missing (a cache peer has no RAM tier).

    Args:
        stats: the store's `StoreStats` (uses, bytes, integrity failures, prefetch outcomes).
        ram: the `RamCache`; disk: the `DiskCache`; peers: the `PeerTable` the node follows.
        hub_readers: the Hub `RangeReader`s (their `retries`).
        core: a streamed core (node/engine/streamed_core.py's StreamedCore), whose reads are counted.
    """

    stats: StoreStats | None = None
    ram: RamCache | None = None
    disk: DiskCache | None = None
    peers: PeerTable | None = None
    hub_readers: list[RangeReader] = field(default_factory=list)
    core: StreamedCore | None = None


def _by_label(
    name: str, documentation: str, label: str, values: tuple[str, ...], counts: dict[str, int] | None
) -> CounterMetricFamily:
    """A counter family with one sample per value of `label`, read from `counts` (0 without them)."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for v in values:
        family.add_metric([v], counts[v] if counts is not None else 0)
    return family


class _StateCollector(Collector):
    """Reads the tiers' own counters at scrape time."""

    def __init__(self, src: MetricsSources):
        self.src = src

    def collect(self) -> Iterator:
        src = self.src
        stats = src.stats.snapshot() if src.stats is not None else None
        uses = CounterMetricFamily(
            PREFIX + "expert_requests",
            "Expert uses by the tier that answered them "
            "(ram|disk|peer|hub; remote: computed by the peer that holds it); a prefetched guess counts when it is used.",
            labels=["source"],
        )
        nbytes = CounterMetricFamily(
            PREFIX + "expert_bytes",
            "Upstream bytes of the experts used, by the tier that "
            "answered (source=hub: bytes that crossed the internet; experts computed remotely move "
            "activations instead, counted in expertmesh_activation_bytes_total).",
            labels=["source"],
        )
        bad = CounterMetricFamily(
            PREFIX + "integrity_failures",
            "Expert copies whose sha256 did not match the one "
            "recorded at first fetch, by where the copy came from; each was discarded.",
            labels=["source"],
        )
        for s in SOURCES:
            uses.add_metric([s], stats.uses[s] if stats else 0)
            if s != "remote":  # no expert moves: its LAN bytes are expertmesh_activation_bytes_total
                nbytes.add_metric([s], stats.bytes[s] if stats else 0)
            bad.add_metric([s], stats.integrity_failures[s] if stats else 0)
        yield from (uses, nbytes, bad)

        yield _by_label(
            PREFIX + "peer_audits",
            "Experts whose recorded digest came from a peer's copy, checked against fresh Hub copies (each "
            "peer's first copy, and a sample on the idle link), by outcome (confirmed; wrong: replaced, the "
            "peer no longer trusted; undecided; failed).",
            "outcome",
            AUDIT_OUTCOMES,
            stats.audits if stats else None,
        )
        yield _by_label(
            PREFIX + "compute_audits",
            "Peers' ComputeExperts answers computed again here (each peer's first, and one call in 4096), "
            "by outcome (confirmed; wrong: the peer no longer trusted; failed: the expert could not be had).",
            "outcome",
            COMPUTE_AUDIT_OUTCOMES,
            stats.compute_audits if stats else None,
        )
        yield CounterMetricFamily(
            PREFIX + "peer_audit_bytes",
            "Bytes the audits of peers' copies fetched from the Hub (not uses: not in expertmesh_expert_bytes_total).",
            value=stats.audit_bytes if stats else 0,
        )

        yield _by_label(
            PREFIX + "prefetch",
            "Guesses of the next layer's experts: issued (fetched), "
            "used (demanded by the pass they were for), wasted (not demanded).",
            "outcome",
            PREFETCH_OUTCOMES,
            stats.prefetch if stats else None,
        )

        remote = stats.remote if stats else dict.fromkeys(REMOTE_COUNTS, 0)
        yield CounterMetricFamily(
            PREFIX + "remote_calls",
            "ComputeExperts calls to peers (remote expert execution: one per peer per layer of a pass).",
            value=remote["calls"],
        )
        moved = CounterMetricFamily(
            PREFIX + "activation_bytes",
            "LAN bytes of remote expert execution (activations, not experts), "
            "by direction (sent: expert inputs; received: their outputs).",
            labels=["direction"],
        )
        moved.add_metric(["sent"], remote["sent_bytes"])
        moved.add_metric(["received"], remote["received_bytes"])
        fallbacks = CounterMetricFamily(
            PREFIX + "remote_fallbacks",
            "Experts placed on a peer but fetched and computed "
            "here instead, by reason (error, deadline, bad_output, missing).",
            labels=["reason"],
        )
        for reason in ("error", "deadline", "bad_output", "missing"):
            fallbacks.add_metric([reason], remote[f"fallback_{reason}"])
        yield from (moved, fallbacks)

        cache_bytes = GaugeMetricFamily(
            PREFIX + "cache_bytes",
            "Bytes held by each cache tier (RAM: decoded experts; disk: upstream bytes).",
            labels=["tier"],
        )
        cache_experts = GaugeMetricFamily(PREFIX + "cache_experts", "Experts held by each cache tier.", labels=["tier"])
        budget = GaugeMetricFamily(PREFIX + "cache_budget_bytes", "Each cache tier's byte budget.", labels=["tier"])
        evictions = CounterMetricFamily(
            PREFIX + "cache_evictions", "Experts dropped by each cache tier to stay within its budget.", labels=["tier"]
        )
        for tier, cache in (("ram", src.ram), ("disk", src.disk)):
            # a cache peer has no RAM tier: its series stay at 0
            cache_bytes.add_metric([tier], cache.nbytes if cache is not None else 0)
            cache_experts.add_metric([tier], len(cache) if cache is not None else 0)
            budget.add_metric([tier], cache.budget_bytes if cache is not None else 0)
            evictions.add_metric([tier], cache.evictions if cache is not None else 0)
        yield from (cache_bytes, cache_experts, budget, evictions)

        disk = src.disk
        writing = GaugeMetricFamily(
            PREFIX + "disk_cache_writing",
            "1 while the disk tier keeps new experts; 0 while its disk refuses writes (full, read-only, "
            "failing: tried again every minute) or another process on this home keeps the cache.",
        )
        writing.add_metric([], 0 if disk is None or disk.refused else 1)
        disk_errors = CounterMetricFamily(
            PREFIX + "disk_cache_errors",
            "Disk tier failures by kind (write: an expert not kept; read: a copy lost to a read error; "
            "refused: the disk turned writing off). Generation goes on from the other tiers.",
            labels=["kind"],
        )
        counts = (disk.write_errors, disk.read_errors, disk.refusals) if disk is not None else (0, 0, 0)
        for kind, n in zip(DISK_ERROR_KINDS, counts):
            disk_errors.add_metric([kind], n)
        skipped = CounterMetricFamily(
            PREFIX + "digest_records_skipped",
            "Torn or malformed lines of the digest book skipped at reading (the book is then compacted).",
        )
        replaced = CounterMetricFamily(
            PREFIX + "digests_replaced",
            "Recorded expert digests replaced because two fresh copies from the Hub agreed against them.",
        )
        skipped.add_metric([], disk.digests.skipped_lines if disk is not None else 0)
        replaced.add_metric([], disk.digests.replaced if disk is not None else 0)
        on_disk = GaugeMetricFamily(
            PREFIX + "disk_expert_bytes",
            "Expert bytes on disk by state: verified (two fresh copies from the Hub agreed: "
            "`expertmesh verify`) or unverified (checked against the digest of their first fetch).",
            labels=["state"],
        )
        verified = unverified = 0
        if disk is not None:
            sizes = disk.held_sizes()
            verified = sum(n for key, n in sizes.items() if disk.digests.verified(key))
            unverified = sum(sizes.values()) - verified
        on_disk.add_metric(["verified"], verified)
        on_disk.add_metric(["unverified"], unverified)
        yield from (writing, disk_errors, skipped, replaced, on_disk)

        peers = GaugeMetricFamily(
            PREFIX + "peers", "Live peers this node knows (not skipped after an error), by role.", labels=["role"]
        )
        live = dict.fromkeys(ROLES, 0)
        errors = dict.fromkeys(PEER_ERROR_REASONS, 0)
        if src.peers is not None:
            for p in src.peers.all():
                if p.live:
                    live[p.role] = live.get(p.role, 0) + 1
            errors.update(dict(src.peers.errors))
        for role, n in live.items():
            peers.add_metric([role], n)
        peer_errors = CounterMetricFamily(
            PREFIX + "peer_errors",
            "Peers skipped after a failure, by reason (a gRPC "
            "status name, or wrong_size, bad_digest, bad_bytes, oversized for fetches; "
            "compute_* and bad_output for remote execution; not_serving and health_* "
            "for health checks).",
            labels=["reason"],
        )
        for reason, n in errors.items():
            peer_errors.add_metric([reason], n)
        yield from (peers, peer_errors)

        hub = dict.fromkeys(HUB_ERROR_REASONS, 0)
        for reader in src.hub_readers:
            hub["retried"] += reader.retries
            hub["slow"] += reader.slow_responses
        hub_errors = CounterMetricFamily(
            PREFIX + "hub_errors",
            "Hub range requests that failed, by reason (retried: failed attempts that were retried with backoff; "
            "slow: responses given up below the speed floor, also counted as retried).",
            labels=["reason"],
        )
        for reason, n in hub.items():
            hub_errors.add_metric([reason], n)
        yield hub_errors
        yield from _rate_limit_metrics()

        if src.core is not None:
            core = src.core.stats
            yield CounterMetricFamily(
                PREFIX + "core_read_bytes",
                "Bytes of a streamed core read from the local SSD (a core larger than the memory plan allows "
                "is read layer by layer every token; divide by tokens_generated_total for bytes per token).",
                value=core.read_bytes,
            )
            yield CounterMetricFamily(
                PREFIX + "core_read_wait_seconds",
                "Seconds the model waited for a streamed core's layers to be read (what the reads ahead did not hide).",
                value=core.wait_s,
            )
            yield GaugeMetricFamily(
                PREFIX + "core_held_bytes",
                "Bytes of a streamed core in memory now: what it keeps, its pinned layers, and the layers in flight.",
                value=src.core.held_bytes,
            )


def _rate_limit_metrics() -> Iterator:
    """The Hub's rate limits as this process met them (node/hub/rate_limit.py's one gate), by the
    bucket the Hub named (`resolvers`: file downloads, every expert; `api`; others as they come)."""
    from expertmesh.node.hub.rate_limit import BUCKETS, GATE

    limited = CounterMetricFamily(
        PREFIX + "hub_rate_limited",
        "Answers of HTTP 429 for a used-up Hub rate limit (RateLimit r=0, or Retry-After), by bucket; each "
        "closed the bucket's gate, which every request of this process waited on.",
        labels=["bucket"],
    )
    waited = CounterMetricFamily(
        PREFIX + "hub_rate_limit_wait_seconds",
        "Seconds the Hub's rate limit kept a bucket's gate closed, counted once however many requests waited.",
        labels=["bucket"],
    )
    counts, seconds = dict(GATE.limited), dict(GATE.waited_s)
    for bucket in sorted(set(BUCKETS) | set(counts) | set(seconds)):
        limited.add_metric([bucket], counts.get(bucket, 0))
        waited.add_metric([bucket], seconds.get(bucket, 0.0))
    yield from (limited, waited)


class NodeMetrics:
    """One node's registry: the state collector, the token counters and the latency histograms.

    expertmesh/assembly.py makes it the store's and the model's observer, then serves it on `/metrics`.
    """

    def __init__(self, src: MetricsSources):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(src))
        self.tokens = Counter(
            PREFIX + "tokens_generated",
            "Tokens generated (sampled and returned; an end-of-sequence token is not counted).",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens fed to the model.", registry=self.registry
        )
        self.prompt_tokens_reused = Counter(
            PREFIX + "prompt_tokens_reused",
            "Prompt tokens a stored prefix held (node/engine/prefix_cache.py), so not fed to the model.",
            registry=self.registry,
        )
        self.prefix_lookups = Counter(
            PREFIX + "prefix_cache_lookups",
            "Generations that looked for a stored prefix of their prompt: found one (hit) or not (miss).",
            labelnames=["outcome"],
            registry=self.registry,
        )
        for outcome in ("hit", "miss"):
            self.prefix_lookups.labels(outcome)
        self.generations = Counter(PREFIX + "generations", "Generations started.", registry=self.registry)
        self.token_seconds = Histogram(
            PREFIX + "token_seconds",
            "Time per generated token: since the previous token, "
            "or for the first one since the request (prefill included).",
            buckets=TOKEN_BUCKETS_S,
            registry=self.registry,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a request to its first token.",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            PREFIX + "request_seconds",
            "Time from a request to its last token (or its end): one observation per generation.",
            buckets=REQUEST_BUCKETS_S,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            PREFIX + "batch_size",
            "Sequences decoded together in one forward pass of the batch engine (one observation per step; "
            "node/engine/batching.py).",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.fetch_seconds = Histogram(
            PREFIX + "expert_fetch_seconds",
            "Time to get one used expert from the tier "
            "that answered (RAM: a lookup; disk, peer, hub: read, verify and decode).",
            labelnames=["source"],
            buckets=FETCH_BUCKETS_S,
            registry=self.registry,
        )
        # every source has a series from the start; children kept, as a use is observed per expert
        self._fetch_by_source = {s: self.fetch_seconds.labels(s) for s in SOURCES}
        # Speculation's counters live in each Generator (a chat's), so the node sums them as they happen.
        self.speculative_tokens = Counter(
            PREFIX + "speculative_tokens",
            "Speculative decoding: tokens drafted, and "
            "drafted tokens the big model accepted (0 while speculation is off).",
            labelnames=["outcome"],
            registry=self.registry,
        )
        for o in SPECULATIVE_OUTCOMES:
            self.speculative_tokens.labels(o)
        self.prompt_substituted = Counter(
            PREFIX + "prompt_expert_uses_substituted",
            "Prompt expert uses an approximate prompt (--prompt-experts other than exact) substituted or "
            "dropped instead of fetching the chosen expert; 0 while every prompt is exact.",
            registry=self.registry,
        )

    # -- hooks --------------------------------------------------------------------------------

    def observe_fetch(self, source: str, nbytes: int, seconds: float) -> None:
        child = self._fetch_by_source.get(source)
        (child if child is not None else self.fetch_seconds.labels(source)).observe(seconds)

    def prompt(self, tokens: int) -> None:
        self.generations.inc()
        self.prompt_tokens.inc(tokens)

    def prefix(self, reused: int) -> None:
        """A generation looked for a stored prefix of its prompt; `reused` tokens were held (0: none)."""
        self.prefix_lookups.labels("hit" if reused else "miss").inc()
        self.prompt_tokens_reused.inc(reused)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token(self, seconds: float) -> None:
        self.tokens.inc()
        self.token_seconds.observe(seconds)

    def request(self, seconds: float) -> None:
        """One generation ended, `seconds` after its request."""
        self.request_seconds.observe(seconds)

    def prompt_approximated(self, substituted: int) -> None:
        """An approximate prompt ended its prefill having substituted `substituted` expert uses."""
        self.prompt_substituted.inc(substituted)

    def batch(self, size: int) -> None:
        """One batched decode step over `size` sequences."""
        self.batch_size.observe(size)

    def speculative(self, drafted: int, accepted: int) -> None:
        """One verify pass: `drafted` tokens checked, `accepted` of them kept."""
        self.speculative_tokens.labels("drafted").inc(drafted)
        self.speculative_tokens.labels("accepted").inc(accepted)

    # -- serving ------------------------------------------------------------------------------

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
        """Serve `/metrics` (prometheus_client's WSGI app) on a thread; `port` 0 picks a free one.

        The server is stdlib's, as in prometheus_client's own `start_http_server`, with one
        addition: it notes which scrapes were answered, for `MetricsServer.linger`.

        Raises:
            OSError: the address cannot be listened on.
        """
        scrapes = _Scrapes()
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, sockaddr = infos[0][0], infos[0][4]
        address = str(sockaddr[0])  # an IPv4 or IPv6 address: a TCP port's passive address
        server_class: type[_ThreadingWSGIServer] = type(
            "MetricsHTTPServer", (_ThreadingWSGIServer,), {"address_family": family}
        )
        server = make_server(
            address, port, scrapes.wrap(make_wsgi_app(self.registry)), server_class, handler_class=_QuietHandler
        )
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        return MetricsServer(server, thread, host, server.server_port, scrapes)


# /metrics needs no key and listens where gRPC does (the LAN, for `serve`): a thread per connection
# is bounded, and a connection that sends nothing is dropped, so idle sockets cannot exhaust a node.
METRICS_CONNECTIONS = 32  # a household's Prometheus and a few curls at once
METRICS_READ_TIMEOUT_S = 10.0


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck scraper never holds the process

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(METRICS_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # every slot taken: this one is closed at once
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        logger.debug("metrics: a connection from %s failed", client_address, exc_info=True)  # not a traceback on stderr


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_S  # StreamRequestHandler puts it on the socket

    def log_message(self, format: str, *args) -> None:
        pass  # one line per scrape on stderr would bury the summary


class _Scrapes:
    """Which scrapes of `/metrics` were answered, numbered in the order they began.

    A scrape counts as answered once its last byte was written to the socket: the body is
    wrapped in a generator that wsgiref asks for more after the last write, and only a body
    exhausted that way counts (a scraper that hung up midway does not).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.begun = 0  # scrapes begun so far; the next one gets this number
        self.latest_answered = -1  # the number of the latest-begun scrape that was answered

    def wrap(self, app: Callable) -> Callable:
        def counted(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/favicon.ico":  # a browser's, not a scrape
                return app(environ, start_response)
            with self._cond:
                n = self.begun
                self.begun += 1
            return self._answer(n, app(environ, start_response))

        return counted

    def _answer(self, n: int, body: Iterable[bytes]) -> Iterator[bytes]:
        yield from body
        with self._cond:  # reached only when asked for more after the last chunk was written
            self.latest_answered = max(self.latest_answered, n)
            self._cond.notify_all()

    def next_number(self) -> int:
        """The number the next scrape to begin will get."""
        with self._cond:
            return self.begun

    def answered_since(self, mark: int, timeout: float) -> bool:
        """Wait up to `timeout` s until a scrape numbered `mark` or later was answered."""
        with self._cond:
            return self._cond.wait_for(lambda: self.latest_answered >= mark, timeout)


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    host: str
    port: int
    scrapes: _Scrapes = field(default_factory=_Scrapes, repr=False)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        return f"http://{host}:{self.port}/metrics"

    def linger(self, seconds: float, announce: Callable[[], None] | None = None) -> bool:
        """Keep serving until a scrape that begins from now on was answered, or for `seconds`,
        whichever comes first; True if such a scrape was answered. Call it once the counts are
        final; `stop` afterwards. `announce` (telling the user what it waits for) is called once
        the scrapes that count are marked: a scrape sent on reading it counts, however soon it
        arrives (marked after it, one that beat this thread to the lock waited out the bound).

        Why: `run` lasts seconds, often less than Prometheus' scrape interval, and its counters
        are final only when its generation ends. Stopping the server right then leaves Prometheus
        with whatever an earlier scrape saw (fewer tokens than the summary printed), or nothing. One scrape that began after the counts stopped moving carries them all, so there
        is nothing to wait for after it; the bound keeps a `run` that nobody scrapes (no
        Prometheus, or one that does not know this port) from waiting long. A scrape already in
        flight when this is called may have read the counts before they were final: it does not
        count.
        """
        mark = self.scrapes.next_number()
        if announce is not None:
            announce()
        return seconds > 0 and self.scrapes.answered_since(mark, seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
